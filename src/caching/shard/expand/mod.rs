//! Expandable segments in a shard (PyTorch's `expandable_segments:True`): a segment is an
//! address range reserved per (stream, pool) whose pages are mapped as requests need them, so
//! that it grows instead of a new segment being allocated, and whose wholly free pages are
//! unmapped when the cache is released.
//!
//! The blocks of an expandable segment tile its whole range, as an ordinary segment's do:
//! mapped blocks (free, allocated, awaiting events or a synchronisation) and unmapped blocks
//! (whole pages, [`BlockState::Unmapped`], in the pool's set of unmapped blocks ordered by
//! address). Two unmapped blocks are never neighbours, nor are two free ones.
//!
//! - [`ShardState::grow_expandable`]: PyTorch `try_allocate_expandable_block` with
//!   `find_expandable_block` and `map_block`;
//! - [`ShardState::release_pages`]: the expandable half of PyTorch `release_blocks`, with
//!   `unmap_block`.
//!
//! Where gpupool differs: the address range is sized by use (see [`ExpandablePolicy`]) rather
//! than 1.125 times the device's memory per stream and pool, so that thousands of streams do
//! not exhaust the address space, and a shard may hold several ranges per pool; before pages
//! are unmapped the device is synchronised, never a stream (a stream the program destroyed
//! would crash `cudaStreamSynchronize`, as it crashes PyTorch 2.11's `emptyCache`); a map that
//! fails halfway is undone (PyTorch keeps what it mapped); each range counts as a segment
//! (PyTorch counts none); and a segment does not grow past the device's high-water mark while
//! free pages are mapped (see `Reclaim`; PyTorch unmaps only in `empty_cache` and on out of
//! memory).

use super::{Growth, Reclaim, SegmentInfo, ShardCtx, ShardState};
use crate::caching::block::{Block, BlockId, BlockState, NIL};
use crate::caching::counters::{Metric, bump};
use crate::caching::expandable::Expandable;
use crate::caching::rules::PoolKind;
use crate::caching::segment_index::SegmentEntry;
use crate::driver::{DevicePtr, DriverError};
use crate::error::Error;
use crate::history::HistoryContext;

/// How a device's expandable segments are laid out. Sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExpandablePolicy {
    /// Page size of the small pool's segments (PyTorch: `kSmallBuffer`, 2 MiB).
    pub small_page: usize,
    /// Page size of the large pool's segments (PyTorch: `kLargeBuffer`, 20 MiB; gpupool: 2 MiB,
    /// see `device`).
    pub large_page: usize,
    /// The device's total memory (`cuMemGetInfo`): a shard's first range in the large pool
    /// is an eighth of it, in the small pool a sixty-fourth, and each further range of a pool
    /// twice the largest it has, or the request if that is larger.
    pub device_total: usize,
}

impl ExpandablePolicy {
    fn page(&self, pool: PoolKind) -> usize {
        match pool {
            PoolKind::Small => self.small_page,
            PoolKind::Large => self.large_page,
        }
    }

    /// Bytes of address space for a new range of `pool` that must hold `need` bytes, when the
    /// shard's largest range of that pool is `largest` bytes (0: none).
    fn range_size(&self, pool: PoolKind, need: usize, largest: usize) -> Option<usize> {
        let page = self.page(pool);
        let share = match pool {
            PoolKind::Small => self.device_total / 64,
            PoolKind::Large => self.device_total / 8,
        };
        let want = need.max(share).max(largest.saturating_mul(2)).max(page);
        want.checked_next_multiple_of(page)
    }
}

/// A step of a growth's plan: (block, offset of its pages in the range, bytes to map).
type MapStep = (BlockId, usize, usize);

fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// Maps the pages of `plan` (block, offset, bytes) in `e`, counting in `attempted` the entries
/// tried. When one fails (it undid its own pages), the earlier ones are unmapped again; a page
/// the driver keeps stays mapped, and counted.
fn map_plan(ctx: &ShardCtx, e: &mut Expandable, plan: &[MapStep], attempted: &mut usize) -> Result<(), DriverError> {
    for (i, &(_, offset, len)) in plan.iter().enumerate() {
        *attempted = i + 1;
        if let Err(err) = e.map(ctx.driver, ctx.device, offset, len) {
            for &(_, offset, len) in plan[..i].iter().rev() {
                let _ = e.unmap(ctx.driver, ctx.device, offset, len);
            }
            return Err(err);
        }
    }
    Ok(())
}

