//! Segments: obtained from the driver when nothing cached fits, and given back when wholly
//! free (`empty_cache`, the out-of-memory path).

use super::{Growth, Request, SegmentInfo, ShardCtx, ShardState};
use crate::caching::accounting::counters::{Metric, OVERSIZE_SEGMENTS};
use crate::caching::block::{Block, BlockId, BlockState};
use crate::caching::observers::segments::{SegmentEvent, SegmentEventKind};
use crate::caching::segment_index::SegmentEntry;
use crate::driver::DriverError;
use crate::error::Error;
use crate::history::Action;

impl ShardState {
    /// A free block for `req` from the driver, taken out of the pool, when no cached block
    /// fits (PyTorch `alloc_block`): by growing an expandable segment when the device has
    /// them, else as a new segment. A failure of the virtual memory calls other than out of
    /// memory (`CUDA_ERROR_NOT_PERMITTED` under a debugger, say) falls back to a new ordinary
    /// segment for this request.
    ///
    /// While history is on, the segment's events are recorded, and the stack captured for
    /// them (if stacks are kept) is left for the `alloc` event of the block handed out
    /// ([`ShardState::record_alloc_at`]).
    pub fn grow(&mut self, ctx: &ShardCtx, req: &Request) -> Result<Growth, DriverError> {
        if ctx.expandable.is_some() {
            match self.grow_expandable(ctx, req.rounded, req.pool) {
                Err(DriverError::Cuda { .. } | DriverError::Unavailable(_)) => {}
                r => return r,
            }
        }
        self.new_segment(ctx, req).map(Growth::Block)
    }

    /// PyTorch `alloc_block`: a new segment from the driver, as one free block (not in the
    /// pool: the caller hands it out at once).
    ///
    /// A device with a memory fraction set refuses a segment that would take its reserved
    /// bytes past the limit, as out of memory (PyTorch `alloc_block` with `set_fraction`).
    /// The bytes are counted against the limit before the driver is asked, and given back if
    /// it fails or its call unwinds; against the pool's budget too (`caching::budget`), whose
    /// refusal is out of memory as well.
    ///
    /// A sleepable private pool's segments are expandable, during a capture too (see
    /// `caching::sleep`): its memory is always on the virtual memory API.
    pub fn new_segment(&mut self, ctx: &ShardCtx, req: &Request) -> Result<BlockId, DriverError> {
        if ctx.shard.pool != 0 && ctx.expandable.is_some() {
            return match self.grow_expandable(ctx, req.rounded, req.pool)? {
                Growth::Block(id) => Ok(id),
                Growth::PastMark(_) => Err(DriverError::OutOfMemory),
            };
        }
        let size = req.segment;
        // The pool's budget first (`caching::budget`), then the device's fraction.
        let budget = ctx.shard.budget.try_charge(size).ok_or(DriverError::OutOfMemory)?;
        let charge = ctx.limit.try_charge(size).ok_or(DriverError::OutOfMemory)?;
        let addr = match &ctx.shard.source {
            Some(s) => (s.alloc)(size, ctx.device, ctx.shard.stream).ok_or(DriverError::OutOfMemory)?,
            None => ctx.driver.mem_alloc(ctx.device, size)?,
        };
        charge.commit();
        budget.commit();
        let id = self.blocks.insert(Block::new(addr, size, BlockState::Free, req.pool, false));
        let c = if ctx.history.on() { self.record_segment(ctx, addr, size) } else { 0 };
        self.segments.insert(addr, SegmentInfo { head: id, size, exp: None, ctx: c, graph: false });
        ctx.index.insert(SegmentEntry { base: addr, size, device: ctx.device, owner: ctx.shard.clone() });
        self.counters.increase(Metric::Segment, req.pool, 1);
        self.counters.increase(Metric::ReservedBytes, req.pool, size as i64);
        if size >= ctx.max_split_size {
            self.counters.increase_single(OVERSIZE_SEGMENTS);
        }
        self.counters.device_allocs += 1;
        if ctx.segments.on() {
            self.observe_later(ctx, SegmentEventKind::Alloc, addr, size);
        }
        Ok(id)
    }

    /// Queues a segment event of an allocation or mapping, for the call to deliver once the
    /// lock is dropped. Flags the counters for a settle, so that the end of the call
    /// (`DeviceAllocator::finish_call`) looks at the queue on its slow branch only.
    pub(in crate::caching) fn observe_later(
        &mut self,
        ctx: &ShardCtx,
        kind: SegmentEventKind,
        address: u64,
        bytes: usize,
    ) {
        let (device, stream, pool) = (ctx.device, ctx.shard.stream, ctx.shard.pool);
        self.segment_events.push(SegmentEvent { kind, device, address, bytes, stream, pool });
        self.counters.needs_settle = true;
    }

    /// Delivers a segment event of a free or an unmapping now, with the lock held, before the
    /// driver call: the queued events first, so that each range is told mapped before unmapped.
    pub(in crate::caching) fn observe_now(
        &mut self,
        ctx: &ShardCtx,
        kind: SegmentEventKind,
        address: u64,
        bytes: usize,
    ) {
        let queued = std::mem::take(&mut self.segment_events);
        ctx.segments.deliver(&queued);
        let (device, stream, pool) = (ctx.device, ctx.shard.stream, ctx.shard.pool);
        ctx.segments.deliver(&[SegmentEvent { kind, device, address, bytes, stream, pool }]);
        // An observer ended its thread (`crate::callout`): the call goes on to its end, and its
        // end then takes the slow branch, where the thread's end goes on
        // (`DeviceAllocator::finish_slow`).
        if crate::callout::exiting() {
            self.counters.needs_settle = true;
        }
    }

