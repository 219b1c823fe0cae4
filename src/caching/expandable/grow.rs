//! Growing an expandable segment (PyTorch `try_allocate_expandable_block` with
//! `find_expandable_block` and `map_block`): where the request fits among the free and unmapped
//! blocks, or in a new range, and mapping the pages it needs.

use super::{ExpandablePolicy, round_up};
use crate::caching::accounting::counters::Metric;
use crate::caching::block::{Block, BlockId, BlockState, NIL};
use crate::caching::budget;
use crate::caching::expandable::Expandable;
use crate::caching::rules::PoolKind;
use crate::caching::segment_index::SegmentEntry;
use crate::caching::shard::{Growth, SegmentInfo, ShardCtx, ShardState};
use crate::driver::{DriverError, PhysHandle};
use crate::history::HistoryContext;

/// A step of a growth's plan: (block, offset of its pages in the range, bytes to map).
type MapStep = (BlockId, usize, usize);

/// Maps the pages of `plan` (block, offset, bytes) in `e`, held handles of `spare` first,
/// counting in `attempted` the entries tried. When one fails (it undid its own pages), the
/// earlier ones are unmapped again, their handles to `spare`; a page the driver keeps stays
/// mapped, and counted.
fn map_plan(
    ctx: &ShardCtx,
    e: &mut Expandable,
    plan: &[MapStep],
    attempted: &mut usize,
    spare: &mut Vec<PhysHandle>,
) -> Result<(), DriverError> {
    // Read under the shard's lock, so that a peer enabled meanwhile is either in it or granted
    // these pages by the enable (see `caching::peers`).
    let access = ctx.peers.access(ctx.device);
    for (i, &(_, offset, len)) in plan.iter().enumerate() {
        *attempted = i + 1;
        if let Err(err) = e.map(ctx.driver, ctx.device, offset, len, spare, &access) {
            for &(_, offset, len) in plan[..i].iter().rev() {
                let _ = e.unmap(ctx.driver, ctx.device, offset, len, spare);
            }
            return Err(err);
        }
    }
    Ok(())
}

impl ShardState {
    /// PyTorch `try_allocate_expandable_block`: a free block of at least `req.rounded` bytes
    /// made by mapping pages in one of the stream's expandable segments of the request's pool
    /// (the first, by address, where free and unmapped blocks in a row are large enough), or in
    /// a new one; taken out of the pool for the caller to hand out.
    ///
    /// The pages are mapped with the handles the device's page pool holds first, then new
    /// ones: only those count towards the high-water mark and the memory fraction, which
    /// count physical memory. After a growth the pool keeps at most its bound
    /// ([`PagePool::trim`](crate::caching::expandable::PagePool::trim)).
    ///
    /// Errors: [`DriverError::OutOfMemory`] when the pool's budget refuses the pages (checked
    /// before a new range is reserved: nothing is made then, see `caching::budget`) or the device
    /// (or the memory fraction) has no room for them; any other failure of the virtual memory
    /// calls. The pages mapped for the request are unmapped again then, their handles back in the
    /// pool, and the pool released down to what it held before; the shard is as it was, but for a
    /// new range that could not be given back (it stays, empty, until the cache is released).
    ///
    /// A request of the ladder's larger pages that the device has no room for is grown again
    /// in smaller ones, down to 20 MiB, then in 2 MiB ones ([`ExpandablePolicy::pages_tried`]),
    /// each try leaving the shard as it found it; the error is the last one's.
    ///
    /// The page by rounding (gpupool's, not in PyTorch, which maps 20 MiB pages for every
    /// request of its large pool): with `small_pages_within`, a request of 20 MiB and more
    /// grows in 2 MiB pages first where that maps fewer bytes than its large pages (the
    /// rounding of a 21 MiB request to 40 MiB stays mapped and free, between live blocks, for
    /// as long as the block lives) and at most `small_pages_within` pages; where the large
    /// pages map no more (a request of whole large pages, or a large range's free tail that
    /// holds most of it), the large ones, a tenth of the driver calls. With
    /// `small_pages_saving`, the small pages only where the bytes they save are at least that
    /// share of what the shard's ranges of the pool map with them: a saving counts as much as
    /// it moves reserved over live, while each page costs the same driver calls whatever the
    /// pool holds. Measured on every trace in docs/fragmentation.md: BERT at random lengths
    /// 1.248 of live rather than 1.264 on the simulated device, no trace worse by more than
    /// 0.005 than with small pages wherever they map less, no page call added to a warm pass,
    /// and 12% fewer pages mapped in the cold passes (vit_train 1,595 rather than 2,431).
    ///
    /// While history is on, the pages mapped are recorded as `segment_map` events (those of a
    /// failed call that the driver would not unmap included), with the call's stack, which is
    /// left for the `alloc` event of the block handed out.
    pub fn grow_expandable(&mut self, ctx: &ShardCtx, rounded: usize, pool: PoolKind) -> Result<Growth, DriverError> {
        let policy = ctx.expandable.expect("only called with expandable segments on");
        let mut grown = Err(DriverError::OutOfMemory);
        let mut tried: Vec<usize> = policy.pages_tried(pool, rounded).collect();
        if tried.len() > 1 && tried.last() == Some(&policy.large_page) {
            let large = self.bytes_to_map(pool, tried[0], rounded);
            let small = self.bytes_to_map(pool, policy.large_page, rounded);
            if small < large
                && small / policy.large_page <= policy.small_pages_within
                && (policy.small_pages_saving == 0
                    || (large - small).saturating_mul(policy.small_pages_saving) >= self.pool_mapped(pool) + small)
            {
                tried.rotate_right(1);
            }
        }
        // The out-of-memory path tells the pool's budget's refusal from the device's by the
        // last charge (`budget::take_refusal`): the budget's only where it refused every page
        // size. A size the device had no room for, even if the budget refused the next, is the
        // device's refusal, whose release-and-retry releases every pool's cache; the budget's
        // path releases only the pool's own, and would fail a request within the budget.
        let mut budget_only = true;
        for page in tried {
            grown = self.grow_in_pages(ctx, rounded, pool, page);
            if !matches!(grown, Err(DriverError::OutOfMemory)) {
                break;
            }
            budget_only &= budget::refused();
        }
        if !budget_only {
            budget::take_refusal();
        }
        grown
    }

