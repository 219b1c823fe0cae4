//! Allocation, free, record_stream, a stream's retirement and empty_cache.

use std::ffi::{c_int, c_void};

use super::status::{boundary, boundary_boxed, gpupool_status, out_ptr};
use super::{gpupool_stream_t, runtime, started_runtime};
use crate::error::Error;

// Where Rust callers have found it (tests/capi/fuzz.rs); it lives in `largest`, so that the
// header has it in its section, after the pools.
pub use super::largest::gpupool_largest_allocatable;

/// --------------------------------------------------------------------------------------------
/// Device memory
/// --------------------------------------------------------------------------------------------
///
/// `gpupool_malloc` and `gpupool_free` are PyTorch's `raw_alloc_with_stream` and `raw_delete`: a
/// block belongs to the stream it was allocated on, and once freed it serves that stream's next
/// allocations at once, with no synchronisation. `gpupool_record_stream` names the other streams
/// that use a block; `gpupool_empty_cache` gives the cached memory that no block uses back to the
/// driver. Blocks are carved from segments that the cache keeps: expandable segments by default,
/// PyTorch's ordinary segments with `expandable_segments:False` (see "Expandable segments" below).
/// A cache hit takes one uncontended lock and makes no driver call.
///
/// --------------------------------------------------------------------------------------------
///
/// Allocates at least `size` bytes of device memory on `device` for use on `stream`, from
/// gpupool's cache when a cached block fits (PyTorch `raw_alloc_with_stream`).
///
/// - `ptr`: out-pointer, written only on success. Must not be NULL.
/// - `size`: bytes. 0 gives `*ptr = NULL` and success. Rounded up to a multiple of 512 bytes.
///   With the default expandable segments, a stream's blocks are carved from address ranges
///   that map 2 MiB pages as they grow (20 MiB pages for requests of 20 MiB and more). With
///   `expandable_segments:False`, as in PyTorch: requests up to 1 MiB share 2 MiB segments,
///   larger ones are carved from 20 MiB segments (under 10 MiB) or get a segment of their own
///   rounded up to 2 MiB.
/// - `device`: a device ordinal, or -1 for the calling thread's current device
///   (`cudaGetDevice`).
/// - `stream`: the stream the memory will be used on (`cudaStream_t`/`CUstream`; NULL is the
///   legacy default stream). The block is reused only by later allocations on the same stream,
///   unless `gpupool_record_stream` says otherwise. gpupool never synchronizes the stream.
///
/// The memory is not initialised. Device pointers are valid in the device's primary context,
/// i.e. for the CUDA runtime API. A cache hit takes one uncontended lock and makes no driver
/// call; threads allocating on different streams do not contend.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `ptr`, device out of range, `size` overflows
/// when rounded); `GPUPOOL_ERROR_OUT_OF_MEMORY` when the device is full even after gpupool
/// waited for its pending events, released every cached segment of the device and retried
/// once (the message has PyTorch's figures: requested, total, free, allocated, reserved);
/// counted in `num_ooms`. `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` (no driver, or in a process forked
/// from one that used gpupool: CUDA does not survive `fork()`). `GPUPOOL_ERROR_CUDA` when a
/// driver call fails otherwise, including a `cuEventQuery` of a freed block's event that fails
/// for lack of memory (an event query is no allocation: not `OUT_OF_MEMORY`, not in
/// `num_ooms`, and the event stays pending).
///
/// While a route to a private pool is active on the device (`gpupool_begin_allocate_to_pool`
/// and its variants), an allocation the route takes comes from that pool instead. While
/// `stream` captures a CUDA graph, gpupool makes no call CUDA forbids then: a request that no
/// cached block of the default pools fits fails with `GPUPOOL_ERROR_STREAM_CAPTURE` (the
/// capture stays intact; route the stream to a private pool, or warm up first), and a private
/// pool grows as in PyTorch (see `gpupool_begin_allocate_to_pool`). While a capture may be
/// under way on the device, the out-of-memory path does not release the cache (that would break
/// the capture), as PyTorch's `malloc` skips `release_cached_blocks` while `captures_underway`
/// is not empty: a request that needed it fails with `GPUPOOL_ERROR_OUT_OF_MEMORY`, counted in
/// `num_ooms`, the out-of-memory observers called.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` must be NULL or point to writable storage for one `void *`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_malloc(
    ptr: *mut *mut c_void,
    size: usize,
    device: c_int,
    stream: gpupool_stream_t,
) -> gpupool_status {
    boundary_boxed("gpupool_malloc", || {
        let ptr = out_ptr(ptr, "ptr")?;
        let p = malloc(size, device, stream)?;
        // SAFETY: the caller passes storage for one `void *`.
        unsafe { ptr.write(p) };
        Ok(())
    })
}

