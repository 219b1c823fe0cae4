//! Memory statistics in PyTorch's terms (`torch.cuda.memory_stats()`), and how they are kept
//! exact without a shared write on the hot path.
//!
//! Each shard (one stream of one device) counts its own blocks in [`ShardCounters`], under the
//! shard's lock. Current, allocated and freed figures of a device are sums over its shards.
//! A device's peak is the highest its current figure has been, which a sum of per-shard peaks
//! would overstate; [`peaks`] keeps it exact with credit: see that module.

pub mod peaks;
pub mod summary;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::caching::rules::PoolKind;

/// One statistic (PyTorch `Stat`): its value now, its highest value since the last
/// `reset_peak_stats`, and the sums of all increases and all decreases. Bytes or counts,
/// depending on the statistic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

/// A statistic for all blocks and for each pool (PyTorch `StatArray`, indexed by `StatType`:
/// `AGGREGATE`, `SMALL_POOL`, `LARGE_POOL`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

/// Everything `torch.cuda.memory_stats(device)` reports for the native allocator
/// (PyTorch `DeviceStats`), for one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Blocks handed to callers and not yet freed.
    pub allocation: StatArray,
    /// Segments obtained from the driver (`cuMemAlloc`) and not yet released.
    pub segment: StatArray,
    /// Blocks allocated, or freed but awaiting events of other streams.
    pub active: StatArray,
    /// Free blocks that are part of a split segment (cannot be released while split).
    pub inactive_split: StatArray,
    /// Bytes of the blocks in `allocation` (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes of the segments in `segment`.
    pub reserved_bytes: StatArray,
    /// Bytes of the blocks in `active`.
    pub active_bytes: StatArray,
    /// Bytes of the blocks in `inactive_split`.
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for, before rounding, of the blocks in `active`.
    pub requested_bytes: StatArray,
    /// Allocations of at least `max_split_size` bytes.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` bytes.
    pub oversize_segments: Stat,
    /// Times a device allocation was retried after releasing the cache.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors returned.
    pub num_ooms: i64,
    /// Times every outstanding event of the device was waited for (OOM retry, empty_cache).
    pub num_sync_all_streams: i64,
    /// Calls of the driver's allocation (`cuMemAlloc`) that succeeded.
    pub num_device_alloc: i64,
    /// Calls of the driver's free (`cuMemFree`) that succeeded.
    pub num_device_free: i64,
    /// The `max_split_size` in force, in bytes (`i64::MAX` when unlimited, like PyTorch's
    /// `SIZE_MAX`).
    pub max_split_size: i64,
}

/// The statistics that have a `StatArray` in PyTorch, in `DeviceStats` order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
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

const METRICS: usize = 9;
/// Cell of `oversize_allocations` (aggregate only, as in PyTorch).
pub(crate) const OVERSIZE_ALLOCATIONS: usize = METRICS * 3;
/// Cell of `oversize_segments`.
pub(crate) const OVERSIZE_SEGMENTS: usize = METRICS * 3 + 1;
/// Cell of `reserved_bytes` for all pools.
pub(crate) const RESERVED_BYTES_ALL: usize = Metric::ReservedBytes as usize * 3;
/// Number of statistics with a peak.
pub(crate) const CELLS: usize = METRICS * 3 + 2;

#[inline]
fn pool_cell(metric: Metric, pool: PoolKind) -> usize {
    metric as usize * 3 + 1 + pool as usize
}

/// One shard's share of a statistic. `headroom` is credit towards the device peak (see
/// [`peaks`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cell {
    pub current: i64,
    pub allocated: i64,
    pub freed: i64,
    pub headroom: i64,
    /// The lowest `headroom` since the last settle: where this shard's value peaked within
    /// the calls not yet settled.
    pub low: i64,
    /// The most credit this shard has had to borrow at once since it last had to: the credit
    /// it keeps when it gives surplus back to the device reserve (which it does once it holds
    /// `SURPLUS_FACTOR` times this). A settle resets it to zero for a shard that was quiet
    /// since the settle before.
    pub keep: i64,
    /// `allocated + freed` at the last settle: unchanged at the next one means the shard was
    /// quiet in between.
    pub moved_at_settle: i64,
}

/// A shard gives credit back to the device reserve only once it holds this many times what it
/// keeps, so that a stream whose blocks vary in size does not trade credit through the
/// reserve's shared atomics at every call. Measured on the simulated device, 16 threads on
/// their own streams (`examples/settle_rate.rs`): reserve operations in 0.8% of calls at 8,
/// 8% at 4, 38% at 1, for about the same number of settles.
const SURPLUS_FACTOR: i64 = 8;

/// The statistics of one shard. Not synchronised: the shard's lock guards it.
#[derive(Debug)]
pub(crate) struct ShardCounters {
    pub cells: [Cell; CELLS],
    /// Some cell went past its headroom: the device peak must be settled before the call
    /// that did it returns.
    pub needs_settle: bool,
    /// Some cell holds [`SURPLUS_FACTOR`] times more credit than it keeps: give what it does
    /// not keep to the reserve.
    pub has_surplus: bool,
}

impl Default for ShardCounters {
    fn default() -> Self {
        ShardCounters { cells: [Cell::default(); CELLS], needs_settle: false, has_surplus: false }
    }
}

impl ShardCounters {
    #[inline]
    fn up(&mut self, cell: usize, n: i64) {
        let c = &mut self.cells[cell];
        c.current += n;
        c.allocated += n;
        c.headroom -= n;
        c.low = c.low.min(c.headroom);
        self.needs_settle |= c.headroom < 0;
    }

