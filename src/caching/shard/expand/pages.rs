//! The blocks of an expandable segment follow its page table: after pages are mapped or
//! unmapped, mapped stretches become free blocks in the pool and unmapped ones unmapped blocks,
//! and the change is counted (PyTorch `map_block` and `unmap_block` do this block by block).

use crate::caching::block::{BlockId, BlockState, NIL};
use crate::caching::counters::Metric;
use crate::caching::segment_observers::SegmentEventKind;
use crate::caching::shard::{ShardCtx, ShardState};
use crate::driver::DevicePtr;

impl ShardState {
    /// Makes the blocks of `ids` (each unmapped, or free in its pool) follow the page table
    /// of the expandable segment at `base`: mapped stretches become free blocks in the pool,
    /// unmapped ones unmapped blocks, each merged with its neighbours of the same kind. Counts
    /// the change from `mapped_before`, the bytes the segment had mapped before, in reserved
    /// bytes and as PyTorch's `map_block`/`unmap_block` do (`num_device_alloc`,
    /// `num_device_free`). Returns that change (bytes, negative when unmapped).
    pub(super) fn adopt(&mut self, base: DevicePtr, ids: impl Iterator<Item = BlockId>, mapped_before: usize) -> isize {
        for id in ids {
            self.follow_pages(base, id);
        }
        let pool = self.blocks[self.segments[&base].head].pool;
        let change = self.segments[&base].exp.as_deref().expect("expandable").mapped as isize - mapped_before as isize;
        self.counters.change(Metric::ReservedBytes, pool, change as i64);
        match change.signum() {
            1 => self.counters.device_allocs += 1,
            -1 => self.counters.device_frees += 1,
            _ => {}
        }
        change
    }

    /// Splits block `id` (unmapped, or free and in its pool) of the segment at `base` where
    /// the page table changes between mapped and unmapped, and files each piece.
    fn follow_pages(&mut self, base: DevicePtr, id: BlockId) {
        let e = self.segments[&base].exp.as_deref().expect("expandable");
        let b = &self.blocks[id];
        let (addr, size, pool, state) = (b.addr, b.size, b.pool, b.state);
        let page = e.page as u64;
        // Stretches of the block over which the page table does not change: (start, mapped).
        let mut cuts: Vec<(DevicePtr, bool)> = Vec::new();
        let mut at = addr;
        while at < addr + size as u64 {
            let mapped = e.is_mapped((at - base) as usize);
            if cuts.last().is_none_or(|&(_, m)| m != mapped) {
                cuts.push((at, mapped));
            }
            at = base + ((at - base) / page + 1) * page;
        }
        let unchanged = cuts.len() == 1 && (cuts[0].1 == (state == BlockState::Free));
        if unchanged {
            return;
        }
        match state {
            BlockState::Unmapped => {
                self.unmapped_set(pool).remove(&(addr, id));
            }
            _ => self.pool(pool).remove(size, addr, id),
        }
        // The block keeps the first stretch; a new block for each further one.
        let end = addr + size as u64;
        let mut pieces = Vec::with_capacity(cuts.len());
        let mut prev = id;
        for (i, &(start, mapped)) in cuts.iter().enumerate() {
            let stop = cuts.get(i + 1).map_or(end, |c| c.0);
            let (size, state) = ((stop - start) as usize, if mapped { BlockState::Free } else { BlockState::Unmapped });
            let piece = if i == 0 {
                let b = &mut self.blocks[id];
                (b.size, b.state) = (size, state);
                id
            } else {
                self.insert_after(prev, start, size, state)
            };
            pieces.push((piece, mapped));
            prev = piece;
        }
        for (piece, mapped) in pieces {
            if mapped {
                self.insert_free(piece);
            } else {
                self.insert_unmapped(piece);
            }
        }
    }

    /// Queues a `Map` segment event for each stretch of mapped pages in `len` bytes at `offset`
    /// of the expandable segment at `base` (see `segment_observers`).
    pub(super) fn observe_mapped(&mut self, ctx: &ShardCtx, base: DevicePtr, offset: usize, len: usize) {
        let e = self.segments[&base].exp.as_deref().expect("expandable");
        let page = e.page;
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for at in (offset..offset + len).step_by(page) {
            if !e.is_mapped(at) {
                continue;
            }
            match runs.last_mut() {
                Some((start, n)) if *start + *n == at => *n += page,
                _ => runs.push((at, page)),
            }
        }
        for (at, n) in runs {
            self.observe_later(ctx, SegmentEventKind::Map, base + at as u64, n);
        }
    }

    /// An unmapped block joins the pool's set of unmapped blocks, merged with unmapped
    /// neighbours (the lower block survives).
    fn insert_unmapped(&mut self, id: BlockId) {
        let pool = self.blocks[id].pool;
        let mut id = id;
        let prev = self.blocks[id].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Unmapped {
            let addr = self.blocks[prev].addr;
            self.unmapped_set(pool).remove(&(addr, prev));
            self.absorb_next(prev);
            id = prev;
        }
        let next = self.blocks[id].next;
        if next != NIL && self.blocks[next].state == BlockState::Unmapped {
            let addr = self.blocks[next].addr;
            self.unmapped_set(pool).remove(&(addr, next));
            self.absorb_next(id);
        }
        let addr = self.blocks[id].addr;
        self.unmapped_set(pool).insert((addr, id));
    }
}
