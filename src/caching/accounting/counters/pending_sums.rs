//! The hit path's statistics, counted lazily: a malloc or free changes ten cells (allocation,
//! active, allocated_bytes, active_bytes and requested_bytes, each for all pools and for its
//! pool), by three amounts only: one block, the bytes kept, the bytes requested. So it adds
//! those three amounts to its pool's pending sums, and keeps three exact minimums of the ten
//! cells' peak credit (`headroom`) per pool and for all pools; the cells take the sums when
//! anything else looks at or changes them ([`ShardCounters::cells_mut`] and the rest flush
//! first). Ten cells written per call became twelve words in one place: about 40 instructions
//! a malloc and free pair (callgrind, `tests/c/hit_loop.c`).
//!
//! Nothing observable changes: a cell read is the cell with its pending sums added, and the
//! peak rules see each cell exactly when its headroom goes below zero, because a minimum going
//! below zero sends the call to [`ShardCounters::lazy_short`], which flushes and follows each
//! cell's `low` as the eager count does.

use super::{Cell, SURPLUS_FACTOR, ShardCounters};
use crate::caching::accounting::cell_layout::{Metric, StatType, cell};
use crate::caching::rules::PoolKind;

/// Amounts a hit changes: blocks, bytes kept, bytes requested.
const GROUPS: usize = 3;
/// The group of bytes kept, whose aggregate headroom stands for the call's surplus credit.
const KEPT: usize = 1;

/// The statistics of each group: each changes by the group's amount.
const MEMBERS: [&[Metric]; GROUPS] =
    [&[Metric::Allocation, Metric::Active], &[Metric::AllocatedBytes, Metric::ActiveBytes], &[Metric::RequestedBytes]];

/// The bits of the cells of [`MEMBERS`]' statistics, all three of each: the only cells that
/// pending sums and minimums are of.
pub(super) const LAZY_CELLS: u32 = {
    let mut bits = 0;
    let mut g = 0;
    while g < GROUPS {
        let mut i = 0;
        while i < MEMBERS[g].len() {
            let m = MEMBERS[g][i];
            bits |= 1 << cell(m, StatType::All);
            bits |= 1 << cell(m, StatType::Pool(PoolKind::Small));
            bits |= 1 << cell(m, StatType::Pool(PoolKind::Large));
            i += 1;
        }
        g += 1;
    }
    bits
};

const POOLS: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

#[inline(always)]
fn pool_index(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

/// The pending sums and the minimums of headroom (see the module's doc).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lazy {
    up: [[i64; GROUPS]; 2],
    down: [[i64; GROUPS]; 2],
    /// Per group, the least headroom of its aggregate cells, pending sums included.
    head_all: [i64; GROUPS],
    /// Per pool and group, the least headroom of the group's cells of the pool.
    head_pool: [[i64; GROUPS]; 2],
    /// `head_all[KEPT]` above this: surplus credit to give back (`SURPLUS_FACTOR` times what
    /// the aggregate `allocated_bytes` cell keeps).
    surplus_at: i64,
}

/// The minimums of a [`Lazy`] whose cells changed since they were taken (stale): far below
/// zero, so that the next malloc goes short ([`ShardCounters::lazy_short`]) and takes them
/// again, with no flag of its own for the hit path to test (4 instructions a pair, callgrind,
/// `tests/c/hit_loop.c`). Frees until then add at most the bytes allocated (under 2^62):
/// still below [`STALE_BELOW`].
const STALE: i64 = i64::MIN / 2;
/// Minimums below this are stale.
const STALE_BELOW: i64 = i64::MIN / 4;

impl Lazy {
    /// `up` or `down` holds what the cells do not have yet. Each hit adds one block to its
    /// group 0, so the block counts say it without a flag of its own, which the hit path would
    /// set (2 instructions a pair, callgrind).
    #[inline(always)]
    fn pending(&self) -> bool {
        (self.up[0][0] | self.up[1][0] | self.down[0][0] | self.down[1][0]) != 0
    }

    /// Whether the minimums were marked stale and not taken again since.
    fn stale(&self) -> bool {
        self.head_all[0] < STALE_BELOW
    }
}

impl Default for Lazy {
    fn default() -> Self {
        Lazy {
            up: [[0; GROUPS]; 2],
            down: [[0; GROUPS]; 2],
            head_all: [STALE; GROUPS],
            head_pool: [[STALE; GROUPS]; 2],
            surplus_at: 0,
        }
    }
}

