//! Private memory pools and CUDA graph capture (PyTorch `torch.cuda.graph`,
//! `torch.cuda.graph_pool_handle`, `torch.cuda.MemPool`, `torch.cuda.use_mem_pool`).
//!
//! A CUDA graph replays its kernels at the addresses they had during capture, so its buffers
//! must stay reserved, and unused by anything else, for as long as the graph lives. A private
//! pool gives them that: the allocations routed to it (by stream, by thread, or by a filter)
//! take memory that nothing else shares. While a stream captures, gpupool makes no call that
//! CUDA forbids during capture on its behalf: no `cuMemAlloc` for the default pools, no event
//! query or record for a free, no synchronisation; a request that the default pools cannot
//! serve from their cache fails with `GPUPOOL_ERROR_STREAM_CAPTURE` and leaves the capture
//! intact.
//!
//! The rules (PyTorch's `CUDACachingAllocator.cpp` unless said):
//! - Inside a pool, blocks freed during a capture are reused within the same capture, so a
//!   captured forward pass takes no more memory than an eager one. Several graphs may share a
//!   pool (PyTorch's `pool=` argument) when they replay in the order they were captured.
//! - A private pool grows during capture: its new segments are made with the calling thread's
//!   capture mode relaxed for the call (`cuThreadExchangeStreamCaptureMode`, as PyTorch's
//!   `cudaMallocMaybeCapturing`); `cuMemAlloc` is not a stream operation, so it is not captured
//!   and the graph keeps the address. A pool's segments are ordinary ones, never expandable.
//! - A segment that served a block while its stream captured stays reserved until the pool is
//!   released. Other wholly free segments of a live pool go back to the driver at
//!   `gpupool_empty_cache` (PyTorch keeps a live pool's memory, issue #167745), and a live
//!   pool's freed blocks are reused by later allocations routed to it.
//! - Frees of blocks that other streams used (`gpupool_record_stream`) while a route by stream
//!   or filter is active, or a stream concerned captures, wait, active, until no capture is
//!   under way (PyTorch `insert_events_deferred_until_no_capture`): then gpupool records their
//!   events. Event queries pause meanwhile. Routes by thread (`use_mem_pool`) capture nothing
//!   and do not count (PyTorch counts them).
//! - While a capture may be under way on a device (a route by stream or filter is active, or a
//!   stream gpupool found capturing still captures), gpupool gives no memory back to the
//!   driver, unmaps nothing and synchronises nothing there: `gpupool_empty_cache` and the
//!   out-of-memory path's release-and-retry return `GPUPOOL_ERROR_STREAM_CAPTURE` having done
//!   nothing, and new segments for other streams are made with the thread's capture mode
//!   relaxed. A program's own forbidden calls (a `cudaMalloc` in global mode on the capturing
//!   thread) still break its capture, as with PyTorch.
//! - `gpupool_release_pool` releases a pool even if blocks are still allocated: those go back
//!   to the driver as they are freed (PyTorch leaks the pool of a failed capture, PR #190348).
//!
//! Statistics: `gpupool_stats` of a device includes its pools; `gpupool_pool_stats` reads one
//! pool; `gpupool_memory_summary` lists them; snapshots carry each segment's pool as
//! PyTorch's `segment_pool_id` (`(0, pool)`, `(0, 0)` for the default pools).

use std::ffi::{c_int, c_void};

use super::stats::gpupool_stats_t;
use super::status::{boundary, gpupool_status, out_ptr};
use super::{gpupool_stream_t, runtime};
use crate::error::Error;

/// A route's test of a stream for `gpupool_begin_allocate_to_pool_filter`: returns nonzero when
/// allocations on `stream` go to the pool. `user` is the pointer given with it.
#[allow(non_camel_case_types)]
pub type gpupool_stream_filter_t = Option<unsafe extern "C" fn(user: *mut c_void, stream: gpupool_stream_t) -> c_int>;

