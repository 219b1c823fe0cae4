//! The counting cells behind PyTorch's statistics: each shard counts its own blocks here under
//! its lock; the device's totals (`cell_layout::Totals`) add them up, and [`collect`] turns those
//! into the [`DeviceStats`] that `stats/` reports.
//!
//! A statistic with a `StatArray` in PyTorch has three cells (all pools, small pool, large
//! pool); [`cell`] (in `cell_layout`, re-exported here) is the one place that says where each lives.
//!
//! `pending_sums.rs`: the hit path's ten cells counted lazily as three pending sums per pool.

pub(crate) use super::cell_layout::{CELLS, Metric, OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS, StatType, cell};

mod pending_sums;

use std::sync::atomic::{AtomicI64, Ordering};

use super::cell_layout::Totals;
use crate::caching::rules::PoolKind;
use crate::stats::{DeviceStats, Stat, StatArray};

/// One shard's share of a statistic, the part the hot path writes. `headroom`, `low` and
/// `keep` are its credit towards the device peak (see [`super::peaks`]).
/// Its current value is `allocated - freed` ([`Cell::current`]): one field fewer to write per
/// change on the hit path.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cell {
    pub allocated: i64,
    pub freed: i64,
    pub headroom: i64,
    /// The lowest `headroom` since the last settle, where that went below zero: where this
    /// shard's value peaked within the calls not yet settled. While the headroom has not gone
    /// below zero, some value of at least zero (the hit path does not follow it then: see
    /// `ShardCounters::went_short`).
    pub low: i64,
    /// The most credit this shard has had to borrow at once since it last had to: the credit
    /// it keeps when it gives surplus back to the device's spare credit (which it does once it
    /// holds `SURPLUS_FACTOR` times this). A settle resets it to zero for a shard that was
    /// quiet since the settle before.
    pub keep: i64,
}

impl Cell {
    /// The shard's current value: what it counted up less what it counted down.
    #[inline(always)]
    pub fn current(&self) -> i64 {
        self.allocated - self.freed
    }
}

/// A cell as a settle last saw it: what the device's totals hold of the shard (`allocated +
/// freed` unchanged at the next visit means the shard was quiet in between). Apart from
/// [`Cell`], so that the hot path's cells stay few cache lines.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Seen {
    pub current: i64,
    pub allocated: i64,
    pub freed: i64,
    pub headroom: i64,
}

/// A shard gives credit back to the device's spare credit only once it holds this many times
/// what it keeps, so that a stream whose blocks vary in size does not trade credit through the
/// shared atomics at every call, and gives it back before other streams run short for lack of
/// it. On the H100 machine's host (16 cores, `thread_scaling` on the simulated device, 16
/// threads on one device, three runs each, 2026-11-27): at 8, 40-41 M ops/s and 148-172 settles
/// per million calls; at 4, 72-77 and 2.7-2.8 (with the borrow's share of the spare credit,
/// [`crate::caching::accounting::peaks::borrow`], 76-85 and 6-9); at 2, 47-51 and 1.4-1.9, the give-backs'
/// shared atomics now the cost.
const SURPLUS_FACTOR: i64 = 4;

/// Every cell's bit of `ShardCounters::credit_cells`.
const ALL_CELLS: u32 = (1 << CELLS) - 1;

/// The statistics of one shard. Not synchronised: the shard's lock guards it.
#[derive(Debug)]
pub(crate) struct ShardCounters {
    /// Read and changed through [`ShardCounters::cell`], [`ShardCounters::cells_and_seen`] and
    /// the counting methods, which add the hit path's pending sums first (see `pending_sums`).
    cells: [Cell; CELLS],
    lazy: pending_sums::Lazy,
    /// One bit per cell (bit `i`: cell `i`) that may hold credit or debt: a cell whose bit is
    /// clear has `headroom == 0` and `low >= 0`, so that a give-back or a borrow
    /// ([`ShardCounters::cells_with_credit`]) visits only the cells a stream moved, not all
    /// [`CELLS`]. Set by every change of a cell's headroom (conservatively: all of them for a
    /// caller of [`ShardCounters::cells_and_seen`], a settle's, or of the tests' `cells_mut`),
    /// cleared by the end of a call on a stream that is not hot (`peaks::return_all`) for each
    /// cell it leaves at zero. At 1,000 streams in rotation, where each malloc gives its
    /// stream's credit back, a borrow and a give-back over all 29 cells cost 470 instructions
    /// a pair (callgrind, `examples/stream_rotation.rs`).
    credit_cells: u32,
    pub seen: [Seen; CELLS],
    /// Some cell went past its headroom: the device peak must be settled before the call
    /// that did it returns.
    pub needs_settle: bool,
    /// Some cell holds [`SURPLUS_FACTOR`] times more credit than it keeps: give what it does
    /// not keep back.
    pub has_surplus: bool,
    /// Segments (and growths of expandable segments) this shard had from the driver, and
    /// those it gave back: its share of PyTorch's `num_device_alloc` and `num_device_free`.
    /// Kept here, beside the `segment` cells, and summed into the device's totals by the same
    /// visits (`peaks::absorb`), so that a snapshot counts a segment in all three or in none.
    /// (As device-wide atomics, a snapshot could count the segment of a stream it did not
    /// visit in these and not in `segment`: 2% of reads while streams came and went.)
    pub device_allocs: i64,
    pub device_frees: i64,
    /// `device_allocs` and `device_frees` as the device's totals last took them.
    pub seen_device: (i64, i64),
}

