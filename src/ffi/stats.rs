//! Statistics, peak reset, and the memory summary.

use std::ffi::{c_char, c_int};

use super::runtime;
use super::status::{boundary, gpupool_status, out_ptr, write_text};
use crate::error::Error;
use crate::stats::{DeviceStats, Stat, StatArray};

/// The layout version of `gpupool_stats_t` this library writes: 1 up to `max_split_size`; 2
/// adds `unmapped_held_bytes` at the end; 3 adds `sleeping_bytes`; 4 adds `pool_limit`.
pub const GPUPOOL_STATS_VERSION: u32 = 4;

/// One statistic, as PyTorch's `Stat`: `current` value, `peak` (highest since the last
/// `gpupool_reset_peak_stats`), and the sums of every increase (`allocated`) and decrease
/// (`freed`). Bytes for the `*_bytes` statistics, counts for the others.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct gpupool_stat_t {
    /// The value now.
    pub current: i64,
    /// The highest value since the last `gpupool_reset_peak_stats` (or the start).
    pub peak: i64,
    /// The sum of every increase.
    pub allocated: i64,
    /// The sum of every decrease.
    pub freed: i64,
}

/// A statistic for all blocks and per pool (PyTorch's `StatArray`; the keys `all`,
/// `small_pool`, `large_pool` of `torch.cuda.memory_stats()`). The small pool holds blocks of
/// at most 1 MiB.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct gpupool_stat_array_t {
    /// Both pools together.
    pub all: gpupool_stat_t,
    /// The small pool's (blocks of at most 1 MiB).
    pub small_pool: gpupool_stat_t,
    /// The large pool's (blocks over 1 MiB).
    pub large_pool: gpupool_stat_t,
}