    /// [`ShardState::grow_expandable`] in ranges of `page`-byte pages.
    fn grow_in_pages(
        &mut self,
        ctx: &ShardCtx,
        rounded: usize,
        pool: PoolKind,
        page: usize,
    ) -> Result<Growth, DriverError> {
        let policy = ctx.expandable.expect("only called with expandable segments on");
        let c = if ctx.history.on() { ctx.history.capture(HistoryContext::State) } else { 0 };
        // The pool's budget counts every page mapped, held handles too (`caching::budget`).
        // It is charged before anything is made: a growth it refuses reserves no range, so
        // the shard's segments, reserved bytes and their peaks stay as they were. A new range
        // maps the request's pages from its start; in a range that holds the request, the
        // plan says how many.
        let (start, new_range) = match self.find_expandable(pool, rounded, page) {
            Some(id) => (id, None),
            None => {
                let budget = ctx.shard.budget.try_charge(round_up(rounded, page)).ok_or(DriverError::OutOfMemory)?;
                (self.reserve_range(ctx, policy, pool, rounded, page, c)?, Some(budget))
            }
        };
        let plan = self.plan_growth(start, rounded);
        let pages = plan.iter().map(|p| p.2).sum::<usize>() / page;
        let base = self.expandable_of(self.blocks[start].addr).0;
        let budget = match new_range {
            Some(budget) => {
                debug_assert_eq!(pages * page, round_up(rounded, page), "a new range maps the request's pages");
                budget
            }
            None => ctx.shard.budget.try_charge(pages * page).ok_or(DriverError::OutOfMemory)?,
        };
        // Held handles first: they are device memory counted already, so only the pages
        // still wanted count towards the high-water mark and the memory limit. Whatever
        // happens, unwinding included, those not mapped go back to the pool.
        let mut spare = scopeguard::guard(Vec::new(), |mut spare: Vec<PhysHandle>| ctx.pages.put(page, &mut spare));
        let held_before = ctx.pages.held();
        let mut taken = ctx.pages.take(page, pages, &mut spare);
        if let Some(past) = self.reclaim_before_growth(ctx, start, rounded, page, (pages - taken) * page) {
            return Ok(Growth::PastMark(past));
        }
        // What the rule unmapped waits in the pool.
        taken += ctx.pages.take(page, pages - taken, &mut spare);
        let Some(charge) = ctx.limit.try_charge((pages - taken) * page) else {
            drop(spare);
            self.free_range_if_empty(ctx, base);
            return Err(DriverError::OutOfMemory);
        };
        let mapped_before = self.segments[&base].exp.as_deref().expect("expandable").mapped;
        let mut attempted = 0;
        let result = {
            // The blocks follow the page table whatever happens, unwinding included; the
            // handles not mapped go back to the pool, and the memory limit keeps what the
            // device's physical bytes changed by.
            let mut g = scopeguard::guard(
                (&mut *self, &mut attempted, &mut *spare, charge, budget),
                |(st, attempted, spare, charge, budget)| {
                    let grown = st.adopt(base, plan[..*attempted].iter().map(|p| p.0), mapped_before);
                    budget.settle(grown);
                    let back = spare.len();
                    ctx.pages.put(page, spare);
                    charge.settle(grown + (back as isize - taken as isize) * page as isize);
                    if ctx.history.on() {
                        for &(_, offset, len) in &plan[..*attempted] {
                            st.record_pages(ctx, base, offset, len, true, c);
                        }
                    }
                },
            );
            let (st, attempted, spare, _, _) = &mut *g;
            let e = st.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
            map_plan(ctx, e, &plan, attempted, spare)
        };
        if ctx.segments.on() {
            for &(_, offset, len) in &plan[..attempted] {
                self.observe_mapped(ctx, base, offset, len);
            }
        }
        if let Err(e) = result {
            // A failed growth leaves the pool no fuller than it found it: the handles it
            // created go back to the driver (a device out of memory needs them; a refusal
            // leaves them held, for the next release).
            // Its own page size first: the other sizes' held handles are the next try's room.
            let _ = ctx.pages.release(ctx.driver, ctx.device, ctx.limit, held_before, Some(page));
            self.free_range_if_empty(ctx, base);
            return Err(e);
        }
        ctx.pages.trim(ctx.driver, ctx.device, ctx.limit);
        // The free block at `start`'s address now holds at least `rounded` bytes: blocks merge
        // into their lower neighbour, and `start` had no free block before it.
        let b = &self.blocks[start];
        debug_assert!(b.state == BlockState::Free && b.size >= rounded);
        let (size, addr) = (b.size, b.addr);
        self.pool(pool).remove(size, addr, start);
        self.pending_ctx = c;
        Ok(Growth::Block(start))
    }

