//! Pinned host memory: PyTorch's caching host allocator (`CachingHostAllocator`), for staging
//! host-to-device and device-to-host copies.

use std::ffi::c_void;

use super::stats::{gpupool_stat_t, stat};
use super::status::{boundary, boundary_boxed, gpupool_status, out_ptr};
use super::{gpupool_stream_t, process_host_allocator, started_host, started_host_hit};
use crate::error::Error;
use crate::host::{DurationStat, HostStats, StripeLock};

/// The layout version of `gpupool_host_stats_t` this library writes.
pub const GPUPOOL_HOST_STATS_VERSION: u32 = 1;

/// A duration statistic in microseconds (PyTorch `DurationStat`): `count` calls, their
/// `total`, the longest (`max`) and the shortest (`min`, 0 before the first call).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct gpupool_duration_stat_t {
    /// Calls timed.
    pub count: i64,
    /// Their durations summed, in microseconds.
    pub total: i64,
    /// The longest, in microseconds.
    pub max: i64,
    /// The shortest, in microseconds (0 before the first call).
    pub min: i64,
}

/// The statistics of pinned host memory: PyTorch 2.11's `HostStats`, the keys of
/// `torch.cuda.host_memory_stats()`.
///
/// Extensible as `gpupool_stats_t`: set `size` to `sizeof(gpupool_host_stats_t)` before the
/// call (`GPUPOOL_HOST_STATS_INIT` does); the library writes the first `min(size, its own
/// sizeof)` bytes and sets `size` to that count. Fields are only ever added at the end.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct gpupool_host_stats_t {
    /// In: `sizeof(gpupool_host_stats_t)` as the caller compiled it. Out: bytes written.
    pub size: u32,
    /// Out: `GPUPOOL_HOST_STATS_VERSION` of the library.
    pub version: u32,
    /// Blocks handed out by `gpupool_host_malloc`, or freed and not yet seen free: their
    /// events (`gpupool_host_record_event`) not yet polled complete, or (under the LD_PRELOAD
    /// shim) waiting for a device synchronisation (PyTorch `active_requests`). Its peak, and that of
    /// `active_bytes`, is exact while one thread allocates; with several, an upper bound
    /// (gpupool keeps these counts per thread group and sums the peaks, as PyTorch sums its
    /// per-size peaks).
    pub active_requests: gpupool_stat_t,
    /// Bytes of those blocks, each its size class's (the request rounded up, see
    /// `gpupool_host_malloc`; PyTorch `active_bytes`).
    pub active_bytes: gpupool_stat_t,
    /// Blocks gpupool holds pinned, in use or cached (PyTorch `allocations`).
    pub allocations: gpupool_stat_t,
    /// Bytes of those blocks (PyTorch `allocated_bytes`).
    pub allocated_bytes: gpupool_stat_t,
    /// Each `cuMemHostAlloc` (or page touching and `cuMemHostRegister`), in microseconds
    /// (PyTorch `host_alloc_time`).
    pub host_alloc_time: gpupool_duration_stat_t,
    /// Each `cuMemFreeHost` (or `cuMemHostUnregister` and `free`), in microseconds (PyTorch
    /// `host_free_time`).
    pub host_free_time: gpupool_duration_stat_t,
    /// Calls that pinned new memory because no cached block fitted (PyTorch `num_host_alloc`).
    pub num_host_alloc: i64,
    /// Calls that gave pinned memory back (PyTorch `num_host_free`).
    pub num_host_free: i64,
}

fn duration(d: &DurationStat) -> gpupool_duration_stat_t {
    let DurationStat { count, total, max, min } = *d;
    gpupool_duration_stat_t { count, total, max, min }
}

impl From<&HostStats> for gpupool_host_stats_t {
    fn from(s: &HostStats) -> Self {
        // Every field of both sides named: a field added to one alone fails to compile here.
        let HostStats {
            active_requests,
            active_bytes,
            allocations,
            allocated_bytes,
            host_alloc_time,
            host_free_time,
            num_host_alloc,
            num_host_free,
        } = *s;
        gpupool_host_stats_t {
            size: size_of::<gpupool_host_stats_t>() as u32,
            version: GPUPOOL_HOST_STATS_VERSION,
            active_requests: stat(&active_requests),
            active_bytes: stat(&active_bytes),
            allocations: stat(&allocations),
            allocated_bytes: stat(&allocated_bytes),
            host_alloc_time: duration(&host_alloc_time),
            host_free_time: duration(&host_free_time),
            num_host_alloc,
            num_host_free,
        }
    }
}