/// --------------------------------------------------------------------------------------------
/// Private pools and CUDA graphs
/// --------------------------------------------------------------------------------------------
///
/// A private pool holds memory that nothing else shares, as a CUDA graph's buffers need (PyTorch
/// `torch.cuda.graph`, `graph_pool_handle`, `MemPool` and `use_mem_pool`): create one, route a
/// stream's, a thread's or a filter's allocations to it between `gpupool_begin_allocate_to_pool*`
/// and `gpupool_end_allocate_to_pool`, capture, and release it with `gpupool_release_pool` once its
/// graphs are gone. While a stream captures, gpupool makes no call that CUDA forbids then.
/// `gpupool_pool_create_with_allocator` takes a pool's segments from the program's own allocator
/// (PyTorch `MemPool(allocator)`, for `ncclMemAlloc`).
///
/// --------------------------------------------------------------------------------------------
///
/// Creates a private pool and writes its id to `*pool` (PyTorch `graph_pool_handle()`, or a
/// `MemPool`). The id is never 0 (0 names the default pools) and never reused; ids are
/// process-wide, and a pool's memory is per device: made on the devices whose allocations are
/// routed to it. Creating a pool takes no device memory and needs no release if never used.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `pool`); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
///
/// # Safety
/// `pool` must be NULL or point to writable storage for one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_create(pool: *mut u64) -> gpupool_status {
    boundary("gpupool_pool_create", || {
        let pool = out_ptr(pool, "pool")?;
        let id = runtime()?.allocator.pool_create();
        // SAFETY: the caller passes storage for one uint64_t.
        unsafe { pool.write(id) };
        Ok(())
    })
}

/// `gpupool_pool_create_ex`'s flag: the pool serves, from its cache, the requests to the default
/// pools that would otherwise fail with out of memory (PyTorch `torch.cuda.MemPool(use_on_oom=True)`).
pub const GPUPOOL_POOL_USE_ON_OOM: u32 = 1;

/// `gpupool_pool_create_ex`'s flag: the pool never splits a block (PyTorch
/// `torch.cuda.MemPool(no_split=True)`).
pub const GPUPOOL_POOL_NO_SPLIT: u32 = 2;

// The C names are the Rust API's flags.
const _: () =
    assert!(GPUPOOL_POOL_USE_ON_OOM == crate::POOL_USE_ON_OOM && GPUPOOL_POOL_NO_SPLIT == crate::POOL_NO_SPLIT);

/// Creates a private pool with `flags` and writes its id to `*pool`, as `gpupool_pool_create`
/// (PyTorch `torch.cuda.MemPool(use_on_oom=, no_split=)`, PRs #151487, #169699 and #169739).
/// The flags hold for the pool's life, on every device; 0 is `gpupool_pool_create`.
///
/// - `GPUPOOL_POOL_USE_ON_OOM`: a fallback pool. Once a request to the default pools has failed
///   the cache and a new segment, it is served from the cache of the fallback pools on its
///   device and stream (never from a new segment of theirs), by increasing id, the first that
///   fits; only then do the default pools' budget path, release-and-retry and the
///   out-of-memory observers run (PyTorch tries its `use_on_oom` pools before releasing its
///   cache, PR #169699, in no set order). A request served so is no out-of-memory: not counted
///   in `num_ooms`, no observer called. The block is the fallback pool's: it counts in its
///   `gpupool_pool_stats` (and the device's), and goes back to its cache when freed. Requests
///   routed to a private pool never fall back. A fallback pool released on a device, or asleep,
///   serves none there, nor on a stream where it keeps a segment for a CUDA graph (gpupool's
///   rule: the graph replays into that segment's free blocks; PyTorch hands them out); its limit (`gpupool_pool_set_limit`) holds, since a fallback never grows
///   it. A request the default pools' limit refused falls back too (as PyTorch's memory fraction
///   does). Fill a fallback pool's cache through a route (`gpupool_begin_allocate_to_pool*`).
/// - `GPUPOOL_POOL_NO_SPLIT`: the pool's blocks are never split (PyTorch's `should_split` is
///   false for it): a request routed there takes a whole cached block that fits by PyTorch's
///   rules (the best fit; a block over `max_split_size` only within `max_non_split_rounding`),
///   or a whole new segment, sized as PyTorch sizes them (2 MiB for up to 1 MiB, 20 MiB up to
///   10 MiB, else the request rounded up to 2 MiB), and its whole size counts as allocated. A
///   private pool's segments are never expandable, so PyTorch's expandable case does not arise.
///
/// Errors (no pool made, `*pool` untouched): `GPUPOOL_ERROR_INVALID_VALUE` for NULL `pool` or a
/// bit of `flags` that is no flag (the message names it); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
///
/// # Safety
/// `pool` must be NULL or point to writable storage for one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_create_ex(pool: *mut u64, flags: u32) -> gpupool_status {
    boundary("gpupool_pool_create_ex", || {
        let pool = out_ptr(pool, "pool")?;
        let id = runtime()?.allocator.pool_create_ex(flags)?;
        // SAFETY: the caller passes storage for one uint64_t.
        unsafe { pool.write(id) };
        Ok(())
    })
}

