//! The blocks of an expandable segment follow its page table: after pages are mapped or
//! unmapped, mapped stretches become free blocks in the pool and unmapped ones unmapped blocks,
//! and the change is counted (PyTorch `map_block` and `unmap_block` do this block by block).

use crate::caching::accounting::counters::Metric;
use crate::caching::block::{BlockId, BlockState, NIL};
use crate::caching::observers::segments::SegmentEventKind;
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
        // Stretches of the block over which the page table does not change: (start, mapped),
        // each the opposite of the one before.
        let mut cuts: Vec<(DevicePtr, bool)> = Vec::new();
        let (mut at, end) = ((addr - base) as usize, (addr - base) as usize + size);
        while at < end {
            let (mapped, next) = page_run(e.page_table(), e.page, at, end);
            cuts.push((base + at as u64, mapped));
            at = next;
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

/// Whether the page at `offset` bytes into an expandable segment of page table `table` and
/// pages of `page` bytes is mapped, and where (bytes, at most `end`) the run of pages like it
/// from there ends. A run of unmapped pages that reaches the table's end runs to `end` at once:
/// a growth's block over the rest of its range (thousands of pages) was walked a page at a time,
/// with two divisions each (about 100,000 instructions a growth replaying vit_train on the
/// simulated device, 11% of the replay's, callgrind).
fn page_run<T>(table: &[Option<T>], page: usize, offset: usize, end: usize) -> (bool, usize) {
    let first = offset / page;
    let last = end.div_ceil(page).min(table.len());
    let mapped = table.get(first).is_some_and(Option::is_some);
    let mut i = first + 1;
    while i < last && table[i].is_some() == mapped {
        i += 1;
    }
    if !mapped && i >= table.len() {
        return (false, end);
    }
    (mapped, (i * page).min(end))
}

#[cfg(test)]
mod tests {
    use super::page_run;

    /// [`page_run`] against a page at a time, over every offset and end of a small table.
    #[test]
    fn runs_match_a_walk_of_each_page() {
        let table: Vec<Option<u64>> = [1, 1, 0, 1, 0, 0, 1, 1, 1, 0].iter().map(|&m| (m == 1).then_some(7)).collect();
        let page = 4;
        let mapped = |off: usize| table.get(off / page).is_some_and(Option::is_some);
        for offset in (0..60).step_by(page) {
            for end in offset + 1..64 {
                let want = mapped(offset);
                let mut stop = offset;
                while stop < end && mapped(stop) == want {
                    stop = (stop / page + 1) * page;
                }
                assert_eq!(page_run(&table, page, offset, end), (want, stop.min(end)), "offset {offset}, end {end}");
            }
        }
    }
}
