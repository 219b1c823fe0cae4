//! The front cache: blocks of expandable segments freed on the hit path, kept whole by exact
//! size in front of the pools, not merged with their neighbours until something needs the
//! merged view (lazy coalescing, as mimalloc's and snmalloc's per-size free lists do).
//!
//! PyTorch's `free` merges every freed block with its free neighbours (`free_block`,
//! `try_merge_blocks`) and its `malloc` splits the best fit again (`get_free_block`,
//! `alloc_found_block`): a program that frees and allocates one size in a loop pays a merge, a
//! split and four pool updates per pair for the same bytes. gpupool's free puts such a block
//! here instead, and malloc takes a block of exactly the rounded size from here first: no
//! search, no split, no merge.
//!
//! What it changes, and what it does not:
//! - Only blocks of expandable segments enter (gpupool's default). PyTorch counts no
//!   `inactive_split` there, so every statistic is what the merged view gives: a cached block
//!   is inactive (not allocated, not active) from its free on, as in PyTorch.
//! - Every lock of a shard but the hit path's (malloc, free, `record_stream`) merges the
//!   front cache into the pools first ([`ShardState::drain_front`]): `empty_cache`, the
//!   out-of-memory path, unmapping pages, snapshots, the largest-request search, statistics'
//!   settles and `garbage_collection_threshold` all see PyTorch's merged pools.
//! - A malloc that the front cache does not serve exactly merges it first, and takes PyTorch's
//!   best fit from the merged pools: only a request of a size freed lately skips the search.
//!   (Searching the pools without merging first split other blocks than PyTorch's, and
//!   reserved 2% more on vit_train replayed on the simulated device.)
//! - Bounded: [`FRONT_SLOTS`] blocks and [`FRONT_BYTES`] bytes a shard; the oldest block is
//!   merged into its pool when a new one would pass either bound.
//!
//! Which block serves a request of a cached size: the front cache's lowest of that size, unless
//! the pool holds one of that size lower still (then the pools are merged and searched), as
//! PyTorch's best fit takes the lowest address among equals. Where gpupool differs from
//! PyTorch: PyTorch compares blocks merged with their free neighbours, so a cached block that
//! would have merged into a larger one can be handed out where PyTorch splits another block of
//! exactly the size elsewhere. Sizes and statistics are the same; addresses may differ then.

use super::ShardState;
use crate::caching::block::{BlockId, BlockState};
use crate::caching::rules::PoolKind;
use crate::driver::DevicePtr;

/// Blocks a shard's front cache holds at most: a scan of this many sizes is cheaper than one
/// probe of the pools' hash map (callgrind, `examples/hit_loop`).
pub(crate) const FRONT_SLOTS: usize = 16;

/// Bytes a shard's front cache holds at most. Cached blocks are merged before any growth, so
/// the bound limits what a miss must merge, not what the device reserves.
pub(crate) const FRONT_BYTES: usize = 256 << 20;

/// The blocks of one shard's front cache, oldest first; sizes in bytes.
#[derive(Debug, Default)]
pub(crate) struct FrontCache {
    len: usize,
    bytes: usize,
    sizes: [usize; FRONT_SLOTS],
    addrs: [DevicePtr; FRONT_SLOTS],
    ids: [BlockId; FRONT_SLOTS],
}

impl FrontCache {
    /// Whether it holds no block.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Takes out the block of exactly `size` bytes at the lowest address, if it lies below
    /// `below` (PyTorch's best fit among equals: the lowest address).
    #[inline(always)]
    pub fn take(&mut self, size: usize, below: DevicePtr) -> Option<BlockId> {
        let mut found = None;
        let mut lowest = below;
        for i in 0..self.len {
            if self.sizes[i] == size && self.addrs[i] < lowest {
                lowest = self.addrs[i];
                found = Some(i);
            }
        }
        let i = found?;
        let id = self.ids[i];
        self.remove(i);
        Some(id)
    }

    /// Takes out entry `i`, keeping the order of the rest.
    #[inline(always)]
    fn remove(&mut self, i: usize) {
        self.bytes -= self.sizes[i];
        if i + 1 < self.len {
            self.sizes.copy_within(i + 1..self.len, i);
            self.addrs.copy_within(i + 1..self.len, i);
            self.ids.copy_within(i + 1..self.len, i);
        }
        self.len -= 1;
    }

    /// Whether a block of `size` bytes fits without passing a bound.
    #[inline(always)]
    pub fn has_room(&self, size: usize) -> bool {
        self.len < FRONT_SLOTS && self.bytes + size <= FRONT_BYTES
    }

    /// Adds the block `id` of `size` bytes at `addr`, the newest. The caller made room
    /// ([`FrontCache::has_room`], [`FrontCache::pop_oldest`]); a block over [`FRONT_BYTES`]
    /// alone never enters.
    #[inline(always)]
    pub fn push(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        debug_assert!(self.has_room(size));
        // `len` read once: each store to `sizes` may alias it, and reading it again cost a
        // bounds check each (callgrind).
        let i = self.len;
        self.sizes[i] = size;
        self.addrs[i] = addr;
        self.ids[i] = id;
        self.len = i + 1;
        self.bytes += size;
    }

