//! The largest request a stream would be served now (`gpupool_largest_allocatable`).

use std::ffi::c_int;

use super::gpupool_stream_t;
use super::runtime;
use super::status::{boundary, gpupool_status, out_ptr};

/// --------------------------------------------------------------------------------------------
/// Expandable segments and the largest allocatable request
/// --------------------------------------------------------------------------------------------
///
/// By default (`expandable_segments:True`) each stream's blocks are carved from address ranges that
/// map physical pages as they grow, and unmap wholly free pages at `gpupool_empty_cache` and on out
/// of memory, so that memory freed by one shape can serve another: pages of 2 MiB, of 20 MiB and
/// more for requests of 20 MiB and more (`GPUPOOL_EXPANDABLE_LARGE_PAGES`,
/// `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST`, `GPUPOOL_EXPANDABLE_RECLAIM`; docs/fragmentation.md).
/// Their pages are mapped for their own device and the peers `gpupool_enable_peer_access`
/// enabled (PyTorch's rule). `gpupool_largest_allocatable` says how large a request would succeed
/// now, for sizing a KV cache or a workspace from what is left.
///
/// --------------------------------------------------------------------------------------------
///
/// Writes to `*bytes` the largest single request that `gpupool_malloc(ptr, size, device,
/// stream)` would serve now, in bytes: 0 when every request (but one of 0 bytes) would fail.
/// For sizing a KV cache or a workspace from what is left, as RMM users do with
/// `available_device_memory` (rapidsai/rmm#813). RMM answers with `cudaMemGetInfo` alone, which
/// counts neither the memory gpupool caches nor the memory fraction; PyTorch has no
/// equivalent (`torch.cuda.mem_get_info` is `cudaMemGetInfo` too).
///
/// - `device`: a device ordinal, or -1 for the calling thread's current device.
/// - `stream`: the stream the request would be made on: a cached block is reused only on the
///   stream it was allocated on, so the answer counts this stream's cached free blocks, and
///   other streams' only as what release-and-retry would give back to the driver.
/// - `bytes`: out-pointer, written only on success. Must not be NULL.
///
/// The answer replays `gpupool_malloc`'s rules on a copy of the stream's blocks: the best
/// cached fit under PyTorch's rounding and `max_split_size` rules; a new segment of
/// PyTorch's size for the request (`get_allocation_size`: 2 MiB up to 1 MiB, 20 MiB up to 10
/// MiB, then the request rounded up to 2 MiB), or the pages an expandable segment must map
/// (its free pages and unmapped address space used first); what the driver has free
/// (`cuMemGetInfo`), within the memory fraction (`gpupool_set_memory_fraction`) and the
/// default pools' limit (`gpupool_pool_set_limit` with pool 0); and the same again after
/// release-and-retry, which waits for pending `gpupool_record_stream` events and blocks freed
/// with `free_after_device_sync`, gives back every stream's wholly free cached segments and
/// unmaps every wholly free page (what the default pools give back no longer counts in their
/// limit). Not counted: what an out-of-memory observer would free
/// (`gpupool_attach_oom_observer`).
///
/// The answer is a multiple of 512 bytes (or a step of `roundup_power2_divisions`), never
/// more than the device's memory. Success is not monotone in the size: with ordinary segments
/// (`expandable_segments:False`), 15 MiB free on the driver and nothing cached, 14 MiB
/// succeeds (a 14 MiB segment) but 5 MiB fails (it needs a 20 MiB segment); with
/// `max_split_size`, a cached oversize block serves requests
/// near its size only. So the answer is an upper bound on what one request gets, not a
/// promise that every smaller request succeeds.
///
/// Changes nothing: no allocation, release, synchronisation, and no statistic counts it. The
/// device's streams are read one at a time, each under its own lock for as long as a copy of
/// its blocks (or the sum of what it would release) takes, never two at once, so the answer
/// can be stale as soon as it returns.
/// Too high when, meanwhile, another thread allocates or another process or context takes
/// device memory, or a block freed with `gpupool_record_stream` merges on its return into one
/// at least `max_split_size` large; too low when another thread frees or releases memory,
/// events complete after the call, or an out-of-memory observer would free memory. On a GPU
/// the driver may also refuse a `cuMemAlloc` of all its free memory (it keeps some for
/// itself). Answered for the device's default pools: a route to a private pool
/// (`gpupool_begin_allocate_to_pool`) is not followed. While `stream` captures a CUDA graph,
/// only its cached blocks count (a miss needs the driver); while a capture may be under way
/// on the device, release-and-retry does not count (it would break the capture). While the
/// default pools sleep (`gpupool_sleep` with pool 0, from its start to the end of the wake)
/// every unrouted malloc is refused, and the answer is 0; a sleeping private pool's free pages
/// count as nothing the release-and-retry could give back.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `bytes`, device out of range);
/// `GPUPOOL_ERROR_CUDA` when `cuMemGetInfo`, `cuStreamGetCaptureInfo` or `cuEventQuery`
/// fails; `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` (no driver, or in a forked child). `*bytes` is
/// then left as it was, and so is everything else.
///
/// Thread-safe; costs a driver call or two and a copy of the stream's blocks: not for the hit
/// path.
///
/// # Safety
/// `bytes` must be NULL or point to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_largest_allocatable(
    device: c_int,
    stream: gpupool_stream_t,
    bytes: *mut usize,
) -> gpupool_status {
    boundary("gpupool_largest_allocatable", || {
        let bytes = out_ptr(bytes, "bytes")?;
        let n = runtime()?.allocator.largest_allocatable(device, stream as usize)?;
        // SAFETY: the caller passes storage for one `size_t`.
        unsafe { bytes.write(n) };
        Ok(())
    })
}