impl ShardCounters {
    /// A malloc's statistics (PyTorch `alloc_found_block`'s increases of allocation, active,
    /// allocated_bytes, active_bytes and requested_bytes): `kept` and `requested` bytes.
    #[inline(always)]
    pub fn hit_increase(&mut self, pool: PoolKind, kept: i64, requested: i64) {
        let p = pool_index(pool);
        let l = &mut self.lazy;
        let d = [1, kept, requested];
        let mut short = 0;
        for (g, n) in d.into_iter().enumerate() {
            l.up[p][g] += n;
            l.head_all[g] -= n;
            l.head_pool[p][g] -= n;
            short |= l.head_all[g] | l.head_pool[p][g];
        }
        if short < 0 {
            self.lazy_short();
        }
    }

    /// A free's statistics, the decreases of [`ShardCounters::hit_increase`]. While the
    /// minimums are stale they stay far below zero, so no surplus is seen until the next
    /// malloc takes them again.
    #[inline(always)]
    pub fn hit_decrease(&mut self, pool: PoolKind, kept: i64, requested: i64) {
        let p = pool_index(pool);
        let l = &mut self.lazy;
        let d = [1, kept, requested];
        for (g, n) in d.into_iter().enumerate() {
            l.down[p][g] += n;
            l.head_all[g] += n;
            l.head_pool[p][g] += n;
        }
        if l.head_all[KEPT] > l.surplus_at {
            self.has_surplus = true;
        }
    }

    /// Some cell's headroom went below zero, or the minimums were stale: the cells take the
    /// pending sums, each cell below zero is followed as the eager count follows it, and stale
    /// minimums are taken again.
    #[cold]
    #[inline(never)]
    fn lazy_short(&mut self) {
        // Minimums that are not stale are exact (each hit moves them by its amount), and the
        // flush and `went_short` leave every headroom as it is: they are taken again only when
        // stale. A cold malloc that went past the 0 its stream's minimums were left at
        // (`minimums_at_zero`) took them at every other pair at 1,000 streams in rotation,
        // for the end of its call to replace them (callgrind, `examples/stream_rotation.rs`).
        let stale = self.lazy.stale();
        self.flush();
        // Only a cell in the mask of cells with credit can be below zero (`credit_cells`): a
        // stream's calls move one pool's cells, 6 to 10 of the 15 (a pass over all 15 cost a
        // cold malloc about 15 instructions more, callgrind, `examples/stream_rotation.rs`).
        // `went_short` in line, but for the last cell, whose call sets `needs_settle`: called
        // for each, it cost a cold malloc about 5 instructions a cell (callgrind,
        // `examples/stream_rotation.rs`). (In line for every cell, with the flag set here, the
        // hit pair cost 4 instructions more, `tests/c/hit_budget.sh`: the hit path's code
        // changed around its call of this function, which could then no longer unwind.)
        let mut cells = self.credit_cells & LAZY_CELLS;
        let mut last = None;
        while cells != 0 {
            let i = cells.trailing_zeros() as usize;
            cells &= cells - 1;
            let c = &mut self.cells[i];
            if c.headroom < 0 {
                c.low = c.low.min(c.headroom);
                last = Some(i);
            }
        }
        if let Some(i) = last {
            self.went_short(i);
        }
        if stale {
            self.take_minimums();
        }
    }

    /// The cells are about to change other than by the hit path: its minimums are taken again
    /// at its next call.
    #[inline(always)]
    pub(super) fn lazy_stale(&mut self) {
        self.lazy.head_all = [STALE; GROUPS];
        self.lazy.head_pool = [[STALE; GROUPS]; 2];
    }

    /// Adds the pending sums to the cells.
    #[inline]
    pub(super) fn flush(&mut self) {
        if self.lazy.pending() {
            self.flush_pending();
        }
    }

    /// The work of [`ShardCounters::flush`].
    ///
    /// A pool with nothing pending (its block counts zero: see [`Lazy::pending`]) is passed
    /// over, its cells left out of the mask of cells with credit (`credit_cells`): a stream
    /// serves one pool's blocks at a time, and flushing both cost 95 instructions a call
    /// (callgrind, `examples/stream_rotation.rs`). So are the cells of a group whose sums
    /// cancel: at 1,000 streams in rotation, the block counts' four cells cost the end of each
    /// cold malloc (`peaks::return_all`) about 80 instructions.
    #[cold]
    #[inline(never)]
    fn flush_pending(&mut self) {
        for (p, pool) in POOLS.into_iter().enumerate() {
            if (self.lazy.up[p][0] | self.lazy.down[p][0]) == 0 {
                continue;
            }
            for (g, group) in MEMBERS.into_iter().enumerate() {
                let (up, down) = (self.lazy.up[p][g], self.lazy.down[p][g]);
                let mut bits = 0;
                for &m in group {
                    for c in [cell(m, StatType::All), cell(m, StatType::Pool(pool))] {
                        bits |= 1 << c;
                        let c = &mut self.cells[c];
                        c.allocated += up;
                        c.freed += down;
                        c.headroom -= up - down;
                    }
                }
                // Sums that cancel (a free and a malloc of one block each: the block counts)
                // leave the headroom, and so the cells' bits, as they were.
                if up != down {
                    self.credit_cells |= bits;
                }
            }
        }
        self.lazy.up = [[0; GROUPS]; 2];
        self.lazy.down = [[0; GROUPS]; 2];
    }