    /// Takes out the oldest block.
    pub fn pop_oldest(&mut self) -> Option<BlockId> {
        if self.len == 0 {
            return None;
        }
        let id = self.ids[0];
        self.remove(0);
        Some(id)
    }

    /// The blocks held, as (size, id), oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (usize, BlockId)> + '_ {
        self.sizes[..self.len].iter().copied().zip(self.ids[..self.len].iter().copied())
    }
}

impl ShardState {
    /// Gives the block `id`, freed and counted inactive, to the cache: an expandable block to
    /// the front cache (the oldest merged into its pool first while it has no room), any other
    /// to its pool (PyTorch `free_block`). Returns whether the front cache took it: it then
    /// stays in the live map, which the caller otherwise takes it out of.
    #[inline(always)]
    pub(super) fn cache_freed(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        let (size, addr) = (b.size, b.addr);
        if !b.expandable || size > FRONT_BYTES {
            self.merge_free(id);
            return false;
        }
        while !self.front.has_room(size) {
            self.merge_oldest();
        }
        self.frees = self.frees.wrapping_add(1);
        let b = &mut self.blocks[id];
        b.state = BlockState::Cached;
        b.freed_at = self.frees;
        self.front.push(size, addr, id);
        true
    }

    #[cold]
    #[inline(never)]
    fn merge_oldest(&mut self) {
        if let Some(old) = self.front.pop_oldest() {
            self.merge_cached(old);
        }
    }

    /// Takes out of the front cache its lowest block of exactly `rounded` bytes in `pool`,
    /// unless the pool holds one of that size at a lower address: PyTorch's best fit among
    /// blocks of one size is the lowest (the caller then merges and searches the pools).
    #[inline(always)]
    pub fn take_front(&mut self, rounded: usize, pool: PoolKind) -> Option<BlockId> {
        let below = self.pool_ref(pool).lowest_of(rounded).unwrap_or(DevicePtr::MAX);
        let id = self.front.take(rounded, below)?;
        debug_assert_eq!(self.blocks[id].state, BlockState::Cached);
        Some(id)
    }

    /// Merges every block of the front cache into its pool, as PyTorch's `free_block` would
    /// have at its free.
    #[inline]
    pub fn drain_front(&mut self) {
        if !self.front.is_empty() {
            self.drain_all();
        }
    }

    #[cold]
    #[inline(never)]
    fn drain_all(&mut self) {
        while let Some(id) = self.front.pop_oldest() {
            self.merge_cached(id);
        }
    }

    /// Merges a block just taken out of the front cache into its pool, out of the live map,
    /// with the stamp of its free.
    fn merge_cached(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (addr, stamp) = (b.addr, b.freed_at);
        self.live.remove(&addr);
        self.merge_stamped(id, stamp);
    }

    /// The front cache's blocks, as (size, id), for the consistency check.
    pub(super) fn front_blocks(&self) -> impl Iterator<Item = (usize, BlockId)> + '_ {
        self.front.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_the_newest_of_a_size_and_keeps_the_order_of_the_rest() {
        let mut f = FrontCache::default();
        for (size, addr, id) in [(512, 0x9000, 1), (1024, 0x1000, 2), (512, 0x3000, 3), (2048, 0x5000, 4)] {
            assert!(f.has_room(size));
            f.push(size, addr, id);
        }
        assert_eq!(f.bytes, 4096);
        assert_eq!(f.take(512, 0x3000), None, "the pool's block of the size is lower");
        assert_eq!(f.take(512, u64::MAX), Some(3), "the lowest block of the size");
        assert_eq!(f.take(4096, u64::MAX), None);
        assert_eq!(f.iter().collect::<Vec<_>>(), [(512, 1), (1024, 2), (2048, 4)]);
        assert_eq!(f.pop_oldest(), Some(1));
        assert_eq!(f.take(2048, u64::MAX), Some(4));
        assert_eq!(f.take(1024, u64::MAX), Some(2));
        assert!(f.is_empty());
        assert_eq!((f.bytes, f.pop_oldest()), (0, None));
    }

    #[test]
    fn bounded_in_blocks_and_bytes() {
        let mut f = FrontCache::default();
        for id in 0..FRONT_SLOTS as BlockId {
            f.push(512, 0x1000 * u64::from(id), id);
        }
        assert!(!f.has_room(512), "full at {FRONT_SLOTS} blocks");
        assert_eq!(f.pop_oldest(), Some(0));
        assert!(f.has_room(512));
        assert!(!f.has_room(FRONT_BYTES), "bytes bound");
        let mut g = FrontCache::default();
        assert!(g.has_room(FRONT_BYTES) && !g.has_room(FRONT_BYTES + 512));
        g.push(FRONT_BYTES, 0x1000, 7);
        assert!(!g.has_room(512));
    }
}