/// Routes every allocation on `stream` of `device` (-1: the calling thread's current device),
/// from any thread, to private pool `pool` until `gpupool_end_allocate_to_pool` (PyTorch
/// `beginAllocateToPool`, with the filter `torch.cuda.graph` sets: its capture stream). Call it
/// before `cudaStreamBeginCapture` on `stream`, and end it after `cudaStreamEndCapture`.
///
/// While a route is active on the device, allocations look for a route first (the first begun
/// that matches takes them); without routes that costs the hit path one relaxed load. Frees
/// need no route: a block goes back to its pool wherever it is freed.
///
/// Errors (each leaves everything as it was): `GPUPOOL_ERROR_INVALID_VALUE` for pool 0, a pool
/// never created, a pool released on this device, a stream routed already on this device (to
/// any pool), a device out of range; `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_begin_allocate_to_pool(
    device: c_int,
    pool: u64,
    stream: gpupool_stream_t,
) -> gpupool_status {
    boundary("gpupool_begin_allocate_to_pool", || {
        runtime()?.allocator.begin_allocate_to_pool(device, pool, stream as usize)
    })
}

/// Routes the allocations the calling thread makes on `device` (-1: current), on any stream,
/// to private pool `pool` until `gpupool_end_allocate_to_pool` (PyTorch
/// `torch.cuda.use_mem_pool`). Other threads' allocations are not routed. Each routed
/// allocation asks the driver whether its stream captures (`cuStreamGetCaptureInfo`), so it
/// costs a driver call more than a cache hit of the default pools.
///
/// Errors: as `gpupool_begin_allocate_to_pool`, and `GPUPOOL_ERROR_INVALID_VALUE` when the
/// calling thread is routed already on this device.
///
/// Thread-safe; the route belongs to the calling thread, but any thread may end it.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_begin_allocate_to_pool_thread(device: c_int, pool: u64) -> gpupool_status {
    boundary("gpupool_begin_allocate_to_pool_thread", || {
        runtime()?.allocator.begin_allocate_to_pool_thread(device, pool)
    })
}

/// Routes the allocations on `device` (-1: current) on the streams for which `filter(user,
/// stream)` returns nonzero to private pool `pool` until `gpupool_end_allocate_to_pool`
/// (PyTorch `beginAllocateToPool(device, mempool_id, filter)`; `torch.cuda.graph`'s filter
/// accepts the streams whose capture id is the graph's, which lets work forked onto side
/// streams during capture allocate from the pool too).
///
/// `filter` is called only on allocations made while some route is active on the device, on the
/// allocating thread, with no lock of gpupool's held (it may call gpupool and CUDA, e.g.
/// `cudaStreamGetCaptureInfo`); never on the hit path otherwise. It and `user` must stay valid
/// until the route ends, and `filter` must be safe to call from any thread at once. gpupool
/// does not own `user`. Routes may overlap: no conflict with other routes is checked, and the
/// route begun first takes an allocation.
///
/// Errors: as `gpupool_begin_allocate_to_pool` (a NULL `filter` is `GPUPOOL_ERROR_INVALID_VALUE`).
///
/// Thread-safe.
///
/// # Safety
/// `filter` must be NULL or a function callable as declared, with `user`, from any thread,
/// until the route ends.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_begin_allocate_to_pool_filter(
    device: c_int,
    pool: u64,
    filter: gpupool_stream_filter_t,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_begin_allocate_to_pool_filter", || {
        let f = filter
            .ok_or_else(|| Error::InvalidValue("filter is NULL; pass the function that tests a stream".into()))?;
        // SAFETY: one calling convention; "C-unwind" only lets the thread's end leave it (it is
        // called as a callout, `crate::callout`).
        let f = unsafe { std::mem::transmute::<FilterC, FilterPtr>(f) };
        let user = UserPtr(user);
        runtime()?.allocator.begin_allocate_to_pool_filter(device, pool, move |stream| {
            let user = &user;
            // A callout: the filter may end the thread (see `crate::callout`); a thread ending
            // in it is not routed.
            // SAFETY: the caller promised a function callable with `user` from any thread
            // until the route ends, which is before this closure is dropped.
            crate::callout::callout(|| unsafe { f(user.0, stream as gpupool_stream_t) != 0 }).unwrap_or(false)
        })
    })
}

