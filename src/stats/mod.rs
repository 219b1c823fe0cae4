//! Memory statistics as PyTorch reports them (`torch.cuda.memory_stats()`), and the text of
//! `torch.cuda.memory_summary()`: what is reported, not how it is counted (the allocator core
//! counts in `caching::accounting::counters` and keeps peaks in `caching::accounting::peaks`).
//! Imports nothing from the core.
//!
//! - this file: [`Stat`], [`StatArray`], [`DeviceStats`];
//! - [`summary`]: the text table of `torch.cuda.memory_summary()`, and PyTorch's size formats;
//! - [`breakdown`]: where a device's reserved bytes go beyond what the program asked for;
//! - `pool`: one private pool's statistics on one device ([`PoolStats`], `gpupool_pool_stats`).

pub mod breakdown;
mod pool;
pub mod summary;

pub use pool::PoolStats;

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
    /// Requests that failed for lack of memory after the cache was released and the allocation
    /// retried, once each, counted before the out-of-memory observers run (PyTorch increments
    /// `num_ooms` just before calling its observers): every [`crate::Error::OutOfMemory`] of
    /// `malloc`, and a request that an observer's retry then served.
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
    /// Bytes of physical pages the device holds unmapped for its expandable segments (not in
    /// PyTorch, which releases a page when it unmaps it): device memory that is not reserved
    /// (`reserved_bytes` counts mapped pages) but counts against the memory fraction, mapped
    /// by the next growth before any page is created, and released by `empty_cache`, on the
    /// out-of-memory path and under `garbage_collection_threshold`. Device-wide, so no pools;
    /// `allocated` sums the bytes put in the pool, `freed` those mapped again or released.
    /// Always 0 without expandable segments and in a private pool's statistics, and between
    /// calls with the high-water rule off (unless the driver refused a release).
    pub unmapped_held_bytes: Stat,
    /// Bytes of pages that sleeping pools gave back to the driver (`gpupool_sleep`; not in
    /// PyTorch) and will map again at wake: counted in `reserved_bytes` still (the blocks keep
    /// their addresses), not device memory now. `allocated` sums the bytes put to sleep,
    /// `freed` those woken. In a pool's statistics, its own (current only).
    pub sleeping_bytes: Stat,
    /// The most bytes the pool may reserve (`gpupool_pool_set_limit`; not in PyTorch), or
    /// `None` when no limit is set (INT64_MAX in C). In a pool's statistics, the pool's; in the
    /// device's, the default pools' (pool 0).
    pub pool_limit: Option<i64>,
}
