//! Private pools whose segments come from the program's allocator (the C equivalent of
//! `torch.cuda.MemPool(allocator)`: PyTorch takes a pool's segments from `ncclMemAlloc` so that
//! NVLink SHARP can use them).

use std::ffi::{c_int, c_void};

use super::status::{boundary, gpupool_status, out_ptr};
use super::{gpupool_stream_t, runtime};
use crate::error::Error;

/// Allocates a segment of `bytes` bytes on `device` for `stream` and writes its address to
/// `*ptr`; returns 0 on success, anything else for out of memory. `user` is the pointer given
/// to `gpupool_pool_create_with_allocator`.
#[allow(non_camel_case_types)]
pub type gpupool_segment_alloc_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        bytes: usize,
        device: c_int,
        stream: gpupool_stream_t,
        ptr: *mut *mut c_void,
    ) -> c_int,
>;

/// Frees a segment that the matching `gpupool_segment_alloc_fn` gave: its address, its bytes,
/// and the device and stream it was allocated for.
#[allow(non_camel_case_types)]
pub type gpupool_segment_free_fn = Option<
    unsafe extern "C" fn(user: *mut c_void, ptr: *mut c_void, bytes: usize, device: c_int, stream: gpupool_stream_t),
>;

/// The program's functions as gpupool calls them: "C-unwind", since they may end the thread
/// (see `crate::callout`); the public types stay "C", as in `oom`.
type AllocPtr = unsafe extern "C-unwind" fn(*mut c_void, usize, c_int, gpupool_stream_t, *mut *mut c_void) -> c_int;
type FreePtr = unsafe extern "C-unwind" fn(*mut c_void, *mut c_void, usize, c_int, gpupool_stream_t);
type AllocC = unsafe extern "C" fn(*mut c_void, usize, c_int, gpupool_stream_t, *mut *mut c_void) -> c_int;
type FreeC = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, gpupool_stream_t);

/// The program's functions and `user`.
struct CSource {
    alloc: AllocPtr,
    free: FreePtr,
    user: *mut c_void,
}

// SAFETY: gpupool never dereferences `user`; it passes it back to the functions, from whichever
// thread makes or gives back a segment of the pool, as the caller of
// gpupool_pool_create_with_allocator promises is safe.
unsafe impl Send for CSource {}
// SAFETY: as for `Send`.
unsafe impl Sync for CSource {}

/// Creates a private pool whose segments come from `alloc` and go back through `free` instead
/// of `cuMemAlloc` and `cuMemFree`, and writes its id to `*pool` (the C equivalent of
/// `torch.cuda.MemPool(allocator)`; with `ncclMemAlloc`/`ncclMemFree`, the pool's buffers can
/// be registered for NVLink SHARP). Everything else is a private pool's
/// (`gpupool_pool_create`): allocations reach it through the routes
/// (`gpupool_begin_allocate_to_pool` and its variants), are cached, split and reused as any,
/// count in the statistics (reserved bytes and the memory fraction included), and
/// `gpupool_release_pool` gives its segments back through `free`.
///
/// - `alloc(user, bytes, device, stream, &ptr)` is called for each new segment (2 MiB, 20 MiB
///   or a large request rounded to 2 MiB, as PyTorch sizes segments); nonzero means out of
///   memory: the cache of that stream's pool is released and the allocation retried, then the
///   out-of-memory observers run and `GPUPOOL_ERROR_OUT_OF_MEMORY` returns.
/// - `free(user, ptr, bytes, device, stream)` is called once for each segment `alloc` gave, when
///   gpupool gives it back (`gpupool_empty_cache`, `gpupool_release_pool`).
/// - Both run on the calling thread with the stream's pool locked: they must not call gpupool
///   (they may call CUDA and NCCL), and must return. Segment observers see these segments too.
/// - `user`: passed back as it is; it must stay usable for as long as the pool holds memory.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `pool`, `alloc` or `free`);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Nothing changes on error.
///
/// Thread-safe.
///
/// # Safety
/// `pool` must be NULL or point to writable storage for one `uint64_t`; `alloc` and `free` must
/// be NULL or functions of those signatures, safe to call with `user` from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_create_with_allocator(
    pool: *mut u64,
    alloc: gpupool_segment_alloc_fn,
    free: gpupool_segment_free_fn,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_pool_create_with_allocator", || create(pool, alloc, free, user, 0))
}