    /// Takes the minimums of headroom from the cells (the pending sums flushed first).
    #[cold]
    #[inline(never)]
    pub(super) fn take_minimums(&mut self) {
        self.flush();
        let least = |cells: &[Cell], g: usize, t: StatType| {
            MEMBERS[g].iter().map(|&m| cells[cell(m, t)].headroom).min().unwrap_or(0)
        };
        for g in 0..GROUPS {
            self.lazy.head_all[g] = least(&self.cells, g, StatType::All);
            for (p, pool) in POOLS.into_iter().enumerate() {
                self.lazy.head_pool[p][g] = least(&self.cells, g, StatType::Pool(pool));
            }
        }
        self.lazy.surplus_at = SURPLUS_FACTOR * self.cells[cell(Metric::AllocatedBytes, StatType::All)].keep;
    }

    /// The minimums when no cell holds credit or debt (`credit_cells` empty, nothing
    /// pending), as the end of a call on a stream that is not hot leaves it
    /// (`peaks::return_all`): all 0, taken without reading the cells. The stream's next malloc
    /// within what its free between gave back then goes on without flushing and taking them
    /// again (`lazy_short`), which it did at each cold malloc at 1,000 streams in rotation
    /// (callgrind, `examples/stream_rotation.rs`); a free between that frees more than the
    /// surplus factor allows gives it back at once, as on a hot stream.
    pub(in crate::caching::accounting) fn minimums_at_zero(&mut self) {
        debug_assert!(self.credit_cells == 0 && !self.lazy.pending());
        self.lazy.head_all = [0; GROUPS];
        self.lazy.head_pool = [[0; GROUPS]; 2];
        self.lazy.surplus_at = SURPLUS_FACTOR * self.cells[cell(Metric::AllocatedBytes, StatType::All)].keep;
    }