    /// PyTorch `release_block`: a whole free segment goes back to the driver.
    pub(super) fn release_segment(&mut self, ctx: &ShardCtx, id: BlockId) -> Result<(), Error> {
        let b = &self.blocks[id];
        debug_assert!(b.state == BlockState::Free && !b.is_split());
        let (addr, size, pool) = (b.addr, b.size, b.pool);
        let c = self.segments[&addr].ctx;
        // Out of the index first: once the driver has the memory back, another stream's new
        // segment may start at the same address. Back in if the driver fails, or unwinds.
        ctx.index.remove(addr);
        let reindex = scopeguard::guard((), |()| {
            ctx.index.insert(SegmentEntry { base: addr, size, device: ctx.device, owner: ctx.shard.clone() })
        });
        if ctx.segments.on() {
            self.observe_now(ctx, SegmentEventKind::Free, addr, size);
        }
        // Recorded with the trace held across the call: the stream that gets the address next
        // records its `segment_alloc` after this `segment_free`.
        let freed = ctx.history.record_around(Action::SegmentFree, addr, size, ctx.shard.stream, c, || {
            match &ctx.shard.source {
                Some(s) => {
                    (s.free)(addr, size, ctx.device, ctx.shard.stream);
                    Ok(())
                }
                None => ctx.driver.mem_free(ctx.device, addr),
            }
        });
        if let Err(e) = freed {
            if ctx.segments.on() {
                self.observe_later(ctx, SegmentEventKind::Alloc, addr, size);
            }
            return Err(Error::driver(e, "returning a cached segment to the driver"));
        }
        scopeguard::ScopeGuard::into_inner(reindex);
        self.pool(pool).remove(size, addr, id);
        self.segments.remove(&addr);
        self.blocks.remove(id);
        self.counters.decrease(Metric::Segment, pool, 1);
        self.counters.decrease(Metric::ReservedBytes, pool, size as i64);
        if size >= ctx.max_split_size {
            self.counters.decrease_single(OVERSIZE_SEGMENTS);
        }
        ctx.limit.uncharge(size);
        ctx.shard.budget.uncharge(size);
        self.counters.device_frees += 1;
        Ok(())
    }

    /// PyTorch `release_blocks` over both pools: every cached segment that is wholly free goes
    /// back to the driver, and the wholly free pages of expandable segments are unmapped
    /// ([`ShardState::release_pages`]). Split segments stay. The idle events are destroyed too (see
    /// `events`).
    /// A sleeping shard's memory is given back already, and its pages stay reserved for its
    /// wake; one a sleep is copying keeps its pages for the sleep: nothing is released there.
    pub fn release_cached(&mut self, ctx: &ShardCtx) -> Result<(), Error> {
        self.events.destroy_idle(ctx.driver, ctx.device);
        if self.keeps_pages() {
            return Ok(());
        }
        if !self.expandables.is_empty() {
            self.release_pages(ctx)?;
        }
        let whole: Vec<BlockId> = self.whole_cached().collect();
        for id in whole {
            self.release_segment(ctx, id)?;
        }
        self.small.sweep();
        self.large.sweep();
        Ok(())
    }

    /// The cached blocks that are a whole ordinary segment, free, that may go back to the
    /// driver.
    fn whole_cached(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.small
            .iter()
            .chain(self.large.iter())
            .map(|(_, _, id)| id)
            .filter(|&id| !self.blocks[id].is_split() && !self.blocks[id].expandable)
            .filter(|&id| self.releasable(self.blocks[id].addr))
    }

    /// Whether `release_cached_blocks` may change what this shard counts: it has events to
    /// wait for, blocks awaiting a capture's end, an expandable segment, or a whole free
    /// segment. If not, [`ShardState::release_cached`] only destroys idle events and drops
    /// empty bins, and the shard need not be locked for a change: the settle after the release
    /// then visits only the shards that changed, not every stream's (with N streams holding
    /// memory, N out-of-memory errors each visited N shards).
    pub fn has_cache_to_release(&self) -> bool {
        self.events_pending()
            || self.has_capture_deferred()
            || !self.expandables.is_empty()
            || self.whole_cached().next().is_some()
    }

    /// PyTorch `release_available_cached_blocks`: with `max_split_size` set, release oversize
    /// cached segments of the request's pool, the smallest that is big enough or else the
    /// largest ones until enough is released. Returns whether enough was.
    pub fn release_available(&mut self, ctx: &ShardCtx, req: &Request) -> Result<bool, Error> {
        let max = ctx.max_split_size;
        if max == usize::MAX {
            return Ok(false);
        }
        let want = req.rounded.max(max);
        let pool = self.pool(req.pool);
        if let Some((_, _, id)) = pool.best_fit(want) {
            if self.blocks[id].is_split() || self.blocks[id].expandable || !self.releasable(self.blocks[id].addr) {
                return Ok(false);
            }
            self.release_segment(ctx, id)?;
            return Ok(true);
        }
        let candidates: Vec<(usize, BlockId)> =
            pool.iter_largest_first().take_while(|&(size, _, _)| size >= max).map(|(s, _, id)| (s, id)).collect();
        let mut released = 0;
        for (size, id) in candidates {
            if released >= want {
                break;
            }
            if !self.blocks[id].is_split() && !self.blocks[id].expandable && self.releasable(self.blocks[id].addr) {
                self.release_segment(ctx, id)?;
                released += size;
            }
        }
        Ok(released >= want)
    }
}