impl ShardState {
    fn unmapped_set(&mut self, pool: PoolKind) -> &mut std::collections::BTreeSet<(DevicePtr, BlockId)> {
        &mut self.unmapped[pool as usize]
    }

    /// The expandable segment whose range contains `addr`.
    fn expandable_of(&self, addr: DevicePtr) -> (DevicePtr, &Expandable) {
        for &base in &self.expandables {
            let e = self.segments[&base].exp.as_deref().expect("listed segments are expandable");
            if addr >= base && addr - base < e.size as u64 {
                return (base, e);
            }
        }
        unreachable!("block {addr:#x} lies in no expandable segment of its shard")
    }

    /// PyTorch `try_allocate_expandable_block`: a free block of at least `req.rounded` bytes
    /// made by mapping pages in one of the stream's expandable segments of the request's pool
    /// (the first, by address, where free and unmapped blocks in a row are large enough), or in
    /// a new one; taken out of the pool for the caller to hand out.
    ///
    /// Errors: [`DriverError::OutOfMemory`] when the device (or the memory fraction) has no
    /// room for the pages; any other failure of the virtual memory calls. The pages mapped
    /// for the request are unmapped again then; the shard is as it was, but for a new range
    /// that could not be given back (it stays, empty, until the cache is released).
    ///
    /// While history is on, the pages mapped are recorded as `segment_map` events (those of a
    /// failed call that the driver would not unmap included), with the call's stack, which is
    /// left for the `alloc` event of the block handed out.
    pub fn grow_expandable(&mut self, ctx: &ShardCtx, rounded: usize, pool: PoolKind) -> Result<Growth, DriverError> {
        let policy = ctx.expandable.expect("only called with expandable segments on");
        let c = if ctx.history.on() { ctx.history.capture(HistoryContext::State) } else { 0 };
        let (start, plan) = self.plan_growth(ctx, policy, pool, rounded, c)?;
        let bytes: usize = plan.iter().map(|p| p.2).sum();
        let over = ctx.limit.over_mark(bytes);
        if over > 0 && ctx.reclaim != Reclaim::Off {
            // The free pages outside the bytes the request will take (the free blocks the plan
            // walks may hold more than it needs), as many as it passes the mark by. The plan
            // stays valid: the blocks it maps keep their addresses (a block after them that is
            // unmapped merges into the last of them). Opportunistic: a failure to synchronise
            // or unmap leaves those pages cached (the next release of the cache reports it),
            // and the request maps past the mark.
            let at = self.blocks[start].addr;
            let unmapped = self.unmap_free_pages(ctx, over, Some(at..at + rounded as u64)).unwrap_or(0);
            if unmapped < over && ctx.reclaim == Reclaim::Device {
                let base = self.expandable_of(at).0;
                self.free_range_if_empty(ctx, base);
                return Ok(Growth::PastMark(over - unmapped));
            }
        }
        let base = self.expandable_of(self.blocks[start].addr).0;
        let Some(charge) = ctx.limit.try_charge(bytes) else {
            self.free_range_if_empty(ctx, base);
            return Err(DriverError::OutOfMemory);
        };
        let mapped_before = self.segments[&base].exp.as_deref().expect("expandable").mapped;
        let mut attempted = 0;
        let result = {
            // The blocks follow the page table whatever happens, unwinding included; the
            // memory limit keeps what was mapped.
            let mut g = scopeguard::guard((&mut *self, &mut attempted, charge), |(st, attempted, charge)| {
                let grown = st.adopt(ctx, base, plan[..*attempted].iter().map(|p| p.0), mapped_before);
                charge.commit_part(grown.max(0) as usize);
                if ctx.history.on() {
                    for &(_, offset, len) in &plan[..*attempted] {
                        st.record_pages(ctx, base, offset, len, true, c);
                    }
                }
            });
            let (st, attempted, _) = &mut *g;
            let e = st.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
            map_plan(ctx, e, &plan, attempted)
        };
        if let Err(e) = result {
            self.free_range_if_empty(ctx, base);
            return Err(e);
        }
        // The free block at `start`'s address now holds at least `rounded` bytes: blocks merge
        // into their lower neighbour, and `start` had no free block before it.
        let b = &self.blocks[start];
        debug_assert!(b.state == BlockState::Free && b.size >= rounded);
        let (size, addr) = (b.size, b.addr);
        self.pool(pool).remove(size, addr, start);
        self.pending_ctx = c;
        Ok(Growth::Block(start))
    }