impl Default for ShardCounters {
    fn default() -> Self {
        ShardCounters {
            cells: [Cell::default(); CELLS],
            lazy: pending_sums::Lazy::default(),
            credit_cells: 0,
            seen: [Seen::default(); CELLS],
            needs_settle: false,
            has_surplus: false,
            device_allocs: 0,
            device_frees: 0,
            seen_device: (0, 0),
        }
    }
}

impl ShardCounters {
    /// `needs_settle || has_surplus`, as one test of both bytes (LLVM loads them as one 16-bit
    /// word when they lie side by side, as they do: 4 instructions fewer a pair on the hit
    /// path's call ends, callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    pub fn settle_or_surplus(&self) -> bool {
        (u16::from(self.needs_settle) | (u16::from(self.has_surplus) << 8)) != 0
    }

    /// The cells, the hit path's pending sums added first, for a caller that may change them
    /// (the hit path then takes its minimums of headroom again: see `pending_sums`).
    #[cfg(test)]
    pub fn cells_mut(&mut self) -> &mut [Cell; CELLS] {
        self.touch();
        self.credit_cells = ALL_CELLS;
        &mut self.cells
    }

    /// [`ShardCounters::cells_mut`] with the cells as a settle last saw them.
    pub fn cells_and_seen(&mut self) -> (&mut [Cell; CELLS], &mut [Seen; CELLS]) {
        self.touch();
        self.credit_cells = ALL_CELLS;
        (&mut self.cells, &mut self.seen)
    }

    /// The cells, the hit path's pending sums added first, and the mask of those that may
    /// hold credit or debt (`credit_cells`), for a give-back or a borrow, which change only
    /// the headroom of cells in the mask and clear the bit of a cell they leave at zero
    /// (headroom 0, `low >= 0`).
    #[inline]
    pub fn cells_with_credit(&mut self) -> (&mut [Cell; CELLS], &mut u32) {
        self.touch();
        (&mut self.cells, &mut self.credit_cells)
    }

    /// [`ShardCounters::cells_with_credit`] with the hit path's minimums left as they are, for
    /// a caller that ends by taking them again or marking them stale
    /// ([`ShardCounters::minimums_at_zero`], [`ShardCounters::minimums_stale`]), and reads
    /// none of them meanwhile: the end of a call on a stream that is not hot
    /// (`peaks::return_all`), which marked them stale only to set them again (6 instructions,
    /// callgrind, `examples/stream_rotation.rs`).
    #[inline]
    pub(in crate::caching::accounting) fn cells_with_credit_flushed(&mut self) -> (&mut [Cell; CELLS], &mut u32) {
        self.flush();
        (&mut self.cells, &mut self.credit_cells)
    }

    /// Marks the hit path's minimums stale: they are taken again at its next call (see
    /// [`ShardCounters::cells_with_credit_flushed`]).
    #[inline]
    pub(in crate::caching::accounting) fn minimums_stale(&mut self) {
        self.lazy_stale();
    }

    /// The invariant checker's rule: a cell outside `credit_cells` holds no credit or debt.
    pub fn check_credit_cells(&self) -> Result<(), String> {
        for (i, c) in self.cells.iter().enumerate() {
            if self.credit_cells & (1 << i) == 0 && (c.headroom != 0 || c.low < 0) {
                return Err(format!(
                    "cell {i} holds credit {} (low {}) and is not in the shard's mask of cells with credit",
                    c.headroom, c.low
                ));
            }
        }
        Ok(())
    }

    /// Before any change to the cells other than the hit path's.
    #[inline(always)]
    fn touch(&mut self) {
        self.flush();
        self.lazy_stale();
    }

    /// Before an eager change to `cell`: [`ShardCounters::touch`] where the hit path counts
    /// the cell lazily. Another cell's change leaves the pending sums and the minimums as they
    /// are (`pending_sums::LAZY_CELLS`): at 1,000 streams in rotation, a free that changed
    /// `inactive_split` flushed the pending sums, and the malloc after it took the minimums
    /// again (callgrind, `examples/stream_rotation.rs`).
    #[inline(always)]
    fn touch_cell(&mut self, cell: usize) {
        if pending_sums::LAZY_CELLS & (1 << cell) != 0 {
            self.touch();
        }
    }

    #[inline(always)]
    fn up(&mut self, cell: usize, n: i64) {
        self.touch_cell(cell);
        self.credit_cells |= 1 << cell;
        let c = &mut self.cells[cell];
        c.allocated += n;
        c.headroom -= n;
        if c.headroom < 0 {
            self.went_short(cell);
        }
    }

    /// A cell's headroom went below zero: its `low` follows, and the call must borrow or
    /// settle. Only then: `peaks` reads `low` for its value only when it is below zero, and
    /// for its sign otherwise, which a headroom that never went below zero keeps.
    #[cold]
    #[inline(never)]
    fn went_short(&mut self, cell: usize) {
        let c = &mut self.cells[cell];
        c.low = c.low.min(c.headroom);
        self.needs_settle = true;
    }

    #[inline(always)]
    fn down(&mut self, cell: usize, n: i64) {
        self.touch_cell(cell);
        self.credit_cells |= 1 << cell;
        let c = &mut self.cells[cell];
        c.freed += n;
        c.headroom += n;
        if c.headroom > SURPLUS_FACTOR * c.keep {
            self.has_surplus = true;
        }
    }

    /// PyTorch `stats.<metric>[all and pool].increase(n)`.
    #[inline(always)]
    pub fn increase(&mut self, metric: Metric, pool: PoolKind, n: i64) {
        self.up(cell(metric, StatType::All), n);
        self.up(cell(metric, StatType::Pool(pool)), n);
    }

    /// PyTorch `stats.<metric>[all and pool].decrease(n)`.
    ///
    /// Only the aggregate cell is looked at for surplus credit: the pool's cell moves with it,
    /// and a surplus it holds alone goes back at the next look or settle (giving surplus back
    /// is a saving of shared traffic, not a rule of the peaks). Looking at both cost 25
    /// instructions a free (callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    pub fn decrease(&mut self, metric: Metric, pool: PoolKind, n: i64) {
        self.down(cell(metric, StatType::All), n);
        self.credit_cells |= 1 << cell(metric, StatType::Pool(pool));
        let c = &mut self.cells[cell(metric, StatType::Pool(pool))];
        c.freed += n;
        c.headroom += n;
    }

    /// Increase (`n > 0`) or decrease (`n < 0`) by a signed amount.
    #[inline(always)]
    pub fn change(&mut self, metric: Metric, pool: PoolKind, n: i64) {
        if n > 0 {
            self.increase(metric, pool, n)
        } else if n < 0 {
            self.decrease(metric, pool, -n)
        }
    }

    /// Counts one more in a statistic without pools (`oversize_*`).
    #[inline(always)]
    pub fn increase_single(&mut self, cell: usize) {
        self.up(cell, 1);
    }

    /// Counts one less in a statistic without pools (`oversize_*`).
    #[inline]
    pub fn decrease_single(&mut self, cell: usize) {
        self.down(cell, 1);
    }
}