/// --------------------------------------------------------------------------------------------
/// Pinned host memory
/// --------------------------------------------------------------------------------------------
///
/// PyTorch's caching host allocator (`CachingHostAllocator`, what `pin_memory()` uses): page-locked
/// host memory for asynchronous copies between host and device, cached by size class; a freed block
/// is reused once the events recorded for it (`gpupool_host_record_event`) have completed.
/// `GPUPOOL_CONF`'s `pinned_*` keys configure it; `gpupool_host_stats` is
/// `torch.cuda.host_memory_stats()`.
///
/// --------------------------------------------------------------------------------------------
///
/// Allocates at least `size` bytes of pinned (page-locked) host memory from gpupool's cache
/// (PyTorch `CachingHostAllocator`'s `allocate`, what `pin_memory()` uses): copies between it
/// and the device are asynchronous DMA. Use it to stage inputs and outputs.
///
/// - `ptr`: out-pointer, written only on success. Must not be NULL.
/// - `size`: bytes, rounded up to its size class: up to 1 MiB a power of two (PyTorch's
///   rule); above, a multiple of a 32nd of the power of two below it, so that a block holds
///   less than 1/32 more than asked for (PyTorch pins up to twice: 20.4 GiB pins 32 GiB, here
///   20.5 GiB). Each class has its own cache and a block is never split; when its class has no
///   free block, a cached block of a larger class at most 5% over `size` is taken before new
///   memory is pinned. 0 gives `*ptr = NULL` and success, as PyTorch.
///
/// A cached block of the class is taken if one is free (its events, if any, completed);
/// otherwise new memory is pinned with `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)`, or with
/// `malloc` and `cuMemHostRegister` under `GPUPOOL_CONF=pinned_use_cuda_host_register:True`,
/// which takes milliseconds. The memory is portable: usable with every device and context.
/// It is not initialised. The caller owns the block until `gpupool_host_free`.
///
/// A cache hit takes one lock that only the calling thread's group uses and makes no driver
/// call, unless freed blocks' events are pending (then it polls them, never blocking).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `ptr`; `size` over 2^63 bytes);
/// `GPUPOOL_ERROR_OUT_OF_MEMORY` (the host cannot pin more; gpupool does not release its cache
/// and retry, as PyTorch does not: call `gpupool_host_empty_cache`); `GPUPOOL_ERROR_CUDA`;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` must be NULL or point to writable storage for one `void *`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_host_malloc(ptr: *mut *mut c_void, size: usize) -> gpupool_status {
    let Some(host) = started_host_hit() else {
        // SAFETY: the caller's promise, passed on.
        return unsafe { host_malloc(ptr, size, None) };
    };
    if ptr.is_null() {
        // SAFETY: as above.
        return unsafe { host_malloc(ptr, size, None) };
    }
    // SAFETY: the caller passes storage for one `void *`.
    match host.malloc_hit(size, |p| unsafe { ptr.write(p as *mut c_void) }) {
        Ok(_stripe) => gpupool_status::GPUPOOL_SUCCESS,
        // SAFETY: as above.
        Err(stripe) => unsafe { host_malloc(ptr, size, stripe) },
    }
}

/// [`gpupool_host_malloc`] past its hit path (`host::hit`), which hands over its stripe's lock
/// if it took it: released first. Out of line, so that the hit path has no stack frame, and
/// `extern "C"` (it never unwinds: `boundary_boxed` catches), so that the call is a jump: a
/// call that may unwind out of an export is wrapped in an abort, and then the caller has a
/// frame.
#[inline(never)]
#[allow(improper_ctypes_definitions)] // Called only from Rust, as a tail call.
unsafe extern "C" fn host_malloc(ptr: *mut *mut c_void, size: usize, stripe: Option<StripeLock<'_>>) -> gpupool_status {
    drop(stripe);
    boundary_boxed("gpupool_host_malloc", || {
        let ptr = out_ptr(ptr, "ptr")?;
        let p = started_host()?.malloc_in_parent(size)?;
        // SAFETY: the caller passes storage for one `void *`.
        unsafe { ptr.write(p as *mut c_void) };
        Ok(())
    })
}

/// Gives a block from `gpupool_host_malloc` back to gpupool's cache (PyTorch
/// `CachingHostAllocator`'s `free`). Without `gpupool_host_record_event` it is reused by the
/// next allocation of its size at once; otherwise gpupool records an event on each stream
/// named and reuses the block only once all have completed (polled at later allocations,
/// never waited for). Never blocks; the memory stays pinned until `gpupool_host_empty_cache`.
///
/// - `ptr`: as returned by `gpupool_host_malloc`. NULL is a no-op.
///
/// Copies queued on a stream that was not named by `gpupool_host_record_event` are not waited
/// for: name every stream that reads or writes the block before freeing it.
///
/// If an event cannot be created or recorded, gpupool synchronises that stream's device
/// instead (PyTorch's free fails there); if even that fails, the free still succeeds and the
/// block waits for `gpupool_host_empty_cache`, which synchronises that device first.
///
/// Errors: `GPUPOOL_ERROR_INVALID_POINTER` for a pointer gpupool did not pin, a pointer inside
/// a block, or a block already freed; nothing changes. `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe: a block may be freed by another thread than the one that allocated it.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_host_free(ptr: *mut c_void) -> gpupool_status {
    let Some(host) = started_host_hit() else {
        return host_free(ptr, None);
    };
    match host.free_hit(ptr as usize) {
        Ok(_stripe) => gpupool_status::GPUPOOL_SUCCESS,
        Err(stripe) => host_free(ptr, stripe),
    }
}