    /// The invariant checker's rule: each group's pending block count is zero only with its
    /// byte sums zero (the pending test reads the counts), and unless marked stale (every
    /// minimum so), each minimum is the least headroom of its group's cells as they stand
    /// (pending sums included).
    pub fn check_lazy(&self) -> Result<(), String> {
        let l = &self.lazy;
        for sums in l.up.iter().chain(&l.down) {
            if sums[0] == 0 && sums.iter().any(|&n| n != 0) {
                return Err("hit-path byte sums pending without their block count".into());
            }
        }
        let all = l.head_all.iter().chain(l.head_pool.iter().flatten());
        if l.stale() {
            if all.clone().any(|&h| h >= STALE_BELOW) {
                return Err("some of the hit path's minimums are stale and some not".into());
            }
            return Ok(());
        }
        let least = |g: usize, t: StatType| MEMBERS[g].iter().map(|&m| self.cell(cell(m, t)).headroom).min();
        for g in 0..GROUPS {
            if least(g, StatType::All) != Some(l.head_all[g]) {
                return Err(format!("the hit path's least headroom of group {g} (all pools) is not its cells'"));
            }
            for (p, pool) in POOLS.into_iter().enumerate() {
                if least(g, StatType::Pool(pool)) != Some(l.head_pool[p][g]) {
                    return Err(format!(
                        "the hit path's least headroom of group {g} ({pool:?} pool) is not its cells'"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Cell `c` as it stands, the pending sums included.
    pub fn cell(&self, c: usize) -> Cell {
        let mut v = self.cells[c];
        if !self.lazy.pending() {
            return v;
        }
        for (p, pool) in POOLS.into_iter().enumerate() {
            for (g, group) in MEMBERS.into_iter().enumerate() {
                let touches = group.iter().any(|&m| c == cell(m, StatType::All) || c == cell(m, StatType::Pool(pool)));
                if touches {
                    let (up, down) = (self.lazy.up[p][g], self.lazy.down[p][g]);
                    v.allocated += up;
                    v.freed += down;
                    v.headroom -= up - down;
                }
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::accounting::cell_layout::CELLS;

    /// The eager count of the same calls, for comparison.
    fn eager(c: &mut ShardCounters, pool: PoolKind, kept: i64, requested: i64, sign: i64) {
        for (m, n) in [
            (Metric::Allocation, 1),
            (Metric::Active, 1),
            (Metric::AllocatedBytes, kept),
            (Metric::ActiveBytes, kept),
            (Metric::RequestedBytes, requested),
        ] {
            c.change(m, pool, sign * n);
        }
    }

    fn view(c: &ShardCounters) -> Vec<(i64, i64, i64, i64)> {
        (0..CELLS).map(|i| c.cell(i)).map(|v| (v.allocated, v.freed, v.headroom, v.low)).collect()
    }

    #[test]
    fn lazy_and_eager_counts_agree_at_every_step() {
        let (mut lazy, mut eager_c) = (ShardCounters::default(), ShardCounters::default());
        // Credit in some cells, so that headroom runs out at different steps.
        for (i, h) in
            [(cell(Metric::AllocatedBytes, StatType::All), 5000), (cell(Metric::Allocation, StatType::All), 3)]
        {
            lazy.cells_mut()[i].headroom = h;
            eager_c.cells_mut()[i].headroom = h;
        }
        let steps = [
            (PoolKind::Small, 512, 500, 1),
            (PoolKind::Small, 1024, 1000, 1),
            (PoolKind::Large, 4096, 4000, 1),
            (PoolKind::Small, 512, 500, -1),
            (PoolKind::Large, 4096, 4000, -1),
            (PoolKind::Large, 2 << 20, 2 << 20, 1),
        ];
        for (pool, kept, requested, sign) in steps {
            if sign > 0 {
                lazy.hit_increase(pool, kept, requested);
            } else {
                lazy.hit_decrease(pool, kept, requested);
            }
            eager(&mut eager_c, pool, kept, requested, sign);
            assert_eq!(view(&lazy), view(&eager_c), "after {pool:?} {kept} {sign}");
            assert_eq!(lazy.needs_settle, eager_c.needs_settle);
            assert_eq!(lazy.check_lazy(), Ok(()));
        }
        lazy.flush();
        assert!(!lazy.lazy.pending());
        assert_eq!(view(&lazy), view(&eager_c), "flushed");
    }

    #[test]
    fn a_change_to_the_cells_is_seen_by_the_next_hit() {
        let mut c = ShardCounters::default();
        let bytes = cell(Metric::AllocatedBytes, StatType::Pool(PoolKind::Small));
        c.cells_mut()[bytes].headroom = 1000;
        c.cells_mut()[cell(Metric::AllocatedBytes, StatType::All)].headroom = 1000;
        c.hit_increase(PoolKind::Small, 512, 512);
        // Every other cell of the groups has no credit: short at once.
        assert!(c.needs_settle);
        c.needs_settle = false;
        for i in 0..CELLS {
            c.cells_mut()[i].headroom = 10_000;
        }
        c.hit_increase(PoolKind::Small, 512, 512);
        assert!(!c.needs_settle, "the new credit was taken");
        assert_eq!(c.cell(bytes).current(), 1024);
        c.cells_mut()[bytes].headroom = 0;
        c.hit_increase(PoolKind::Small, 512, 512);
        assert!(c.needs_settle, "and its withdrawal too");
        assert_eq!(c.cell(bytes).low, -512);
    }

    #[test]
    fn the_checker_sees_a_wrong_minimum_or_a_lost_sum() {
        let mut c = ShardCounters::default();
        c.hit_increase(PoolKind::Large, 4096, 4000);
        c.hit_decrease(PoolKind::Large, 4096, 4000);
        assert_eq!(c.check_lazy(), Ok(()));
        c.lazy.head_pool[1][KEPT] += 1;
        assert!(c.check_lazy().is_err(), "a minimum above its cells'");
        for i in 0..CELLS {
            c.cells_mut()[i].headroom = 1 << 20;
        }
        // The first hit after the cells changed takes the minimums again (its sums flushed);
        // the second, within credit, stays pending.
        c.hit_increase(PoolKind::Small, 512, 512);
        assert!(!c.lazy.pending() && !c.lazy.stale(), "the minimums taken again");
        c.hit_increase(PoolKind::Small, 512, 512);
        assert!(c.lazy.pending());
        assert_eq!(c.check_lazy(), Ok(()), "within credit: pending, not flushed");
        c.lazy.up[0][0] = 0;
        assert!(c.check_lazy().is_err(), "bytes pending without their block");
        c.lazy.up[0][0] = 1;
        c.lazy.head_pool[0][2] = STALE;
        assert!(c.check_lazy().is_err(), "one minimum stale, the rest not");
    }
}