/// The filter as gpupool calls it: "C-unwind", since it may end the thread (see
/// `crate::callout`); the public type stays "C", as in `oom`.
type FilterPtr = unsafe extern "C-unwind" fn(*mut c_void, gpupool_stream_t) -> c_int;
type FilterC = unsafe extern "C" fn(*mut c_void, gpupool_stream_t) -> c_int;

/// The caller's `user` pointer: passed back to its filter, never dereferenced by gpupool.
struct UserPtr(*mut c_void);
// SAFETY: gpupool only hands the pointer back to the caller's filter, which the caller made
// callable from any thread (the contract of `gpupool_begin_allocate_to_pool_filter`).
unsafe impl Send for UserPtr {}
// SAFETY: as above.
unsafe impl Sync for UserPtr {}

/// Ends every route to private pool `pool` on `device` (-1: current), of every kind and
/// thread (PyTorch `endAllocateToPool`). Later allocations go to the default pools again;
/// blocks of the pool stay where they are, and are reused when the pool is routed to again.
/// Once no route is left on the device, blocks freed during captures get their events.
///
/// Errors (nothing changed): `GPUPOOL_ERROR_INVALID_VALUE` for pool 0, a pool never created,
/// no active route to the pool on this device, a device out of range;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_end_allocate_to_pool(device: c_int, pool: u64) -> gpupool_status {
    boundary("gpupool_end_allocate_to_pool", || runtime()?.allocator.end_allocate_to_pool(device, pool))
}

/// Says that the graphs that used private pool `pool` on `device` (-1: current) are destroyed,
/// or that the capture failed or was abandoned (PyTorch `releasePool`): the pool's routes on the
/// device end, its wholly free segments go back to the driver now (`cuMemFree`), and the others
/// as their last block is freed, even if blocks are still allocated (they stay valid until
/// freed). The pool's cached blocks are never reused. The id stays valid on other devices.
///
/// Where gpupool differs: PyTorch frees a pool only once every block is free and its use count
/// is 0, and leaks the pool of a failed capture; gpupool releases on this call. If a capture may
/// be under way on the device (a route by stream or filter is active, or a stream gpupool found
/// capturing, the pool's own included, still captures), the segments go back at the next free,
/// `gpupool_end_allocate_to_pool` or `gpupool_empty_cache` instead, so that no `cuMemFree`
/// breaks that capture. A released pool that holds nothing is forgotten but for its id (8 bytes
/// a pool, for the life of the process).
///
/// Errors (nothing changed): `GPUPOOL_ERROR_INVALID_VALUE` for pool 0, a pool never created, a
/// pool released on this device already, a device out of range;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_release_pool(device: c_int, pool: u64) -> gpupool_status {
    boundary("gpupool_release_pool", || runtime()?.allocator.release_pool(device, pool))
}

