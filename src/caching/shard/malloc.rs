//! The malloc side of a shard served from its cache: a request rounded and placed by the size
//! rules, the best fit taken out of its pool, and the block split and handed out (PyTorch
//! `malloc` with `get_free_block`, `should_split` and `alloc_found_block`). The cache-hit malloc
//! runs through here.

use super::ShardState;
use crate::caching::accounting::counters::OVERSIZE_ALLOCATIONS;
use crate::caching::block::{BlockId, BlockState};
use crate::caching::rules::{self, PoolKind, SizeRules};
use crate::driver::DevicePtr;
use crate::error::Error;

/// A request after PyTorch's rounding: `size` as asked, `rounded` (the block size), its pool
/// and the segment size to ask the driver for if nothing cached fits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub size: usize,
    pub rounded: usize,
    pub pool: PoolKind,
    pub segment: usize,
}

impl Request {
    /// `size` rounded and placed by the device's `rules`.
    ///
    /// Errors: [`Error::InvalidValue`] when rounding the size overflows.
    ///
    /// Inlined: malloc's hit path calls it, and out of line it cost a call there.
    #[inline(always)]
    pub fn new(size: usize, rules: &SizeRules) -> Result<Request, Error> {
        Request::fits(size, rules).ok_or_else(|| Request::overflow(size))
    }

    /// [`Request::new`], `None` when rounding overflows ([`Request::overflow`] says so): on
    /// the hit path, where the `Result`'s move copied the request's padding (4 instructions a
    /// malloc, callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    pub fn fits(size: usize, rules: &SizeRules) -> Option<Request> {
        let rounded = rules::round_size(size, rules)?;
        let segment = rules::segment_size(rounded, rules)?;
        Some(Request { size, rounded, pool: rules::pool_for(rounded), segment })
    }

    /// The error of a request of `size` bytes whose rounding overflows.
    #[cold]
    #[inline(never)]
    pub fn overflow(size: usize) -> Error {
        Error::InvalidValue(format!("size {size} bytes overflows when rounded to a block size"))
    }
}

impl Request {
    /// The request rounded up to a multiple of `align` bytes, its segment too (a pool whose
    /// blocks are not split below `align`: `pools::source::PoolSource::split_alignment`), and
    /// placed in the pool its new size belongs to.
    ///
    /// Errors: [`Error::InvalidValue`] when rounding overflows.
    pub fn aligned(self, align: usize) -> Result<Request, Error> {
        let up = |n: usize| {
            n.checked_next_multiple_of(align).ok_or_else(|| {
                Error::InvalidValue(format!("size {} bytes overflows when rounded to {align} bytes", self.size))
            })
        };
        let rounded = up(self.rounded)?;
        let segment = up(self.segment.max(rounded))?;
        Ok(Request { size: self.size, rounded, pool: rules::pool_for(rounded), segment })
    }
}

impl ShardState {
    /// PyTorch `get_free_block`: the best fit in the request's pool, within the
    /// `max_split_size` rules, taken out of the pool.
    #[inline]
    pub fn take_cached(&mut self, req: &Request, size_rules: &SizeRules) -> Option<BlockId> {
        let rounded = req.rounded;
        let fits = |size| rules::fits_oversize_rules(size, rounded, size_rules);
        self.pool(req.pool).take_best_fit(rounded, fits).map(|(_, _, id)| id)
    }

    /// The rest of PyTorch `malloc` once a block is found: split off what is not needed
    /// (`should_split`), mark it allocated and count it. Returns the block's address.
    #[inline]
    pub fn hand_out(&mut self, id: BlockId, req: &Request, max_split_size: usize) -> DevicePtr {
        let kept = self.split(id, req.rounded, max_split_size);
        let addr = self.allocate(id, req, kept, max_split_size);
        self.live.insert(addr, id);
        addr
    }

    /// [`ShardState::hand_out`] of a block of exactly the rounded size from the front cache,
    /// which nothing is split from (`should_split` is false for a block the request fills),
    /// and which is in the live map already (see `live`).
    #[inline(always)]
    pub fn hand_out_whole(&mut self, id: BlockId, req: &Request, max_split_size: usize) -> DevicePtr {
        debug_assert_eq!(self.blocks[id].size, req.rounded);
        self.allocate(id, req, req.rounded, max_split_size)
    }

    /// Marks the block `id` of `kept` bytes allocated for `req` and counts it.
    #[inline(always)]
    fn allocate(&mut self, id: BlockId, req: &Request, kept: usize, max_split_size: usize) -> DevicePtr {
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = req.size;
        let (addr, pool) = (b.addr, b.pool);
        self.last_out = (addr, id);
        // allocation, allocated_bytes, active, active_bytes and requested_bytes (see
        // `accounting::counters::pending_sums`).
        let c = &mut self.counters;
        c.hit_increase(pool, kept as i64, req.size as i64);
        if kept >= max_split_size {
            c.increase_single(OVERSIZE_ALLOCATIONS);
        }
        addr
    }
}
