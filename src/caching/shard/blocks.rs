//! Splitting a block for a request and merging a freed block with its free neighbours, with
//! PyTorch's `inactive_split` bookkeeping.

use super::ShardState;
use crate::caching::accounting::counters::Metric;
use crate::caching::block::{Block, BlockId, BlockState, NIL};
use crate::caching::rules;
use crate::driver::DevicePtr;

impl ShardState {
    /// The address of block `id`: a block made by a growth keeps it when it is split and handed
    /// out (the head is handed out), so it names the block the request gets.
    pub(crate) fn block_addr(&self, id: BlockId) -> DevicePtr {
        self.blocks[id].addr
    }

    /// PyTorch `malloc`'s split (`should_split`): the block `id`, taken from its pool, keeps
    /// `rounded` bytes and the rest becomes a free block in the pool. Returns the bytes the
    /// block keeps. Counts PyTorch's `inactive_split` changes: a whole block that is split adds
    /// an inactive split block; an inactive split block shrinks, or becomes active whole.
    pub(super) fn split(&mut self, id: BlockId, rounded: usize, max_split_size: usize) -> usize {
        let b = &self.blocks[id];
        let (addr, size, pool, expandable) = (b.addr, b.size, b.pool, b.expandable);
        // PyTorch counts no `inactive_split` in expandable segments: their wholly free pages
        // can always be given back.
        let already_split = b.is_split() && !expandable;
        // A pool that never splits (PyTorch's `no_split_pools`, asked first in `should_split`).
        // Not a branch of its own: the front cache's hit, which never splits, does not come here.
        if !(rules::should_split(pool, size, rounded, max_split_size, expandable) & !self.no_split) {
            if already_split {
                self.counters.decrease(Metric::InactiveSplitBytes, pool, size as i64);
                self.counters.decrease(Metric::InactiveSplit, pool, 1);
            }
            return size;
        }
        let rest_size = size - rounded;
        let rest_addr = addr + rounded as u64;
        let rest = self.insert_after(id, rest_addr, rest_size, BlockState::Free);
        self.blocks[id].size = rounded;
        self.pool(pool).insert(rest_size, rest_addr, rest);
        if expandable {
        } else if already_split {
            self.counters.decrease(Metric::InactiveSplitBytes, pool, rounded as i64);
        } else {
            self.counters.increase(Metric::InactiveSplitBytes, pool, rest_size as i64);
            self.counters.increase(Metric::InactiveSplit, pool, 1);
        }
        rounded
    }

    /// A new block of `size` bytes at `addr` in `state`, linked into the segment's list right
    /// after `prev`, in `prev`'s pool and kind of segment (the upper part of a block that is
    /// split: the caller shrinks `prev`). Not filed in any pool or set.
    #[inline]
    pub(in crate::caching) fn insert_after(
        &mut self,
        prev: BlockId,
        addr: DevicePtr,
        size: usize,
        state: BlockState,
    ) -> BlockId {
        let p = &self.blocks[prev];
        let (pool, expandable, next) = (p.pool, p.expandable, p.next);
        let id = self.blocks.insert(Block { prev, next, ..Block::new(addr, size, state, pool, expandable) });
        if next != NIL {
            self.blocks[next].prev = id;
        }
        self.blocks[prev].next = id;
        id
    }

    /// PyTorch `free_block`: back to the pool, merged with free neighbours
    /// (`try_merge_blocks`), with PyTorch's net `inactive_split` change.
    pub(super) fn free_block(&mut self, id: BlockId) {
        self.count_inactive(id);
        self.merge_free(id);
    }

    /// The statistics of a block that stops being active: freed at once, or when its events
    /// completed, or into the front cache (PyTorch `free_block`'s `active` and `requested`
    /// changes). Reads the block's size and requested bytes, and clears the latter.
    #[inline(always)]
    pub(super) fn count_inactive(&mut self, id: BlockId) {
        let b = &mut self.blocks[id];
        let (size, requested, pool) = (b.size, b.requested, b.pool);
        b.requested = 0;
        let c = &mut self.counters;
        c.decrease(Metric::Active, pool, 1);
        c.decrease(Metric::ActiveBytes, pool, size as i64);
        c.decrease(Metric::RequestedBytes, pool, requested as i64);
    }