/// [`gpupool_host_free`] past its hit path, as [`host_malloc`].
#[inline(never)]
#[allow(improper_ctypes_definitions)] // Called only from Rust, as a tail call.
extern "C" fn host_free(ptr: *mut c_void, stripe: Option<StripeLock<'_>>) -> gpupool_status {
    drop(stripe);
    boundary_boxed("gpupool_host_free", || started_host()?.free_in_parent(ptr as usize))
}

/// Says that the pinned block at `ptr` is used by work queued on `stream` (a copy from or to
/// it), so that after `gpupool_host_free` it is not reused until that work, as queued at the
/// time of the free, has completed (PyTorch `CachingHostAllocator_recordEvent`, which
/// `Tensor.copy_(non_blocking=True)` calls). Naming a stream twice counts once.
///
/// - `ptr`: as returned by `gpupool_host_malloc` and not yet freed. NULL is a no-op.
/// - `stream`: any stream (`cudaStream_t`/`CUstream`; NULL is the legacy default stream).
///   Its device is found now, from the stream's context (`cuStreamGetCtx`); NULL,
///   `cudaStreamLegacy` and `cudaStreamPerThread` belong to the calling thread's current
///   device, as the runtime resolves them. The event is created in that device's primary
///   context: a stream of a context the program created itself (`cuCtxCreate`) makes the free
///   fall back to a device synchronisation.
///
/// Errors: `GPUPOOL_ERROR_INVALID_POINTER` when `ptr` is not the start of an allocated block;
/// `GPUPOOL_ERROR_CUDA` when the stream's context cannot be found (a destroyed stream);
/// nothing changes. `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; calling it for a block while another thread frees that block is the caller's
/// error (PyTorch asserts): the event may then be missed.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_host_record_event(
    ptr: *mut c_void,
    stream: gpupool_stream_t,
) -> gpupool_status {
    boundary("gpupool_host_record_event", || process_host_allocator()?.record_event(ptr as usize, stream as usize))
}

/// Releases every cached free pinned block (`cuMemFreeHost`, or `cuMemHostUnregister` and
/// `free`), after polling the events of freed blocks (PyTorch
/// `torch._C._host_emptyCache`), and destroys the events kept for reuse. Blocks in use, or
/// whose events have not completed, stay; so do the blocks of
/// `pinned_reserve_segment_size_mb`'s segment, which is never released.
///
/// Errors: `GPUPOOL_ERROR_CUDA` when a release or an event query fails (what was released
/// before stays released; a block that could not be released stays cached);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; may block while it synchronises a device for blocks that wait for one.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_host_empty_cache() -> gpupool_status {
    boundary("gpupool_host_empty_cache", || process_host_allocator()?.empty_cache())
}

const HEADER: usize = 8;

/// Reads the pinned host memory statistics into `*out` (PyTorch
/// `torch.cuda.host_memory_stats()`).
///
/// - `out`: caller-owned; set `out->size = sizeof(gpupool_host_stats_t)` first
///   (`gpupool_host_stats_t s = GPUPOOL_HOST_STATS_INIT;`). Written only on success, and only
///   its first `out->size` bytes.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `out`, `out->size` under 8);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe; the figures are of one moment: it holds every lock of the host allocator at
/// once, briefly (pinned allocations on other threads wait for the copy).
///
/// # Safety
/// `out` must be NULL or point to writable storage of at least `out->size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_host_stats(out: *mut gpupool_host_stats_t) -> gpupool_status {
    boundary("gpupool_host_stats", || {
        let out = out_ptr(out, "out")?.as_ptr();
        // SAFETY: `out` is non-NULL and points to at least the 4-byte `size` field.
        let caller_size = unsafe { std::ptr::addr_of!((*out).size).read_unaligned() } as usize;
        if caller_size < HEADER {
            return Err(Error::InvalidValue(format!(
                "out->size is {caller_size}; set it to sizeof(gpupool_host_stats_t) first"
            )));
        }
        let mut full = gpupool_host_stats_t::from(&process_host_allocator()?.stats());
        let n = caller_size.min(size_of::<gpupool_host_stats_t>());
        full.size = n as u32;
        // SAFETY: the caller's struct is at least `caller_size >= n` bytes, per the contract.
        unsafe { std::ptr::copy_nonoverlapping((&raw const full).cast::<u8>(), out.cast::<u8>(), n) };
        Ok(())
    })
}

/// Sets the peaks of the pinned host memory statistics to their current values, and clears
/// the longest and shortest durations (PyTorch `torch.cuda.reset_peak_host_memory_stats()`).
///
/// Errors: `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_host_reset_peak_stats() -> gpupool_status {
    boundary("gpupool_host_reset_peak_stats", || {
        process_host_allocator()?.reset_peak_stats();
        Ok(())
    })
}
