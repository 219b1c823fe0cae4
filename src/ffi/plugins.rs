//! The allocator plug-ins of other frameworks whose signatures are not gpupool's: CuPy's
//! `cupy.cuda.memory.CFunctionAllocator` and ONNX Runtime's CUDA execution provider external
//! allocator (`gpu_external_alloc`, `gpu_external_free`, `gpu_external_empty_cache`). Each
//! forwards to `gpupool_malloc`, `gpupool_free` or `gpupool_empty_cache` on the process-wide
//! allocator, so that their blocks share one cache, one set of statistics and one snapshot
//! with everything else in the process. `include/gpupool_plugins.h` is generated from this
//! file alone (cbindgen-plugins.toml).
//!
//! Their signatures have no room for a status: a failure returns NULL (or nothing), writes
//! `gpupool: <status>: <function>: <why>` to stderr, as PyTorch's hooks do (`torch.rs`), and
//! leaves the message for `gpupool_last_error_message` on the calling thread.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use super::gpupool_stream_t;
use super::memory::{empty_cache, free, malloc};
use super::status::{boundary, boundary_boxed, boundary_hot, gpupool_status};
use super::torch::report;

/// CuPy's `CFunctionAllocator` malloc, `void *malloc(void *param, size_t size, int
/// device_id)`: `size` bytes on device `device_id` for the stream `param` (a `cudaStream_t`
/// passed as CuPy's `param`; 0 is the legacy default stream); exactly `gpupool_malloc(&ptr,
/// size, device_id, param)`.
///
/// CuPy calls it with its current device and never with `size` 0. The allocator has no stream
/// argument, so the stream is fixed when the allocator is made: `gpupool.cupy.install(stream=s)`
/// passes `s.ptr`. CuPy's own memory pool follows CuPy's current stream instead, which only
/// Python can read: `gpupool.cupy.install()` without a stream does that through CuPy's
/// `PythonFunctionAllocator` and `gpupool_malloc`.
///
/// Returns NULL on failure (out of memory, a bad device), after writing gpupool's message to
/// stderr. CuPy 14's `CFunctionAllocator` does not check for NULL: the array's first use then
/// faults where CuPy's own pool raises `cupy.cuda.memory.OutOfMemoryError`.
///
/// Thread-safe.
///
/// # Safety
/// `param` is passed on as a stream handle, never dereferenced by gpupool; it must be a stream
/// of `device_id` (or NULL) for the memory to be used safely, as for `gpupool_malloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_cupy_malloc(param: *mut c_void, size: usize, device_id: c_int) -> *mut c_void {
    let mut ptr = std::ptr::null_mut();
    report(boundary_hot("gpupool_cupy_malloc", || {
        ptr = malloc(size, device_id, param as gpupool_stream_t)?;
        Ok(())
    }));
    ptr
}

/// CuPy's `CFunctionAllocator` free, `void free(void *param, void *ptr, int device_id)`:
/// exactly `gpupool_free(ptr)` (gpupool knows the block's device and stream; `param` and
/// `device_id` are ignored). The block is reused at once by later requests on its stream, as
/// CuPy's own pool reuses a chunk on the stream it was allocated on. A pointer gpupool did not
/// hand out is refused: the failure is written to stderr and nothing changes.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_cupy_free(param: *mut c_void, ptr: *mut c_void, device_id: c_int) {
    let _ = (param, device_id);
    report(boundary_boxed("gpupool_cupy_free", || free(ptr)));
}

/// The stream that [`gpupool_ort_alloc`] files its blocks under; NULL, the legacy default
/// stream, until [`gpupool_ort_set_stream`].
static ORT_STREAM: AtomicPtr<super::CUstream_st> = AtomicPtr::new(std::ptr::null_mut());

/// Sets the stream that `gpupool_ort_alloc` allocates for from now on: ONNX Runtime's compute
/// stream (the CUDA execution provider's `user_compute_stream`, or `has_user_compute_stream`
/// with the stream the program gave it). NULL (the default) is the legacy default stream.
///
/// ONNX Runtime's external allocator has no stream argument, and its CUDA execution provider
/// queues a session's kernels on one stream: a block freed by ONNX Runtime is reused by its
/// next allocation on the same stream without a wait, as ONNX Runtime's own BFC arena reuses
/// its chunks. Blocks already handed out keep the stream they were allocated for. A program
/// whose sessions run on different streams at once should not share one external allocator
/// between them through this function (it is process-wide).
///
/// Errors: none; it returns `GPUPOOL_SUCCESS`. Thread-safe (an atomic store).
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_ort_set_stream(stream: gpupool_stream_t) -> gpupool_status {
    ORT_STREAM.store(stream, Ordering::Relaxed);
    gpupool_status::GPUPOOL_SUCCESS
}

/// ONNX Runtime's `gpu_external_alloc`, `void *alloc(size_t size)`: `size` bytes on the
/// calling thread's current device (ONNX Runtime's CUDA execution provider sets its device
/// on the threads that run it) for the stream of `gpupool_ort_set_stream` (the legacy default
/// stream unless set); `gpupool_malloc(&ptr, size, -1, stream)`.
///
/// Returns NULL for `size` 0 (ONNX Runtime does not call it then), and NULL on failure after
/// writing gpupool's message to stderr; ONNX Runtime then fails the allocation
/// (`ORT_ENFORCE(p != nullptr)`), so the session's `Run` returns an error.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_ort_alloc(size: usize) -> *mut c_void {
    let mut ptr = std::ptr::null_mut();
    report(boundary_hot("gpupool_ort_alloc", || {
        ptr = malloc(size, -1, ORT_STREAM.load(Ordering::Relaxed))?;
        Ok(())
    }));
    ptr
}

/// ONNX Runtime's `gpu_external_free`, `void free(void *ptr)`: exactly `gpupool_free(ptr)`.
/// NULL does nothing. A pointer gpupool did not hand out is refused: the failure is written to
/// stderr and nothing changes.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_ort_free(ptr: *mut c_void) {
    report(boundary_boxed("gpupool_ort_free", || free(ptr)));
}

/// ONNX Runtime's `gpu_external_empty_cache`, `void empty_cache(void)`, which ONNX Runtime
/// calls after freeing a block it reserved (`Reserve`, for initializers):
/// `gpupool_empty_cache(-1)`, the cached free segments of every device back to the driver,
/// after waiting for their pending events. Memory in use is untouched.
///
/// Thread-safe. A failure is written to stderr.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_ort_empty_cache() {
    report(boundary("gpupool_ort_empty_cache", || empty_cache(-1)));
}