    /// The rest of PyTorch `free_block` for a block already counted inactive: merged with its
    /// free neighbours into its pool, with the net `inactive_split` change; stamped with the
    /// shard's count of frees (`garbage_collection_threshold`'s clock), counting this free.
    pub(super) fn merge_free(&mut self, id: BlockId) {
        self.frees = self.frees.wrapping_add(1);
        self.merge_stamped(id, self.frees);
    }

    /// [`ShardState::merge_free`] of a block whose free the clock counted already, at `stamp`
    /// (one from the front cache): the merged block keeps that stamp.
    pub(super) fn merge_stamped(&mut self, id: BlockId, stamp: u32) {
        let (pool, expandable) = (self.blocks[id].pool, self.blocks[id].expandable);
        let mut net_blocks = 0i64;
        let mut net_bytes = 0i64;
        let mut id = id;
        let prev = self.blocks[id].prev;
        if let Some(merged) = self.take_if_free(prev) {
            self.absorb_next(prev);
            id = prev;
            net_blocks -= 1;
            net_bytes -= merged as i64;
        }
        let next = self.blocks[id].next;
        if let Some(merged) = self.take_if_free(next) {
            self.absorb_next(id);
            net_blocks -= 1;
            net_bytes -= merged as i64;
        }
        let b = &mut self.blocks[id];
        b.state = BlockState::Free;
        b.requested = 0;
        b.freed_at = stamp;
        let (size, addr, split) = (b.size, b.addr, b.is_split());
        self.pool(pool).insert(size, addr, id);
        if split {
            net_blocks += 1;
            net_bytes += size as i64;
        }
        if !expandable {
            let c = &mut self.counters;
            c.change(Metric::InactiveSplit, pool, net_blocks);
            c.change(Metric::InactiveSplitBytes, pool, net_bytes);
        }
    }

    /// A free block of an expandable segment that is not in its pool yet (memory just mapped,
    /// or the rest around pages just unmapped) joins it, merged with its free neighbours
    /// (PyTorch `map_block`/`unmap_block` with `try_merge_blocks`; no statistic changes: the
    /// caller counts the mapping, and expandable blocks have no `inactive_split`). Returns the
    /// id of the merged block.
    pub(in crate::caching) fn insert_free(&mut self, id: BlockId) -> BlockId {
        debug_assert!(self.blocks[id].expandable);
        let mut id = id;
        let prev = self.blocks[id].prev;
        if self.take_if_free(prev).is_some() {
            self.absorb_next(prev);
            id = prev;
        }
        let next = self.blocks[id].next;
        if self.take_if_free(next).is_some() {
            self.absorb_next(id);
        }
        let b = &mut self.blocks[id];
        b.state = BlockState::Free;
        b.requested = 0;
        let (size, addr, pool) = (b.size, b.addr, b.pool);
        self.pool(pool).insert(size, addr, id);
        id
    }

    /// One merge step of `try_merge_blocks`, first half: if the neighbour `other` of a block
    /// being freed is free, takes it out of its pool and returns its size; the caller then
    /// merges the upper of the two blocks into the lower ([`ShardState::absorb_next`]).
    pub(super) fn take_if_free(&mut self, other: BlockId) -> Option<usize> {
        if other == NIL || self.blocks[other].state != BlockState::Free {
            return None;
        }
        let o = &self.blocks[other];
        let (size, addr, pool) = (o.size, o.addr, o.pool);
        self.pool(pool).remove(size, addr, other);
        Some(size)
    }

    /// Merges the block after `id` into `id` (the lower block survives, so a segment's head
    /// keeps its id).
    pub(in crate::caching) fn absorb_next(&mut self, id: BlockId) {
        let next = self.blocks[id].next;
        let (nsize, nnext) = (self.blocks[next].size, self.blocks[next].next);
        let b = &mut self.blocks[id];
        b.size += nsize;
        b.next = nnext;
        if nnext != NIL {
            self.blocks[nnext].prev = id;
        }
        self.blocks.remove(next);
    }
}