    /// The pages to map for a request of `rounded` bytes from `start`, the first block of a run
    /// of free and unmapped blocks that holds it (found, or a new range's), as (block, offset
    /// in its range, bytes): free and unmapped blocks from the start on, until `rounded` bytes
    /// are reached (PyTorch maps the same, block by block).
    fn plan_growth(&self, start: BlockId, rounded: usize) -> Vec<MapStep> {
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
        plan
    }

    /// Bytes mapped in the shard's expandable segments of `pool`, every page size.
    fn pool_mapped(&self, pool: PoolKind) -> usize {
        self.expandables
            .iter()
            .map(|b| &self.segments[b])
            .filter(|s| self.blocks[s.head].pool == pool)
            .map(|s| s.exp.as_deref().map_or(0, |e| e.mapped))
            .sum()
    }

    /// Bytes a growth for `rounded` bytes of `pool` in `page`-byte pages maps: in the run
    /// [`ShardState::find_expandable`] finds, the plan's pages; in a new range, the request
    /// rounded up to whole pages.
    fn bytes_to_map(&self, pool: PoolKind, page: usize, rounded: usize) -> usize {
        match self.find_expandable(pool, rounded, page) {
            Some(start) => self.plan_growth(start, rounded).iter().map(|p| p.2).sum(),
            None => round_up(rounded, page),
        }
    }

    /// PyTorch `find_expandable_block`: the first unmapped block of the pool (by address), in a
    /// range of `page`-byte pages, that, with the free block before it if any and the free and
    /// unmapped blocks after it, holds `size` bytes. Returns the first block of that run.
    fn find_expandable(&self, pool: PoolKind, size: usize, page: usize) -> Option<BlockId> {
        let usable =
            |id: BlockId| id != NIL && matches!(self.blocks[id].state, BlockState::Free | BlockState::Unmapped);
        for &(_, u) in &self.unmapped[pool as usize] {
            if self.expandable_of(self.blocks[u].addr).1.page != page {
                continue;
            }
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

    /// A new expandable segment of `pool` for a request of `size` bytes, in `page`-byte pages
    /// (one of [`ExpandablePolicy::pages_tried`]), wholly unmapped: its one block is returned.
    fn reserve_range(
        &mut self,
        ctx: &ShardCtx,
        policy: &ExpandablePolicy,
        pool: PoolKind,
        size: usize,
        page: usize,
        c: u32,
    ) -> Result<BlockId, DriverError> {
        let largest = self
            .expandables
            .iter()
            .filter(|b| {
                let s = &self.segments[b];
                self.blocks[s.head].pool == pool && s.exp.as_deref().is_some_and(|e| e.page == page)
            })
            .map(|b| self.segments[b].size)
            .max()
            .unwrap_or(0);
        let va = policy.range_size_in(pool, size, largest, page).ok_or(DriverError::OutOfMemory)?;
        let exp = Expandable::reserve(ctx.driver, ctx.device, va, page)?;
        let base = exp.base;
        let id = self.blocks.insert(Block::new(base, va, BlockState::Unmapped, pool, true));
        self.segments.insert(base, SegmentInfo { head: id, size: va, exp: Some(Box::new(exp)), ctx: c, graph: false });
        self.expandables.push(base);
        self.unmapped_set(pool).insert((base, id));
        ctx.index.insert(SegmentEntry { base, size: va, device: ctx.device, owner: ctx.shard.clone() });
        self.counters.increase(Metric::Segment, pool, 1);
        Ok(id)
    }
}