/// Frees memory from `gpupool_malloc` back to gpupool's cache (PyTorch `raw_delete`): the
/// block becomes available to later allocations on its stream at once, or, if
/// `gpupool_record_stream` named other streams, once the work queued on each of them up to
/// now has completed (gpupool records one event per such stream and polls it at later calls;
/// it never blocks here). Neighbouring free blocks of the same segment are merged. The memory
/// stays reserved from the driver until `gpupool_empty_cache`.
///
/// - `ptr`: as returned by `gpupool_malloc`, on any device. NULL is a no-op.
///
/// Work already queued on the allocating stream may still use the block: a later allocation
/// on that stream is ordered after it, as with PyTorch.
///
/// If an event for a `gpupool_record_stream` stream cannot be created or recorded (the driver
/// is out of memory for it, say), the free still succeeds: the block then waits for gpupool's
/// next synchronisation of the whole device (`cuCtxSynchronize`, made by `gpupool_empty_cache`
/// and on the out-of-memory path) before it is reused. PyTorch's free fails instead; a caller
/// that ignores the status would leak the block.
///
/// Errors: `GPUPOOL_ERROR_INVALID_POINTER` for a pointer gpupool did not hand out, a pointer
/// inside a block, or a block already freed; the pools are left exactly as they were.
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` in a process forked from one that used gpupool.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_free(ptr: *mut c_void) -> gpupool_status {
    boundary_boxed("gpupool_free", || free(ptr))
}

/// Says that the block at `ptr` is also used by work on `stream`, so that after
/// `gpupool_free` it is not reused until that work, as queued at the time of the free, has
/// completed (the meaning of PyTorch's `Tensor.record_stream`). Use on the allocating stream
/// is a no-op; naming a stream twice counts once.
///
/// - `ptr`: as returned by `gpupool_malloc` and not yet freed. NULL is a no-op.
/// - `stream`: any stream of the block's device.
///
/// Errors: `GPUPOOL_ERROR_INVALID_POINTER` when `ptr` is not an allocated block (nothing
/// changes).
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_record_stream(ptr: *mut c_void, stream: gpupool_stream_t) -> gpupool_status {
    boundary("gpupool_record_stream", || record_stream(ptr, stream))
}

/// Call last before destroying `stream` (`cudaStreamDestroy`) of `device` (-1: the current
/// device), with no work queued on it after: when gpupool holds any block or segment of the
/// stream (in the default pools or a private pool), or a live block is in use on it
/// (`gpupool_record_stream`), waits for the stream's work (`cuStreamSynchronize`), after which
/// those blocks forget the use (their free records no event on the destroyed handle);
/// `*waited` (may be NULL) says whether it did. gpupool's own: PyTorch never destroys its
/// streams (they come from its stream pool), and has no such call.
///
/// Why: gpupool keys a stream's cached blocks by its handle, as PyTorch does, and serves a
/// block freed on a stream to the next request on that handle without an event (the stream's
/// order makes that safe). CUDA gives a destroyed stream's handle to the next stream created,
/// at once, while the old stream's work may still run, and the new stream is not ordered after
/// it: without this call, a block freed on the old stream and still read by its kernels can be
/// handed to the new stream and overwritten (seen on two H200s; rapidsai/rmm#2251 is the same
/// defect in RMM). Telling the streams apart on each allocation would cost a driver call on the
/// hit path (`cuStreamGetId`: 25 ns on an H200, against about 60 ns for a whole cached
/// malloc and free), so the program says when a stream ends instead (rapidsai/rmm#649's
/// `invalidate_stream`). A stream gpupool never served costs nothing. Not needed for streams
/// that live as long as the program, nor when the program synchronizes the stream (or the
/// device) itself before destroying it.
///
/// Errors, each leaving every pool as it was: `GPUPOOL_ERROR_INVALID_VALUE` for a device out of
/// range and for CUDA's default streams (handles 0, 1 and 2: never destroyed);
/// `GPUPOOL_ERROR_STREAM_CAPTURE` while the stream captures a CUDA graph (a wait would
/// invalidate the capture: end it first); `GPUPOOL_ERROR_CUDA` when the driver cannot read the
/// capture status or wait (the stream's work may then still use what was freed on it: wait
/// for it another way before destroying the stream); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; holds no gpupool lock while it waits.
///
/// # Safety
/// `waited` must be NULL or point to writable storage for one `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_stream_retire(
    device: c_int,
    stream: gpupool_stream_t,
    waited: *mut c_int,
) -> gpupool_status {
    boundary("gpupool_stream_retire", || {
        let did = runtime()?.allocator.retire_stream(device, stream as usize)?;
        if !waited.is_null() {
            // SAFETY: the caller passes NULL or storage for one int.
            unsafe { waited.write(c_int::from(did)) };
        }
        Ok(())
    })
}

