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
//! leaves the message for `gpupool_last_error_message` on the calling thread. The exception:
//! CuPy's compiled hook (`gpupool_cupy_hook_malloc`), which runs under CuPy with the GIL held
//! and raises a Python exception through CuPy's own error check instead.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use super::gpupool_stream_t;
use super::memory::{empty_cache, free, malloc};
use super::status::{boundary, boundary_boxed, boundary_hot, gpupool_last_error_message, gpupool_status};
use super::torch::report;
use crate::error::Error;

/// CuPy's `CFunctionAllocator` malloc, `void *malloc(void *param, size_t size, int
/// device_id)`: `size` bytes on device `device_id` for the stream `param` (a `cudaStream_t`
/// passed as CuPy's `param`; 0 is the legacy default stream); exactly `gpupool_malloc(&ptr,
/// size, device_id, param)`.
///
/// CuPy calls it with its current device and never with `size` 0. The allocator has no stream
/// argument, so the stream is fixed when the allocator is made, for C code that runs CuPy on
/// one stream. CuPy's own memory pool follows CuPy's current stream instead:
/// [`gpupool_cupy_hook_malloc`] does that (`gpupool.cupy.install()`, and `install(stream=s)`
/// with the stream in its `gpupool_cupy_hook_t`).
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

/// What [`gpupool_cupy_hook_malloc`] is given as CuPy's `param`: where each block's stream
/// comes from, and how a failure is raised in Python. `gpupool.cupy.install()` fills one in
/// (docs/cupy.md); C code that drives CuPy's `CFunctionAllocator` itself may too.
///
/// Ownership: the caller's; it must outlive every call of [`gpupool_cupy_hook_malloc`] made
/// with it (CuPy's `CFunctionAllocator(param, malloc, free, owner)` keeps `owner` alive as long
/// as the allocator). [`gpupool_cupy_hook_free`] never reads it: CuPy keeps only `param`'s
/// address in each block, and blocks outlive their allocator (at interpreter exit above all).
#[repr(C)]
pub struct gpupool_cupy_hook_t {
    /// CuPy's current stream of the calling thread on CuPy's current device, the C function
    /// `intptr_t get_current_stream_ptr(void)` that `cupy_backends.cuda.stream` (and
    /// `cupy.cuda.stream`) export through their `__pyx_capi__` capsules, signature
    /// `"intptr_t (void)"`; the function CuPy's own `MemoryPool` reads the stream with. It is
    /// called with the GIL held (CuPy holds it while it allocates) and runs no Python frame: a
    /// lookup in a `threading.local`. When it fails it sets a Python exception (CuPy's
    /// `except? -1`; with `err_occurred` set, the hook checks after every call). NULL: every
    /// block is for `stream`.
    pub current_stream: Option<unsafe extern "C-unwind" fn() -> isize>,
    /// The stream of every block when `current_stream` is NULL (a `cudaStream_t`; NULL is the
    /// legacy default stream).
    pub stream: gpupool_stream_t,
    /// CPython's `PyErr_Occurred` (the calling thread's pending exception, NULL for none), to
    /// see that `current_stream` failed. NULL: `current_stream` is taken never to fail.
    pub err_occurred: Option<unsafe extern "C-unwind" fn() -> *mut c_void>,
    /// CPython's `PyErr_SetString(type, message)`, with which a failure is raised as
    /// `out_of_memory` or `error`. NULL: a failure returns NULL after writing gpupool's message
    /// to stderr, as [`gpupool_cupy_malloc`] does.
    pub err_set_string: Option<unsafe extern "C-unwind" fn(*mut c_void, *const c_char)>,
    /// The exception type (a `PyObject *`, borrowed: the caller keeps it alive) raised when
    /// gpupool is out of memory after its release-and-retry; called with one argument, the
    /// message `"gpupool_cupy_hook_malloc failed (gpupool status 2): <PyTorch's text>"`.
    pub out_of_memory: *mut c_void,
    /// The exception type raised on any other failure (a bad device, a CUDA error, a capture),
    /// called with the message `"gpupool_cupy_hook_malloc failed (gpupool status <n>): <why>"`.
    pub error: *mut c_void,
}

/// What [`gpupool_cupy_hook_malloc`] returns, as a pointer (`(void *)(intptr_t)-1`), when it
/// raised a Python exception: the value on which CuPy's `_call_malloc` (`cdef intptr_t ...
/// except? -1`, CuPy 13 and 14) looks for a pending exception.
pub const GPUPOOL_CUPY_HOOK_RAISED: isize = -1;