    #[inline]
    fn down(&mut self, cell: usize, n: i64) {
        let c = &mut self.cells[cell];
        c.current -= n;
        c.freed += n;
        c.headroom += n;
        self.has_surplus |= c.headroom > SURPLUS_FACTOR * c.keep;
    }

    /// PyTorch `stats.<metric>[all and pool].increase(n)`.
    #[inline]
    pub fn increase(&mut self, metric: Metric, pool: PoolKind, n: i64) {
        self.up(metric as usize * 3, n);
        self.up(pool_cell(metric, pool), n);
    }

    /// PyTorch `stats.<metric>[all and pool].decrease(n)`.
    #[inline]
    pub fn decrease(&mut self, metric: Metric, pool: PoolKind, n: i64) {
        self.down(metric as usize * 3, n);
        self.down(pool_cell(metric, pool), n);
    }

    /// Increase (`n > 0`) or decrease (`n < 0`) by a signed amount.
    #[inline]
    pub fn change(&mut self, metric: Metric, pool: PoolKind, n: i64) {
        if n > 0 {
            self.increase(metric, pool, n)
        } else if n < 0 {
            self.decrease(metric, pool, -n)
        }
    }

    #[inline]
    pub fn increase_single(&mut self, cell: usize) {
        self.up(cell, 1);
    }

    #[inline]
    pub fn decrease_single(&mut self, cell: usize) {
        self.down(cell, 1);
    }
}

/// Device-wide counters that change only on slow paths (driver calls, OOM, empty_cache).
#[derive(Debug)]
pub(crate) struct DeviceCounters {
    pub num_alloc_retries: AtomicI64,
    pub num_ooms: AtomicI64,
    pub num_sync_all_streams: AtomicI64,
    pub num_device_alloc: AtomicI64,
    pub num_device_free: AtomicI64,
    /// Peak settles that locked every shard of the device (a diagnostic; see [`peaks`]).
    pub num_peak_settles: AtomicI64,
    /// Bytes of every segment of the device (the sum over shards of `reserved_bytes`, kept
    /// here so that a limit can be checked without locking every shard; PyTorch
    /// `total_allocated_memory`).
    pub reserved: AtomicI64,
    /// The most bytes the device may reserve (PyTorch `allowed_memory_maximum`, from
    /// `set_per_process_memory_fraction`); `i64::MAX` when no fraction is set.
    pub limit: AtomicI64,
    /// Blocks and bytes freed with `free_after_device_sync` and not yet released.
    pub deferred_blocks: AtomicI64,
    pub deferred_bytes: AtomicI64,
    /// Device synchronisations that released deferred blocks, and the blocks they released.
    pub num_deferred_syncs: AtomicI64,
    pub num_deferred_released: AtomicI64,
    /// Synchronisation epoch: a block freed in epoch `e` is covered by a synchronisation that
    /// began after the epoch moved past `e`.
    pub sync_epoch: AtomicU64,
}

impl Default for DeviceCounters {
    fn default() -> Self {
        DeviceCounters {
            num_alloc_retries: AtomicI64::new(0),
            num_ooms: AtomicI64::new(0),
            num_sync_all_streams: AtomicI64::new(0),
            num_device_alloc: AtomicI64::new(0),
            num_device_free: AtomicI64::new(0),
            num_peak_settles: AtomicI64::new(0),
            reserved: AtomicI64::new(0),
            limit: AtomicI64::new(i64::MAX),
            deferred_blocks: AtomicI64::new(0),
            deferred_bytes: AtomicI64::new(0),
            num_deferred_syncs: AtomicI64::new(0),
            num_deferred_released: AtomicI64::new(0),
            sync_epoch: AtomicU64::new(0),
        }
    }
}

impl DeviceCounters {
    pub fn bump(counter: &AtomicI64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `size` more bytes reserved, unless that would pass the limit (PyTorch's check
    /// in `alloc_block`: `total_allocated_memory + size > allowed_memory_maximum`). Returns
    /// whether the bytes were counted.
    pub fn try_reserve(&self, size: usize) -> bool {
        let size = size as i64;
        let limit = self.limit.load(Ordering::Relaxed);
        let before = self.reserved.fetch_add(size, Ordering::Relaxed);
        if limit != i64::MAX && before + size > limit {
            self.reserved.fetch_sub(size, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Counts `size` bytes no longer reserved.
    pub fn unreserve(&self, size: usize) {
        self.reserved.fetch_sub(size as i64, Ordering::Relaxed);
    }
}

/// Builds PyTorch's `DeviceStats` from the device peaks and every shard's counters (taken
/// while the peaks were settled, so current and peak agree).
pub(crate) fn collect(
    peaks: &[i64; CELLS],
    shards: &[&ShardCounters],
    counters: &DeviceCounters,
    max_split_size: usize,
) -> DeviceStats {
    let stat = |cell: usize| {
        let mut s = Stat { peak: peaks[cell], ..Stat::default() };
        for sh in shards {
            let c = &sh.cells[cell];
            s.current += c.current;
            s.allocated += c.allocated;
            s.freed += c.freed;
        }
        s
    };
    let array = |m: Metric| {
        let base = m as usize * 3;
        StatArray { all: stat(base), small_pool: stat(base + 1), large_pool: stat(base + 2) }
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
        num_device_alloc: load(&counters.num_device_alloc),
        num_device_free: load(&counters.num_device_free),
        max_split_size: i64::try_from(max_split_size).unwrap_or(i64::MAX),
    }
}