/// Returns every cached segment that is wholly free to the driver (`cuMemFree`), after waiting
/// for every pending event of freed blocks (PyTorch `torch.cuda.empty_cache`), and destroys the
/// CUDA events gpupool keeps for reuse by `gpupool_record_stream`. Segments that
/// still hold an allocated block stay. Blocks the caller and other threads may be using are
/// untouched.
///
/// - `device`: a device ordinal, or -1 for every device gpupool has used.
///
/// Also takes out of the device the state of every stream that holds nothing (no segment, no
/// pending event): a program that used many streams once gets that memory back, and a later
/// call on such a stream starts afresh. Empty size bins of the pools are dropped.
///
/// Private pools: their wholly free segments go back too, but those a CUDA graph captured into
/// stay until `gpupool_release_pool` (see `gpupool_begin_allocate_to_pool`).
///
/// Expandable segments: every wholly free page is unmapped, and the physical pages held
/// unmapped (`gpupool_stats_t.unmapped_held_bytes`) are released (`cuMemRelease`) with them.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (device out of range); `GPUPOOL_ERROR_CUDA` when
/// waiting or freeing fails (a held page the driver will not release stays held, and counted,
/// for the next call), a wait that fails for lack of memory included (what was released
/// before stays released); `GPUPOOL_ERROR_STREAM_CAPTURE`, nothing done on that device, while
/// a capture may be under way there (a route by stream or filter is active, or a stream gpupool
/// found capturing still captures): waiting and freeing would break it;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; blocks the calling thread while it waits for events.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_empty_cache(device: c_int) -> gpupool_status {
    boundary("gpupool_empty_cache", || empty_cache(device))
}

/// Writes the number of devices of the driver in use to `*count` (`cudaGetDeviceCount`;
/// with `GPUPOOL_DRIVER=sim`, `GPUPOOL_SIM_DEVICES`). Valid ordinals are 0 to `*count - 1`.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `count`); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
/// Thread-safe.
///
/// # Safety
/// `count` must be NULL or point to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_device_count(count: *mut c_int) -> gpupool_status {
    boundary("gpupool_device_count", || {
        let count = out_ptr(count, "count")?;
        let n = runtime()?.allocator.device_count();
        // SAFETY: the caller passes storage for one `int`.
        unsafe { count.write(n) };
        Ok(())
    })
}

/// Limits `device` to reserving at most `fraction` of its total memory (`cuMemGetInfo`), as
/// PyTorch's `torch.cuda.set_per_process_memory_fraction` does: a new segment that would take
/// the device's reserved bytes past `fraction * total` counts as out of memory, so gpupool
/// releases its cache and retries once, then fails with `GPUPOOL_ERROR_OUT_OF_MEMORY` (the
/// message names the limit). Segments already reserved stay; 1.0 allows the whole device.
/// With expandable segments the limit counts the physical pages held unmapped as well
/// (`gpupool_stats_t.unmapped_held_bytes`: device memory all the same), and a growth that maps
/// one of them adds nothing.
///
/// - `fraction`: from 0 to 1.
/// - `device`: a device ordinal, or -1 for the current device.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (`fraction` outside 0 to 1 or NaN, device out of
/// range; nothing changes); `GPUPOOL_ERROR_CUDA` (the total cannot be read);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; allocations already in flight on other threads may still pass the old limit.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_set_memory_fraction(fraction: f64, device: c_int) -> gpupool_status {
    boundary("gpupool_set_memory_fraction", || set_memory_fraction(fraction, device))
}

// The bodies of the exports above, shared with the PyTorch hooks (`torch.rs`), which report
// their errors under their own names.

// Inlined into the exports: a call between them cost 14 instructions each way (callgrind,
// `tests/c/hit_loop.c`).
#[inline(always)]
pub(super) fn malloc(size: usize, device: c_int, stream: gpupool_stream_t) -> Result<*mut c_void, Box<Error>> {
    Ok(started_runtime()?.allocator.malloc_in_parent(size, device, stream as usize)? as *mut c_void)
}

#[inline(always)]
pub(super) fn free(ptr: *mut c_void) -> Result<(), Box<Error>> {
    if ptr.is_null() {
        return Ok(());
    }
    started_runtime()?.allocator.free_in_parent(ptr as u64)
}

pub(super) fn record_stream(ptr: *mut c_void, stream: gpupool_stream_t) -> Result<(), Error> {
    if ptr.is_null() {
        return Ok(());
    }
    runtime()?.allocator.record_stream(ptr as u64, stream as usize)
}

pub(super) fn empty_cache(device: c_int) -> Result<(), Error> {
    runtime()?.allocator.empty_cache(device)
}

pub(super) fn set_memory_fraction(fraction: f64, device: c_int) -> Result<(), Error> {
    runtime()?.allocator.set_memory_fraction(fraction, device)
}