/// `gpupool_pool_create_with_allocator` whose blocks are never split below `split_alignment`
/// bytes: every request routed to the pool is rounded up to a multiple of it, and so is every
/// segment asked of `alloc`, so that each block starts at a multiple of it from the start of
/// its segment. For NVLink SHARP, pass the multicast granularity
/// (`cuMulticastGetGranularity`) and an `alloc` over `ncclMemAlloc`, whose segments start at
/// such a multiple. 0 behaves as `gpupool_pool_create_with_allocator`. gpupool's own:
/// `torch.cuda.MemPool(allocator)` takes no alignment. The bytes a request is rounded up by
/// count as allocated (as PyTorch counts its own rounding), not as requested.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `pool`, `alloc` or `free`; an alignment that is
/// not a multiple of 512 bytes, or is over 1 TiB; a request that overflows when rounded, at
/// malloc); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Nothing changes on error.
///
/// Thread-safe.
///
/// # Safety
/// As for `gpupool_pool_create_with_allocator`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_create_with_allocator_aligned(
    pool: *mut u64,
    alloc: gpupool_segment_alloc_fn,
    free: gpupool_segment_free_fn,
    user: *mut c_void,
    split_alignment: usize,
) -> gpupool_status {
    boundary("gpupool_pool_create_with_allocator_aligned", || create(pool, alloc, free, user, split_alignment))
}

/// The body of both exports.
fn create(
    pool: *mut u64,
    alloc: gpupool_segment_alloc_fn,
    free: gpupool_segment_free_fn,
    user: *mut c_void,
    split_alignment: usize,
) -> Result<(), Error> {
    let out = out_ptr(pool, "pool")?;
    let alloc = alloc.ok_or_else(|| Error::InvalidValue("alloc is NULL".into()))?;
    let free = free.ok_or_else(|| Error::InvalidValue("free is NULL".into()))?;
    let allocator = &runtime()?.allocator;
    // SAFETY: one calling convention; "C-unwind" only lets the thread's end leave them (they
    // are called as callouts, `crate::callout`).
    let (alloc, free) =
        unsafe { (std::mem::transmute::<AllocC, AllocPtr>(alloc), std::mem::transmute::<FreeC, FreePtr>(free)) };
    let source = std::sync::Arc::new(CSource { alloc, free, user });
    let s = source.clone();
    let id = allocator.pool_create_with_allocator_aligned(
        move |bytes, device, stream| {
            let mut ptr: *mut c_void = std::ptr::null_mut();
            // A callout: the function may end the thread (see `crate::callout`), and one that
            // ended in it gave no segment.
            // SAFETY: the caller gave a function of this signature, callable with `user`
            // from any thread; `ptr` is storage for one pointer.
            let status = crate::callout::callout(|| unsafe {
                (s.alloc)(s.user, bytes, device, stream as gpupool_stream_t, &mut ptr)
            });
            (status == Some(0) && !ptr.is_null()).then_some(ptr as u64)
        },
        move |addr, bytes, device, stream| {
            // SAFETY: as for `alloc`; `addr` is a segment `alloc` gave. A callout, as `alloc`.
            crate::callout::callout(|| unsafe {
                (source.free)(source.user, addr as *mut c_void, bytes, device, stream as gpupool_stream_t)
            });
        },
        split_alignment,
    )?;
    // SAFETY: the caller passes storage for one uint64_t.
    unsafe { out.write(id) };
    Ok(())
}
