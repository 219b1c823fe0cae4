//! The functions PyTorch's pluggable allocator calls (`torch.cuda.memory.CUDAPluggableAllocator`
//! and the hooks of the object its `allocator()` returns), with PyTorch's exact signatures.
//!
//! PyTorch's hooks return nothing, so a failure cannot be returned: each of these functions
//! writes gpupool's message to stderr (prefixed `gpupool:`) and leaves it for
//! `gpupool_last_error_message` on the calling thread. `examples/python/gpupool_torch.py`
//! wires them all. `include/gpupool_torch.h` is generated from this file alone
//! (cbindgen-torch.toml).

use std::ffi::{CStr, c_int, c_void};
use std::io::Write;

use super::memory::{empty_cache, free, malloc, record_stream, set_memory_fraction};
use super::status::{boundary, boundary_boxed, boundary_hot, gpupool_last_error_message, gpupool_status};
use super::{gpupool_stream_t, runtime};

/// Writes a failure to stderr as `gpupool: <status>: <function>: <what went wrong>`; also
/// for the other frameworks' hooks (`plugins.rs`).
pub(super) fn report(status: gpupool_status) {
    if status != gpupool_status::GPUPOOL_SUCCESS {
        // SAFETY: a NUL-terminated string that lives until the next failing call on this thread.
        let msg = unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy();
        let what = status.description().to_string_lossy();
        // Not eprintln!, which panics when stderr is closed.
        let _ = writeln!(std::io::stderr(), "gpupool: {what}: {msg}");
    }
}

/// PyTorch's `alloc_fn`: `void *alloc(size_t size, int device, cudaStream_t stream)`, the
/// allocation of a tensor's storage of `size` bytes on `device` for `stream`
/// (PyTorch `raw_alloc_with_stream`); exactly `gpupool_malloc`.
///
/// Returns NULL for `size` 0, and NULL on failure after writing gpupool's message (PyTorch's
/// out-of-memory text on out of memory) to stderr. PyTorch 2.11's pluggable allocator does not
/// check for NULL: an out-of-memory here ends the program at the tensor's first use, where
/// PyTorch's own allocator would raise `torch.OutOfMemoryError`.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_torch_malloc(size: usize, device: c_int, stream: gpupool_stream_t) -> *mut c_void {
    let mut ptr = std::ptr::null_mut();
    report(boundary_hot("gpupool_torch_malloc", || {
        ptr = malloc(size, device, stream)?;
        Ok(())
    }));
    ptr
}

/// PyTorch's `free_fn`: `void free(void *ptr, size_t size, int device, cudaStream_t stream)`;
/// PyTorch passes the size, device and stream of the allocation, which gpupool already knows:
/// exactly `gpupool_free(ptr)`. A failure (a pointer gpupool did not hand out) is written to
/// stderr and changes nothing.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: gpupool_stream_t,
) {
    let _ = (size, device, stream);
    report(boundary_boxed("gpupool_torch_free", || free(ptr)));
}

/// PyTorch's `record_stream_fn` (`set_record_stream_fn`): `void record_stream(void *ptr,
/// cudaStream_t stream)`, called by `Tensor.record_stream`; exactly `gpupool_record_stream`.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_torch_record_stream(ptr: *mut c_void, stream: gpupool_stream_t) {
    report(boundary("gpupool_torch_record_stream", || record_stream(ptr, stream)));
}

/// PyTorch's `reset_fn` (`set_reset_fn`): `void reset(void)`, called by
/// `torch.cuda.empty_cache()`; `gpupool_empty_cache(-1)`, every device.
///
/// Thread-safe; waits for the pending events of freed blocks.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_torch_empty_cache() {
    report(boundary("gpupool_torch_empty_cache", || empty_cache(-1)));
}

/// PyTorch's `memory_fraction_fn` (`set_memory_fraction_fn`): `void set_fraction(double
/// fraction, int device)`, called by `torch.cuda.set_per_process_memory_fraction`; exactly
/// `gpupool_set_memory_fraction`.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_torch_set_memory_fraction(fraction: f64, device: c_int) {
    report(boundary("gpupool_torch_set_memory_fraction", || set_memory_fraction(fraction, device)));
}

/// PyTorch's `init_fn` (`set_init_fn`): `void init(int device_count)`, called once when
/// PyTorch initialises CUDA. Starts gpupool's allocator now, so that a missing driver or a bad
/// `GPUPOOL_*` variable is reported at start rather than at the first tensor, and warns on
/// stderr if gpupool sees a different number of devices than PyTorch.
///
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_torch_init(device_count: c_int) {
    report(boundary("gpupool_torch_init", || {
        let ours = runtime()?.allocator.device_count();
        if ours != device_count {
            let _ = writeln!(
                std::io::stderr(),
                "gpupool: gpupool_torch_init: PyTorch sees {device_count} device(s), gpupool {ours}"
            );
        }
        Ok(())
    }));
}