/// The counters of `torch.cuda.memory_stats()` for one device.
///
/// Extensible: set `size` to `sizeof(gpupool_stats_t)` before the call. The library writes
/// the first `min(size, its own sizeof)` bytes and sets `size` to that count, so a program
/// built against an older header gets the fields it knows and a newer program can tell which
/// fields an older library filled. Fields are only ever added at the end.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct gpupool_stats_t {
    /// In: `sizeof(gpupool_stats_t)` as the caller compiled it. Out: bytes written.
    pub size: u32,
    /// Out: `GPUPOOL_STATS_VERSION` of the library.
    pub version: u32,
    /// Blocks handed out by `gpupool_malloc` and not yet freed.
    pub allocation: gpupool_stat_array_t,
    /// Segments obtained from the driver (`cuMemAlloc`) and not yet released.
    pub segment: gpupool_stat_array_t,
    /// Blocks allocated, or freed but waiting for the events of `gpupool_record_stream`.
    pub active: gpupool_stat_array_t,
    /// Free blocks in split segments (memory that `gpupool_empty_cache` cannot release).
    pub inactive_split: gpupool_stat_array_t,
    /// Bytes of allocated blocks (after rounding).
    pub allocated_bytes: gpupool_stat_array_t,
    /// Bytes of segments: what gpupool holds from the driver.
    pub reserved_bytes: gpupool_stat_array_t,
    /// Bytes of active blocks.
    pub active_bytes: gpupool_stat_array_t,
    /// Bytes of inactive split blocks.
    pub inactive_split_bytes: gpupool_stat_array_t,
    /// Bytes requested by callers (before rounding) of the active blocks.
    pub requested_bytes: gpupool_stat_array_t,
    /// Allocations of at least `max_split_size` bytes.
    pub oversize_allocations: gpupool_stat_t,
    /// Segments of at least `max_split_size` bytes.
    pub oversize_segments: gpupool_stat_t,
    /// Allocations that released the cache and retried after the device ran out of memory.
    pub num_alloc_retries: i64,
    /// Requests that failed for lack of memory after gpupool released its cache and retried,
    /// once each, counted before the out-of-memory observers run (as PyTorch counts): every
    /// `GPUPOOL_ERROR_OUT_OF_MEMORY`, and a request that an observer's `gpupool_oom_retry`
    /// then served.
    pub num_ooms: i64,
    /// Waits for every pending event of the device (OOM retry, `gpupool_empty_cache`).
    pub num_sync_all_streams: i64,
    /// Successful `cuMemAlloc` calls.
    pub num_device_alloc: i64,
    /// Successful `cuMemFree` calls.
    pub num_device_free: i64,
    /// `max_split_size` in bytes (`GPUPOOL_CONF`'s `max_split_size_mb`); INT64_MAX when
    /// unlimited.
    pub max_split_size: i64,
    /// Version 2. Bytes of physical pages the device holds unmapped for its expandable
    /// segments (not in PyTorch, which releases each page it unmaps): device memory outside
    /// `reserved_bytes` (mapped pages only) that counts against
    /// `gpupool_set_memory_fraction`, mapped again by the next growth before any new page is
    /// created, and released by `gpupool_empty_cache`, on the out-of-memory path and under
    /// `garbage_collection_threshold`. Device-wide; `allocated` sums the bytes put in,
    /// `freed` those mapped again or released. 0 without expandable segments, and between
    /// calls with `GPUPOOL_EXPANDABLE_RECLAIM` off (unless the driver refused a release); 0 in
    /// `gpupool_pool_stats` (the held pages are the device's, not a pool's). A caller built
    /// against version 1 passes a smaller `size` and gets every field before this one.
    pub unmapped_held_bytes: gpupool_stat_t,
    /// Version 3. Bytes of pages that sleeping pools gave back to the driver
    /// (`gpupool_sleep`; not in PyTorch) and will map again at `gpupool_wake`: still counted
    /// in `reserved_bytes` (their blocks keep their addresses), but not device memory now, so
    /// free device memory is `reserved_bytes` minus these more than it would be. `allocated`
    /// sums the bytes put to sleep, `freed` those woken. In `gpupool_pool_stats`, the pool's
    /// own (`current` only; `peak` and `allocated` equal it). A caller built against version
    /// 2 passes a smaller `size` and gets every field before this one.
    pub sleeping_bytes: gpupool_stat_t,
    /// Version 4. The most bytes the pool may reserve (`gpupool_pool_set_limit`; not in
    /// PyTorch), INT64_MAX when no limit is set: in `gpupool_pool_stats`, the pool's; in
    /// `gpupool_stats`, the default pools' (pool 0). A caller built against version 3 passes a
    /// smaller `size` and gets every field before this one.
    pub pool_limit: i64,
}

// Each conversion names every field of both sides, with no `..`: a field added to the core's
// statistics or to the C struct alone fails to compile here.

pub(crate) fn stat(s: &Stat) -> gpupool_stat_t {
    let Stat { current, peak, allocated, freed } = *s;
    gpupool_stat_t { current, peak, allocated, freed }
}

fn array(a: &StatArray) -> gpupool_stat_array_t {
    let StatArray { all, small_pool, large_pool } = a;
    gpupool_stat_array_t { all: stat(all), small_pool: stat(small_pool), large_pool: stat(large_pool) }
}

impl From<&DeviceStats> for gpupool_stats_t {
    fn from(s: &DeviceStats) -> Self {
        let DeviceStats {
            allocation,
            segment,
            active,
            inactive_split,
            allocated_bytes,
            reserved_bytes,
            active_bytes,
            inactive_split_bytes,
            requested_bytes,
            oversize_allocations,
            oversize_segments,
            num_alloc_retries,
            num_ooms,
            num_sync_all_streams,
            num_device_alloc,
            num_device_free,
            max_split_size,
            unmapped_held_bytes,
            sleeping_bytes,
            pool_limit,
        } = *s;
        gpupool_stats_t {
            size: size_of::<gpupool_stats_t>() as u32,
            version: GPUPOOL_STATS_VERSION,
            allocation: array(&allocation),
            segment: array(&segment),
            active: array(&active),
            inactive_split: array(&inactive_split),
            allocated_bytes: array(&allocated_bytes),
            reserved_bytes: array(&reserved_bytes),
            active_bytes: array(&active_bytes),
            inactive_split_bytes: array(&inactive_split_bytes),
            requested_bytes: array(&requested_bytes),
            oversize_allocations: stat(&oversize_allocations),
            oversize_segments: stat(&oversize_segments),
            num_alloc_retries,
            num_ooms,
            num_sync_all_streams,
            num_device_alloc,
            num_device_free,
            max_split_size,
            unmapped_held_bytes: stat(&unmapped_held_bytes),
            sleeping_bytes: stat(&sleeping_bytes),
            pool_limit: pool_limit.unwrap_or(i64::MAX),
        }
    }
}

