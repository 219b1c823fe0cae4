//! The statistics with a peak, laid out as cells: which statistics there are, where each of
//! a metric's three cells lives (all pools, small pool, large pool), and the device's totals
//! per cell.
//!
//! A leaf: `counters` (what each shard counts) and `peaks` (the device peak, kept from
//! credit) both build on it and it uses neither, so that they depend one way only, `peaks`
//! on `counters`.

use crate::caching::rules::PoolKind;

/// The statistics that have a `StatArray` in PyTorch, in `DeviceStats` order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Metric {
    Allocation = 0,
    Segment,
    Active,
    InactiveSplit,
    AllocatedBytes,
    ReservedBytes,
    ActiveBytes,
    InactiveSplitBytes,
    RequestedBytes,
}

/// Which cell of a metric's `StatArray` (PyTorch `StatType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StatType {
    /// PyTorch `AGGREGATE`: every pool.
    All,
    /// PyTorch `SMALL_POOL` / `LARGE_POOL`.
    Pool(PoolKind),
}

/// Every metric with a `StatArray`.
pub(crate) const METRICS: [Metric; 9] = [
    Metric::Allocation,
    Metric::Segment,
    Metric::Active,
    Metric::InactiveSplit,
    Metric::AllocatedBytes,
    Metric::ReservedBytes,
    Metric::ActiveBytes,
    Metric::InactiveSplitBytes,
    Metric::RequestedBytes,
];
/// Cells per metric: all, small pool, large pool.
const TYPES: usize = 3;
/// Cell of `oversize_allocations` (aggregate only, as in PyTorch).
pub(crate) const OVERSIZE_ALLOCATIONS: usize = METRICS.len() * TYPES;
/// Cell of `oversize_segments`.
pub(crate) const OVERSIZE_SEGMENTS: usize = METRICS.len() * TYPES + 1;
/// Number of statistics with a peak.
pub(crate) const CELLS: usize = METRICS.len() * TYPES + 2;

/// The index of a metric's cell: the one place that knows the layout.
#[inline(always)]
pub(crate) const fn cell(metric: Metric, t: StatType) -> usize {
    metric as usize * TYPES
        + match t {
            StatType::All => 0,
            StatType::Pool(PoolKind::Small) => 1,
            StatType::Pool(PoolKind::Large) => 2,
        }
}

/// What the device knows of its shards as of the last settle: per cell, the peak `P` and the
/// sums over every shard (retired ones included) of what each had when a settle last visited
/// it. Guarded by the device's peak lock.
pub(crate) struct Totals {
    pub peak: [i64; CELLS],
    pub current: [i64; CELLS],
    pub allocated: [i64; CELLS],
    pub freed: [i64; CELLS],
    /// Credit the shards held (`sum(h_j)`), all of it in shards a settle visits.
    pub held: [i64; CELLS],
    /// PyTorch's `num_device_alloc` and `num_device_free`, summed as the cells are (see
    /// `counters::ShardCounters::device_allocs`).
    pub device_allocs: i64,
    pub device_frees: i64,
}

impl Default for Totals {
    fn default() -> Self {
        Totals {
            peak: [0; CELLS],
            current: [0; CELLS],
            allocated: [0; CELLS],
            freed: [0; CELLS],
            held: [0; CELLS],
            device_allocs: 0,
            device_frees: 0,
        }
    }
}