/// Device-wide event counts of PyTorch's `DeviceStats` that change only on slow paths (out of
/// memory, `empty_cache`), and gpupool's settle count. (`num_device_alloc` and
/// `num_device_free` are counted per shard: [`ShardCounters::device_allocs`].)
#[derive(Debug, Default)]
pub(crate) struct DeviceCounters {
    pub num_alloc_retries: AtomicI64,
    pub num_ooms: AtomicI64,
    pub num_sync_all_streams: AtomicI64,
    /// Peak settles that locked the device's shards (a diagnostic; see [`super::peaks`]).
    pub num_peak_settles: AtomicI64,
}

/// Adds one to a slow-path counter.
pub(crate) fn bump(counter: &AtomicI64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Builds PyTorch's `DeviceStats` from the device's totals, just settled.
pub(crate) fn collect(t: &Totals, counters: &DeviceCounters, max_split_size: usize) -> DeviceStats {
    let stat = |cell: usize| Stat {
        current: t.current[cell],
        peak: t.peak[cell],
        allocated: t.allocated[cell],
        freed: t.freed[cell],
    };
    let array = |m: Metric| StatArray {
        all: stat(cell(m, StatType::All)),
        small_pool: stat(cell(m, StatType::Pool(PoolKind::Small))),
        large_pool: stat(cell(m, StatType::Pool(PoolKind::Large))),
    };
    let load = |a: &AtomicI64| a.load(Ordering::Relaxed);
    DeviceStats {
        allocation: array(Metric::Allocation),
        segment: array(Metric::Segment),
        active: array(Metric::Active),
        inactive_split: array(Metric::InactiveSplit),
        allocated_bytes: array(Metric::AllocatedBytes),
        reserved_bytes: array(Metric::ReservedBytes),
        active_bytes: array(Metric::ActiveBytes),
        inactive_split_bytes: array(Metric::InactiveSplitBytes),
        requested_bytes: array(Metric::RequestedBytes),
        oversize_allocations: stat(OVERSIZE_ALLOCATIONS),
        oversize_segments: stat(OVERSIZE_SEGMENTS),
        num_alloc_retries: load(&counters.num_alloc_retries),
        num_ooms: load(&counters.num_ooms),
        num_sync_all_streams: load(&counters.num_sync_all_streams),
        num_device_alloc: t.device_allocs,
        num_device_free: t.device_frees,
        max_split_size: i64::try_from(max_split_size).unwrap_or(i64::MAX),
        // The device's page pool's, not the shards': the caller fills it in.
        unmapped_held_bytes: Stat::default(),
        sleeping_bytes: Stat::default(),
        pool_limit: None,
    }
}