const HEADER: usize = 8;

/// --------------------------------------------------------------------------------------------
/// Statistics and the memory summary
/// --------------------------------------------------------------------------------------------
///
/// What the cache holds, in PyTorch's terms: `gpupool_stats` fills a `gpupool_stats_t` with the
/// figures of `torch.cuda.memory_stats()` (set its `size` first: `GPUPOOL_STATS_INIT` does),
/// `gpupool_reset_peak_stats` starts the peaks afresh, and `gpupool_memory_summary` writes the
/// table of `torch.cuda.memory_summary()`. One private pool's figures: `gpupool_pool_stats`; pinned
/// host memory's: `gpupool_host_stats`; one tag's: `gpupool_tag_stats`.
///
/// --------------------------------------------------------------------------------------------
///
/// Reads the statistics of `device` (-1: the calling thread's current device) into `*out`, as
/// one consistent snapshot (PyTorch `torch.cuda.memory_stats`).
///
/// - `out`: caller-owned; set `out->size = sizeof(gpupool_stats_t)` first. Written only on
///   success, and only its first `out->size` bytes.
///
/// Peaks are exact for any sequence of calls that do not overlap in time; while several
/// threads allocate on different streams of one device at the same moment, a peak can be off,
/// above or below, by what those streams moved while it was settled (a settle visits the
/// streams one at a time, and they go on meanwhile). What a reader may
/// always rely on, concurrent or not: `current <= peak` for every statistic, and for each one
/// with pools, `max(small_pool.peak, large_pool.peak) <= all.peak <= small_pool.peak +
/// large_pool.peak`; without expandable segments, `num_device_alloc - num_device_free ==
/// segment.all.current` (each growth of an expandable segment counts as a device allocation,
/// and each address range as one segment); `allocated_bytes.all.current` and
/// `active_bytes.all.current` at most `reserved_bytes.all.current`. A stream whose first call
/// runs during the read is in the snapshot wholly or not at all. The time taken follows the
/// streams that allocated or freed since the last snapshot, not the number of streams.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `out`, `out->size` under 8, device out of
/// range); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; briefly takes every lock of the device.
///
/// # Safety
/// `out` must be NULL or point to writable storage of at least `out->size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_stats(device: c_int, out: *mut gpupool_stats_t) -> gpupool_status {
    boundary("gpupool_stats", || {
        let out = out_ptr(out, "out")?.as_ptr();
        let stats = runtime()?.allocator.stats(device)?;
        // SAFETY: the caller's pointer, per this function's contract.
        unsafe { write_stats(out, &stats) }
    })
}

/// Writes `stats` to the caller's extensible struct: its first `min(out->size, sizeof)` bytes,
/// and `out->size` to that count.
///
/// Errors: [`Error::InvalidValue`] when `out->size` is under 8 (nothing written).
///
/// # Safety
/// `out` is non-NULL and points to writable storage of at least `out->size` bytes.
pub(crate) unsafe fn write_stats(out: *mut gpupool_stats_t, stats: &DeviceStats) -> Result<(), Error> {
    // SAFETY: `out` is non-NULL and points to at least the 4-byte `size` field.
    let caller_size = unsafe { std::ptr::addr_of!((*out).size).read_unaligned() } as usize;
    if caller_size < HEADER {
        return Err(Error::InvalidValue(format!(
            "out->size is {caller_size}; set it to sizeof(gpupool_stats_t) first"
        )));
    }
    let mut full = gpupool_stats_t::from(stats);
    let n = caller_size.min(size_of::<gpupool_stats_t>());
    full.size = n as u32;
    // SAFETY: the caller's struct is at least `caller_size >= n` bytes, per the contract.
    unsafe { std::ptr::copy_nonoverlapping((&raw const full).cast::<u8>(), out.cast::<u8>(), n) };
    Ok(())
}