    /// Where to grow for a request of `rounded` bytes of `pool`: the first block of a run of
    /// free and unmapped blocks that holds it (in a new range if no range has one), and the
    /// pages to map, as (block, offset in its range, bytes): free and unmapped blocks from the
    /// start on, until `rounded` bytes are reached (PyTorch maps the same, block by block).
    /// `c`: the history's stack for a new range's event.
    fn plan_growth(
        &mut self,
        ctx: &ShardCtx,
        policy: &ExpandablePolicy,
        pool: PoolKind,
        rounded: usize,
        c: u32,
    ) -> Result<(BlockId, Vec<MapStep>), DriverError> {
        let start = match self.find_expandable(pool, rounded) {
            Some(id) => id,
            None => self.reserve_range(ctx, policy, pool, rounded, c)?,
        };
        let (base, page) = {
            let (base, e) = self.expandable_of(self.blocks[start].addr);
            (base, e.page)
        };
        let mut plan = Vec::new();
        let (mut have, mut id) = (0usize, start);
        while have < rounded {
            let b = &self.blocks[id];
            if b.state == BlockState::Unmapped {
                let map = round_up(rounded - have, page).min(b.size);
                plan.push((id, (b.addr - base) as usize, map));
                have += map;
            } else {
                have += b.size;
            }
            id = b.next;
        }
        Ok((start, plan))
    }

    /// PyTorch `find_expandable_block`: the first unmapped block of the pool (by address)
    /// that, with the free block before it if any and the free and unmapped blocks after it,
    /// holds `size` bytes. Returns the first block of that run.
    fn find_expandable(&self, pool: PoolKind, size: usize) -> Option<BlockId> {
        let usable =
            |id: BlockId| id != NIL && matches!(self.blocks[id].state, BlockState::Free | BlockState::Unmapped);
        for &(_, u) in &self.unmapped[pool as usize] {
            let prev = self.blocks[u].prev;
            let start = if usable(prev) { prev } else { u };
            let (mut bytes, mut id) = (0, start);
            while bytes < size && usable(id) {
                bytes += self.blocks[id].size;
                id = self.blocks[id].next;
            }
            if bytes >= size {
                return Some(start);
            }
        }
        None
    }

    /// A new expandable segment of `pool` for a request of `size` bytes, wholly unmapped:
    /// its one block is returned.
    fn reserve_range(
        &mut self,
        ctx: &ShardCtx,
        policy: &ExpandablePolicy,
        pool: PoolKind,
        size: usize,
        c: u32,
    ) -> Result<BlockId, DriverError> {
        let largest = self
            .expandables
            .iter()
            .filter(|b| self.blocks[self.segments[b].head].pool == pool)
            .map(|b| self.segments[b].size)
            .max()
            .unwrap_or(0);
        let va = policy.range_size(pool, size, largest).ok_or(DriverError::OutOfMemory)?;
        let exp = Expandable::reserve(ctx.driver, ctx.device, va, policy.page(pool))?;
        let base = exp.base;
        let id = self.blocks.insert(Block::new(base, va, BlockState::Unmapped, pool, true));
        self.segments.insert(base, SegmentInfo { head: id, size: va, exp: Some(Box::new(exp)), ctx: c, graph: false });
        self.expandables.push(base);
        self.unmapped_set(pool).insert((base, id));
        ctx.index.insert(SegmentEntry { base, size: va, device: ctx.device, owner: ctx.shard.clone() });
        self.counters.increase(Metric::Segment, pool, 1);
        Ok(id)
    }