/// CuPy's `CFunctionAllocator` malloc with CuPy's current stream read in C, `void
/// *malloc(void *param, size_t size, int device_id)`: `size` bytes on device `device_id` for
/// the stream `param->current_stream()` returns (or `param->stream`), exactly
/// `gpupool_malloc(&ptr, size, device_id, stream)`; `param` is a [`gpupool_cupy_hook_t`].
/// This is `gpupool.cupy.install()`'s route: as CuPy's own `MemoryPool`, a block freed by work
/// on one stream is reused by later requests on that stream only, with no Python frame on the
/// way (CuPy's Cython calls it, it calls CuPy's Cython getter of the stream, then gpupool).
///
/// Failures: when `current_stream` raised, the hook returns [`GPUPOOL_CUPY_HOOK_RAISED`] with
/// CuPy's exception pending. When gpupool fails (out of memory after release-and-retry, a bad
/// device, a CUDA error), it raises `out_of_memory` or `error` with gpupool's message through
/// `err_set_string` and returns [`GPUPOOL_CUPY_HOOK_RAISED`]: CuPy 13 and 14 then raise that
/// exception from the allocation, as their own pool raises `OutOfMemoryError`; a CuPy whose
/// `_call_malloc` does not check raises `SystemError` from it instead ("returned a result with
/// an exception set"), and gives the value back to [`gpupool_cupy_hook_free`], which ignores
/// it. Without `err_set_string` (or with a NULL type) a failure writes gpupool's message to
/// stderr and returns NULL. `param` NULL is such a failure. `size` 0 returns NULL (CuPy never
/// asks for it).
///
/// Thread-safe. With any of `current_stream`, `err_occurred`, `err_set_string` set, it must be
/// called with the GIL held, as CuPy does.
///
/// # Safety
/// `param` is NULL or points to a [`gpupool_cupy_hook_t`] whose functions are what its fields
/// say; the stream it yields must be a stream of `device_id` (or NULL), as for
/// `gpupool_malloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_cupy_hook_malloc(
    param: *mut c_void,
    size: usize,
    device_id: c_int,
) -> *mut c_void {
    // SAFETY: `param` is NULL or a live gpupool_cupy_hook_t, by the caller's contract.
    let Some(hook) = (unsafe { param.cast::<gpupool_cupy_hook_t>().as_ref() }) else {
        return hook_failed(
            None,
            boundary("gpupool_cupy_hook_malloc", || {
                Err(Error::InvalidValue("param is NULL: a gpupool_cupy_hook_t is needed".into()))
            }),
        );
    };
    let stream = match hook.current_stream {
        Some(read) => {
            // SAFETY: CuPy's getter, called with the GIL held (the caller's contract); no Rust
            // value with a destructor is alive across it, so a forced unwind may pass.
            let stream = unsafe { read() };
            // SAFETY: CPython's PyErr_Occurred, with the GIL held.
            if hook.err_occurred.is_some_and(|occurred| !unsafe { occurred() }.is_null()) {
                return std::ptr::without_provenance_mut(GPUPOOL_CUPY_HOOK_RAISED as usize);
            }
            stream as gpupool_stream_t
        }
        None => hook.stream,
    };
    let mut ptr = std::ptr::null_mut();
    let status = boundary_hot("gpupool_cupy_hook_malloc", || {
        ptr = malloc(size, device_id, stream)?;
        Ok(())
    });
    if status == gpupool_status::GPUPOOL_SUCCESS { ptr } else { hook_failed(Some(hook), status) }
}

/// The end of a [`gpupool_cupy_hook_malloc`] that failed with `status` (its message this
/// thread's last): the hook's exception raised, or the message on stderr.
#[cold]
#[inline(never)]
fn hook_failed(hook: Option<&gpupool_cupy_hook_t>, status: gpupool_status) -> *mut c_void {
    let kind = match hook {
        Some(h) if status == gpupool_status::GPUPOOL_ERROR_OUT_OF_MEMORY => h.out_of_memory,
        Some(h) => h.error,
        None => std::ptr::null_mut(),
    };
    let Some(set) = hook.and_then(|h| h.err_set_string).filter(|_| !kind.is_null()) else {
        report(status);
        return std::ptr::null_mut();
    };
    // SAFETY: a NUL-terminated string that lives until the next failing call on this thread.
    let message = unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy();
    let call = "gpupool_cupy_hook_malloc";
    let why = message.strip_prefix(call).and_then(|m| m.strip_prefix(": ")).unwrap_or(&message);
    // The message as the package's gpupool.Error words it; it holds no NUL (set_last_error
    // replaced them).
    let text = format!("{call} failed (gpupool status {}): {why}", status as u32);
    let text = CString::new(text).unwrap_or_default();
    // SAFETY: CPython's PyErr_SetString with a live exception type, the GIL held (the hook's
    // contract); it copies the text.
    unsafe { set(kind, text.as_ptr()) };
    std::ptr::without_provenance_mut(GPUPOOL_CUPY_HOOK_RAISED as usize)
}

/// CuPy's `CFunctionAllocator` free for [`gpupool_cupy_hook_malloc`]'s blocks, `void free(void
/// *param, void *ptr, int device_id)`: exactly `gpupool_free(ptr)`, the block back in the
/// cache of the stream it was allocated for (as CuPy's `MemoryPool`, which records no other
/// stream either; `gpupool.record_stream` adds one). `param` is never read (it may be gone:
/// CuPy frees blocks after their allocator, at interpreter exit above all) and `device_id` is
/// ignored. [`GPUPOOL_CUPY_HOOK_RAISED`] and NULL do nothing. Runs no Python and needs no GIL,
/// so a block CuPy frees while the interpreter exits goes back silently.
///
/// A pointer gpupool did not hand out is refused: the failure is written to stderr and nothing
/// changes. Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_cupy_hook_free(param: *mut c_void, ptr: *mut c_void, device_id: c_int) {
    let _ = (param, device_id);
    if ptr as isize == GPUPOOL_CUPY_HOOK_RAISED {
        return;
    }
    report(boundary_boxed("gpupool_cupy_hook_free", || free(ptr)));
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
