//! The driver API's allocation functions (`cuda.h`) and `cuGetProcAddress`, interposed. The
//! real ones are called through cudarc, which opens `libcuda.so` itself and so always reaches
//! the driver's definitions, never these.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::AtomicU64;

use cudarc::driver::sys;

use crate::shim::{Shim, UNKNOWN, bump, guard, owner_of, shim, status};

/// The device whose primary context is current, when gpupool should serve the call.
fn primary_device() -> Option<i32> {
    shim()?.alloc.driver().current_primary_device().ok().flatten()
}

/// An allocation gpupool serves when a primary context is current, else the real function's.
fn allocate(
    dptr: *mut sys::CUdeviceptr,
    size: usize,
    stream: sys::CUstream,
    served: impl Fn(&Shim) -> &AtomicU64,
    real: impl FnOnce() -> c_int,
) -> c_int {
    match (shim(), primary_device()) {
        // SAFETY (out): checked non-null; the caller passes a writable CUdeviceptr.
        (Some(s), Some(dev)) if !dptr.is_null() => {
            s.serve(served(s), size, dev, stream as usize, |p| unsafe { *dptr = p })
        }
        (s, _) => {
            if let Some(s) = s {
                bump(&s.counters.passed_allocs);
            }
            real()
        }
    }
}

/// `CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`: served by gpupool when the
/// current context is a device's primary context, for the legacy default stream; otherwise
/// the real function.
///
/// # Safety
/// As CUDA's `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut sys::CUdeviceptr, bytesize: usize) -> c_int {
    guard(UNKNOWN, || {
        // SAFETY: the real function, with the caller's arguments.
        allocate(
            dptr,
            bytesize,
            std::ptr::null_mut(),
            |s| &s.counters.cu_mem_alloc,
            || unsafe { sys::cuMemAlloc_v2(dptr, bytesize) as c_int },
        )
    })
}

/// `CUresult cuMemFree_v2(CUdeviceptr dptr)`: a gpupool pointer goes back to gpupool
/// (deferred in safe mode, like `cudaFree`); others go to the real function.
///
/// # Safety
/// As CUDA's `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: sys::CUdeviceptr) -> c_int {
    guard(UNKNOWN, || match owner_of(dptr) {
        Some(s) => status(s.free(dptr)),
        // SAFETY: the real function, with the caller's argument.
        None => unsafe { sys::cuMemFree_v2(dptr) as c_int },
    })
}

/// `CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)`: served
/// by gpupool for `hStream` when a primary context is current; otherwise the real function.
///
/// # Safety
/// As CUDA's `cuMemAllocAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut sys::CUdeviceptr, bytesize: usize, stream: sys::CUstream) -> c_int {
    guard(UNKNOWN, || {
        // SAFETY: the real function, with the caller's arguments.
        allocate(
            dptr,
            bytesize,
            stream,
            |s| &s.counters.cu_mem_alloc_async,
            || unsafe { sys::cuMemAllocAsync(dptr, bytesize, stream) as c_int },
        )
    })
}

/// `CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)`: a gpupool pointer is freed
/// in `hStream`'s order; others go to the real function.
///
/// # Safety
/// As CUDA's `cuMemFreeAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: sys::CUdeviceptr, stream: sys::CUstream) -> c_int {
    guard(UNKNOWN, || match owner_of(dptr) {
        Some(s) => status(s.free_async(dptr, stream as usize)),
        // SAFETY: the real function, with the caller's arguments.
        None => unsafe { sys::cuMemFreeAsync(dptr, stream) as c_int },
    })
}

/// The shim's definition of a driver symbol as `cuGetProcAddress` names it (the base name,
/// for the CUDA version the caller was built for), if the shim has one.
fn ours(symbol: &CStr, cuda_version: c_int) -> Option<*mut c_void> {
    // Before CUDA 3.2, "cuMemAlloc" and "cuMemFree" meant the 32-bit functions, which gpupool
    // does not serve.
    let v2 = cuda_version >= 3020;
    Some(match symbol.to_bytes() {
        b"cuMemAlloc" if v2 => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree" if v2 => cuMemFree_v2 as *mut c_void,
        b"cuMemAllocAsync" => cuMemAllocAsync as *mut c_void,
        b"cuMemFreeAsync" => cuMemFreeAsync as *mut c_void,
        b"cuGetProcAddress" if cuda_version >= 12000 => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        _ => return None,
    })
}

/// After a successful real lookup, puts the shim's function in `*pfn` where it has one.
///
/// # Safety
/// `symbol` is NUL-terminated and `pfn` writable, as the caller of cuGetProcAddress promised.
unsafe fn substitute(r: c_int, symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int) -> c_int {
    if r == 0 && !symbol.is_null() && !pfn.is_null() && shim().is_some() {
        // SAFETY: as this function's contract.
        let name = unsafe { CStr::from_ptr(symbol) };
        if let Some(f) = ours(name, cuda_version) {
            // SAFETY: as this function's contract.
            unsafe { *pfn = f };
        }
    }
    r
}

/// `CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t
/// flags)` (CUDA 11.3 to 11.8's signature): the real lookup, with the shim's functions for
/// `cuMemAlloc`, `cuMemFree`, `cuMemAllocAsync`, `cuMemFreeAsync` and `cuGetProcAddress`.
///
/// # Safety
/// As CUDA's `cuGetProcAddress`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: sys::cuuint64_t,
) -> c_int {
    guard(UNKNOWN, || {
        // SAFETY: the real function, with the caller's arguments; then as `substitute`'s.
        unsafe {
            // cudarc declares only the CUDA 12 signature; the driver still exports this one.
            type V1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, sys::cuuint64_t) -> c_int;
            let Ok(real) = sys::culib().get::<V1>(b"cuGetProcAddress") else { return UNKNOWN };
            let r = real(symbol, pfn, cuda_version, flags);
            substitute(r, symbol, pfn, cuda_version)
        }
    })
}

/// `CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t
/// flags, CUdriverProcAddressQueryResult *symbolStatus)` (CUDA 12's `cuGetProcAddress`): as
/// [`cuGetProcAddress`].
///
/// # Safety
/// As CUDA's `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: sys::cuuint64_t,
    status: *mut sys::CUdriverProcAddressQueryResult,
) -> c_int {
    guard(UNKNOWN, || {
        // SAFETY: the real function, with the caller's arguments; then as `substitute`'s.
        unsafe {
            let r = sys::cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, status) as c_int;
            substitute(r, symbol, pfn, cuda_version)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_proc_address_answers_for_the_allocation_symbols_only() {
        assert_eq!(ours(c"cuMemAlloc", 12080), Some(cuMemAlloc_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemFree", 13000), Some(cuMemFree_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemAllocAsync", 11020), Some(cuMemAllocAsync as *mut c_void));
        assert_eq!(ours(c"cuMemFreeAsync", 11020), Some(cuMemFreeAsync as *mut c_void));
        assert_eq!(ours(c"cuGetProcAddress", 12000), Some(cuGetProcAddress_v2 as *mut c_void));
        assert_eq!(ours(c"cuGetProcAddress", 11080), Some(cuGetProcAddress as *mut c_void));
        // The 32-bit functions of CUDA before 3.2, and everything else, stay the driver's.
        assert_eq!(ours(c"cuMemAlloc", 3000), None);
        assert_eq!(ours(c"cuMemAlloc_v2", 12080), None);
        assert_eq!(ours(c"cuLaunchKernel", 12080), None);
    }
}