    /// Gives back the range of the expandable segment at `base` if nothing is mapped in it
    /// (its one block is unmapped). A failure leaves it as it is, to be tried again when the
    /// cache is next released.
    fn free_range_if_empty(&mut self, ctx: &ShardCtx, base: DevicePtr) {
        let seg = self.segments.get_mut(&base).expect("listed");
        let (size, head) = (seg.size, seg.head);
        let e = seg.exp.as_deref_mut().expect("expandable");
        if e.mapped != 0 {
            return;
        }
        let pool = self.blocks[head].pool;
        debug_assert_eq!(self.blocks[head].next, NIL);
        // Out of the index first: once the driver has the range back, another stream may
        // reserve the same addresses. Back in if the driver refuses.
        ctx.index.remove(base);
        let reindex = scopeguard::guard((), |()| {
            ctx.index.insert(SegmentEntry { base, size, device: ctx.device, owner: ctx.shard.clone() })
        });
        if e.free(ctx.driver, ctx.device).is_err() {
            return;
        }
        scopeguard::ScopeGuard::into_inner(reindex);
        self.unmapped_set(pool).remove(&(base, head));
        self.blocks.remove(head);
        self.segments.remove(&base);
        self.expandables.retain(|&b| b != base);
        self.counters.decrease(Metric::Segment, pool, 1);
    }