/// Writes to `*settles` how many calls on `device` (-1: the calling thread's current device)
/// settled its peak statistics since the library started: a diagnostic of what exact peaks
/// cost, gpupool's own (PyTorch keeps its statistics under one device lock and needs none).
///
/// Each stream keeps credit towards the device's peaks; a call that goes past its stream's
/// credit borrows from the device's spare credit, and only when that cannot cover it (a new
/// peak, or the credit held by other streams) settles: it visits, one at a time, the streams
/// that moved since the last settle, each for a moment under its lock. A steady workload
/// settles a few times per 10,000 calls or less; `examples/c/thread_scaling.c` prints the
/// rate. `gpupool_stats`, `gpupool_reset_peak_stats` and `gpupool_empty_cache` settle too and
/// are not counted.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `settles`, device out of range; nothing
/// written); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; takes no lock (the count is one atomic, read as it is).
///
/// # Safety
/// `settles` must be NULL or point to a writable `int64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_peak_settles(device: c_int, settles: *mut i64) -> gpupool_status {
    boundary("gpupool_peak_settles", || {
        let out = out_ptr(settles, "settles")?;
        let n = runtime()?.allocator.peak_settles(device)?;
        // SAFETY: the caller's pointer, per this function's contract.
        unsafe { out.write(n) };
        Ok(())
    })
}

/// Sets every peak of `device` (-1: current) to its current value (PyTorch
/// `torch.cuda.reset_peak_memory_stats`).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (device out of range);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_reset_peak_stats(device: c_int) -> gpupool_status {
    boundary("gpupool_reset_peak_stats", || runtime()?.allocator.reset_peak_stats(device))
}

/// Writes a text table of `device`'s statistics (-1: current), with the rows and columns of
/// `torch.cuda.memory_summary()`: allocated, active, requested, reserved and non-releasable
/// memory, and the counts, each per pool, with current, peak, total allocated and total freed.
///
/// - `buf`, `len`: a caller-owned buffer of `len` bytes, or NULL to ask for the size only.
/// - `needed`: if not NULL, receives the bytes the text needs, NUL included.
///
/// snprintf's two-call idiom: call with `buf` NULL (or a buffer that may be too small), allocate
/// `*needed` bytes, call again. With a buffer of at least `*needed` bytes: writes the
/// NUL-terminated text and `*needed`, and succeeds. With a buffer too small: writes `*needed`,
/// leaves the buffer untouched and returns `GPUPOOL_ERROR_INVALID_VALUE`; this (and the same in
/// `gpupool_config_string`) is the exception to "outputs are written only on success". The table can grow between two calls
/// (a new digit); allocate a little more than asked, or call again while the error persists.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (both `buf` and `needed` NULL; `len` too small, the
/// message gives the size needed; device out of range, nothing written);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Thread-safe.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes; `needed` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_memory_summary(
    device: c_int,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> gpupool_status {
    boundary("gpupool_memory_summary", || {
        // Both are optional, but a call with neither has nowhere to put its answer.
        if buf.is_null() && needed.is_null() {
            return Err(Error::InvalidValue("buf and needed are both NULL".into()));
        }
        let text = runtime()?.allocator.memory_summary(device)?;
        // SAFETY: the caller's buffer and out-pointer, per this function's contract.
        unsafe { write_text(&text, "summary", buf, len, needed) }?;
        Ok(())
    })
}
