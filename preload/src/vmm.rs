//! `cuMemCreate`, interposed only to be counted: physical memory that a program maps itself
//! with CUDA's virtual memory calls (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`), as
//! ggml's VMM pool does, is not gpupool's and cannot be (the program manages the address range
//! itself), so every call goes to the driver, and the exit report says how many there were and
//! how many bytes they created: what runs beside gpupool. Caught when the program binds it by
//! name (linked with `-lcuda`, as ggml-cuda is); a lookup through `dlsym` in the driver's handle
//! or `cuGetProcAddress` gets the driver's own, uncounted.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use cudarc::driver::sys;

use crate::lookups::{VMM_BYTES, VMM_CREATES};
use crate::real::have_libcuda;
use crate::shim::{NOT_INITIALIZED, UNKNOWN, guard};

type CreateFn = unsafe extern "C" fn(*mut c_void, usize, *const c_void, u64) -> c_int;

/// `CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const
/// CUmemAllocationProp *prop, unsigned long long flags)`: the driver's, counted (a call; its
/// `size` when it succeeds). Without `libcuda.so`, `CUDA_ERROR_NOT_INITIALIZED` (as every
/// driver call before `cuInit`); a driver without the symbol (before CUDA 10.2),
/// `CUDA_ERROR_UNKNOWN`. Never starts gpupool. Thread-safe.
///
/// # Safety
/// As CUDA's `cuMemCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemCreate(
    handle: *mut c_void,
    size: usize,
    prop: *const c_void,
    flags: u64,
) -> c_int {
    static REAL: OnceLock<Option<CreateFn>> = OnceLock::new();
    guard(UNKNOWN, || {
        VMM_CREATES.fetch_add(1, Ordering::Relaxed);
        if !have_libcuda() {
            return NOT_INITIALIZED;
        }
        // SAFETY: the library is present, so cudarc's handle opens it without panicking; the
        // symbol has CUDA's signature `CreateFn`.
        let real = *REAL.get_or_init(|| unsafe { sys::culib().get::<CreateFn>(b"cuMemCreate").ok().map(|f| *f) });
        let Some(real) = real else { return UNKNOWN };
        // SAFETY: the driver's function, with the caller's arguments.
        let r = unsafe { real(handle, size, prop, flags) };
        if r == 0 {
            VMM_BYTES.fetch_add(size as u64, Ordering::Relaxed);
        }
        r
    })
}