    /// Makes the blocks of `ids` (each unmapped, or free in its pool) follow the page table
    /// of the expandable segment at `base`: mapped stretches become free blocks in the pool,
    /// unmapped ones unmapped blocks, each merged with its neighbours of the same kind. Counts
    /// the change from `mapped_before`, the bytes the segment had mapped before, in reserved
    /// bytes and as PyTorch's `map_block`/`unmap_block` do (`num_device_alloc`,
    /// `num_device_free`). Returns that change (bytes, negative when unmapped).
    fn adopt(
        &mut self,
        ctx: &ShardCtx,
        base: DevicePtr,
        ids: impl Iterator<Item = BlockId>,
        mapped_before: usize,
    ) -> isize {
        for id in ids {
            self.follow_pages(base, id);
        }
        let pool = self.blocks[self.segments[&base].head].pool;
        let change = self.segments[&base].exp.as_deref().expect("expandable").mapped as isize - mapped_before as isize;
        self.counters.change(Metric::ReservedBytes, pool, change as i64);
        match change.signum() {
            1 => bump(&ctx.counters.num_device_alloc),
            -1 => bump(&ctx.counters.num_device_free),
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

    /// The expandable half of PyTorch `release_blocks` (`empty_cache`, the out-of-memory
    /// path): every wholly free page of this shard's expandable segments is unmapped and
    /// released (see [`ShardState::unmap_free_pages`]), and a range left with nothing mapped
    /// is given back. Returns the bytes unmapped.
    ///
    /// Errors: [`Error::Cuda`] when the synchronisation or an unmapping fails; what was
    /// unmapped stays unmapped, the rest stays cached.
    pub fn release_pages(&mut self, ctx: &ShardCtx) -> Result<usize, Error> {
        let released = self.unmap_free_pages(ctx, usize::MAX, None);
        for base in self.expandables.clone() {
            let e = self.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
            e.release_orphans(ctx.driver, ctx.device);
            self.free_range_if_empty(ctx, base);
        }
        released
    }

    /// PyTorch `unmap_block` over the free blocks of this shard's expandable segments, the
    /// largest first, until `want` bytes are unmapped (whole pages; the last block gives only
    /// what is still wanted, from its lower end), skipping blocks that overlap `keep`. First
    /// the device is synchronised, if anything is to be unmapped (with the shard's lock held,
    /// so that no block of this stream is handed out and freed again meanwhile): a block
    /// freed in stream order may still be in use by work queued before its free, and
    /// `cuMemUnmap` does not wait for it. A device synchronisation, not a stream's (PyTorch
    /// synchronises the segment's stream): the stream may have been destroyed. Returns the
    /// bytes unmapped.
    ///
    /// Errors: [`Error::Cuda`] when the synchronisation or an unmapping fails; what was
    /// unmapped stays unmapped, the rest stays cached.
    pub fn unmap_free_pages(
        &mut self,
        ctx: &ShardCtx,
        want: usize,
        keep: Option<std::ops::Range<DevicePtr>>,
    ) -> Result<usize, Error> {
        // (segment base, block, first page offset, end offset) of each free block with whole
        // pages outside `keep`'s pages, largest first. `keep` starts at a block's address, so
        // a block overlapping it starts in it: only its pages after `keep` are candidates.
        let mut candidates: Vec<(DevicePtr, BlockId, u64, u64)> = Vec::new();
        for pool in [&self.small, &self.large] {
            for (size, addr, id) in pool.iter_largest_first() {
                if !self.blocks[id].expandable {
                    continue;
                }
                let end = addr + size as u64;
                let (base, e) = self.expandable_of(addr);
                let page = e.page as u64;
                let mut lo = (addr - base).div_ceil(page) * page;
                let mut hi = (end - base) / page * page;
                if let Some(k) = keep.as_ref().filter(|k| k.start >= base && k.start - base < e.size as u64) {
                    if addr >= k.start {
                        lo = lo.max((k.end - base).div_ceil(page) * page);
                    } else {
                        hi = hi.min((k.start - base) / page * page);
                    }
                }
                if hi > lo {
                    candidates.push((base, id, lo, hi));
                }
            }
        }
        candidates.sort_by_key(|c| std::cmp::Reverse(c.3 - c.2));
        let mut released = 0;
        // The device synchronisation below would break a capture, which may be under way while
        // a route to a private pool is active: the pages stay mapped until then.
        if candidates.is_empty() || ctx.capture.any_underway() {
            return Ok(0);
        }
        ctx.driver.device_synchronize(ctx.device).map_err(|e| {
            Error::driver(e, "synchronising the device before unmapping the free pages of expandable segments")
        })?;
        for (base, id, lo, hi) in candidates {
            if released >= want {
                break;
            }
            let (before, page) = {
                let e = self.segments[&base].exp.as_deref().expect("expandable");
                (e.mapped, e.page)
            };
            let left = (want - released) as u64;
            let len = if left >= hi - lo { hi - lo } else { round_up(left as usize, page) as u64 };
            // The block follows the page table whatever happens, unwinding included, and the
            // pages unmapped are recorded.
            let mut g = scopeguard::guard(&mut *self, |st| {
                let shrunk = -st.adopt(ctx, base, std::iter::once(id), before);
                ctx.limit.uncharge(shrunk.max(0) as usize);
                if ctx.history.on() {
                    let c = st.segments[&base].ctx;
                    st.record_pages(ctx, base, lo as usize, len as usize, false, c);
                }
            });
            let e = g.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
            let r = e.unmap(ctx.driver, ctx.device, lo as usize, len as usize);
            drop(g);
            released += before - self.segments[&base].exp.as_deref().expect("expandable").mapped;
            r.map_err(|e| Error::driver(e, "unmapping the free pages of an expandable segment"))?;
        }
        Ok(released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_grow_with_use_and_stay_whole_pages() {
        let p = ExpandablePolicy { small_page: 2 << 20, large_page: 20 << 20, device_total: 80 << 30 };
        assert_eq!(p.range_size(PoolKind::Large, 1 << 20, 0), Some(10 << 30));
        assert_eq!(p.range_size(PoolKind::Small, 512, 0), Some(1280 << 20));
        assert_eq!(p.range_size(PoolKind::Large, 1 << 20, 10 << 30), Some(20 << 30));
        assert_eq!(p.range_size(PoolKind::Large, 30 << 30, 10 << 30), Some(30 << 30));
        assert_eq!(p.range_size(PoolKind::Large, (30 << 30) + 1, 0), Some((30 << 30) + (20 << 20)));
        assert_eq!(p.range_size(PoolKind::Large, usize::MAX - 4, 0), None);
        let tiny = ExpandablePolicy { small_page: 2 << 20, large_page: 20 << 20, device_total: 64 << 20 };
        assert_eq!(tiny.range_size(PoolKind::Large, 512, 0), Some(20 << 20));
    }
}