/// Reads the statistics of private pool `pool` on `device` (-1: current) into `*out`: the
/// counters of `gpupool_stats` (bytes and counts, as there) over the pool's blocks and
/// segments only. The device's `gpupool_stats` includes every pool.
///
/// - `out`: caller-owned; set `out->size = sizeof(gpupool_stats_t)` first, as for
///   `gpupool_stats`. Written only on success.
///
/// `current`, `allocated` and `freed` are exact; a `peak` is the highest value seen after an
/// allocation from the pool or at a read (exact for a pool used by one stream at a time). The
/// device event counts (`num_*`) are 0 here. A pool never used on the device reads as zeros.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `out`, `out->size` under 8, pool 0, a pool never
/// created, device out of range); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; locks the pool's streams one at a time.
///
/// # Safety
/// `out` must be NULL or point to writable storage of at least `out->size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_stats(
    device: c_int,
    pool: u64,
    out: *mut gpupool_stats_t,
) -> gpupool_status {
    boundary("gpupool_pool_stats", || {
        let out = out_ptr(out, "out")?.as_ptr();
        let stats = runtime()?.allocator.pool_stats(device, pool)?.stats;
        // SAFETY: as `gpupool_stats`, whose contract this function shares.
        unsafe { super::stats::write_stats(out, &stats) }
    })
}

/// The `bytes` of `gpupool_pool_set_limit` that removes a pool's limit, and what
/// `gpupool_pool_get_limit` writes for a pool without one.
pub const GPUPOOL_NO_LIMIT: u64 = u64::MAX;

/// Sets the most bytes pool `pool` may reserve on `device` (-1: current): its budget (not in
/// PyTorch, whose one limit is the process's `set_per_process_memory_fraction`). `pool` 0 names
/// the default pools (every stream's, together); any other id a pool made by
/// `gpupool_pool_create*`. `bytes` `GPUPOOL_NO_LIMIT` (UINT64_MAX) removes the limit.
///
/// What counts: the pool's `reserved_bytes` (its segments, and the pages mapped in its
/// expandable segments; not the device's unmapped held pages). Once a new segment or new pages
/// would take them past the limit, the pool's own free cache on the device goes back to the
/// driver and the request is tried again, after waiting (as on out of memory) for the events
/// of the pool's freed blocks (`gpupool_record_stream`) and for the device where blocks await
/// it (`free_after_device_sync`), so that such a block that fits serves it; if the limit
/// still refuses it (at every page size an expandable growth tries), the request fails
/// with `GPUPOOL_ERROR_OUT_OF_MEMORY` (counted in `num_ooms`, the out-of-memory observers
/// called first, one more attempt if one asks), the message naming the pool, its limit and its
/// use. Other pools' caches and the driver are not touched. Requests served from the pool's
/// cache are never checked: a limit costs the hit path nothing. The device's memory fraction
/// still applies: the first limit reached refuses.
///
/// The call releases nothing: a pool over its new limit keeps what it holds, and its growths
/// are refused until it shrinks. 0 lets the pool grow no more; a limit over the device's memory
/// never binds (the device runs out first). Growths already under way on other threads were
/// checked against the old limit. A released pool's limit stays until the pool is forgotten.
///
/// Errors (nothing changed): `GPUPOOL_ERROR_INVALID_VALUE` for a pool never created, a pool
/// released on this device, `bytes` over INT64_MAX but UINT64_MAX, a device out of range;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe, with allocations of the pool under way on other threads.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_pool_set_limit(device: c_int, pool: u64, bytes: u64) -> gpupool_status {
    boundary("gpupool_pool_set_limit", || runtime()?.allocator.pool_set_limit(device, pool, Some(bytes)))
}

/// Reads the limit of pool `pool` (0: the default pools) on `device` (-1: current) into
/// `*bytes`: `GPUPOOL_NO_LIMIT` (UINT64_MAX) when none is set. `gpupool_pool_stats` reports it
/// too (`pool_limit`, INT64_MAX for none).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `bytes`, a pool never created, a device out of
/// range); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
///
/// # Safety
/// `bytes` must be NULL or point to writable storage for one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_get_limit(device: c_int, pool: u64, bytes: *mut u64) -> gpupool_status {
    boundary("gpupool_pool_get_limit", || {
        let out = out_ptr(bytes, "bytes")?;
        let limit = runtime()?.allocator.pool_limit(device, pool)?;
        // SAFETY: the caller passes storage for one uint64_t.
        unsafe { out.write(limit.unwrap_or(GPUPOOL_NO_LIMIT)) };
        Ok(())
    })
}
