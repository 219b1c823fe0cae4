//! The driver API's allocation functions (`cuda.h`) and `cuGetProcAddress`, interposed. The
//! real ones are looked up in cudarc's handle of `libcuda.so`, which cudarc opens itself and
//! so always reaches the driver's definitions, never these.
//!
//! Without `libcuda.so` there is no driver for a call the shim does not serve (a pointer that
//! is not gpupool's, NULL, an allocation outside a primary context, `cuGetProcAddress`): it
//! returns `CUDA_ERROR_NOT_INITIALIZED`, which is what the driver answers to every call until
//! `cuInit` has succeeded, and `cuInit` cannot succeed without the library. Nothing is printed
//! and cudarc's handle is never touched: it panics when the library is missing.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;

use cudarc::driver::sys;

use crate::shim::{NOT_INITIALIZED, Shim, UNKNOWN, bump, guard, owner_of, shim, status};

type AllocFn = unsafe extern "C" fn(*mut sys::CUdeviceptr, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(sys::CUdeviceptr) -> c_int;
type AllocAsyncFn = unsafe extern "C" fn(*mut sys::CUdeviceptr, usize, sys::CUstream) -> c_int;
type FreeAsyncFn = unsafe extern "C" fn(sys::CUdeviceptr, sys::CUstream) -> c_int;
/// `cuGetProcAddress` as CUDA 11.3 to 11.8 declare it; the driver still exports it.
type GetProcFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, sys::cuuint64_t) -> c_int;
/// `cuGetProcAddress_v2`, CUDA 12's `cuGetProcAddress`.
type GetProcV2Fn = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    sys::cuuint64_t,
    *mut sys::CUdriverProcAddressQueryResult,
) -> c_int;

/// Whether `libcuda.so` can be opened (as cudarc looks for it), checked once.
fn have_libcuda() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the library; nothing is called through it.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Calls the real driver's `$name` (declared by CUDA as `$ty`) with `$args`, or returns
/// `CUDA_ERROR_NOT_INITIALIZED` without `libcuda.so` and `CUDA_ERROR_UNKNOWN` when the
/// driver lacks the symbol (one older than the function).
macro_rules! call_real {
    ($name:literal, $ty:ty, $($arg:expr),*) => {{
        static SLOT: OnceLock<Option<$ty>> = OnceLock::new();
        if !have_libcuda() {
            NOT_INITIALIZED
        } else {
            // SAFETY: the library is present, so cudarc's handle opens it without panicking; a
            // symbol of this name has CUDA's signature `$ty`.
            let f = *SLOT.get_or_init(|| unsafe { sys::culib().get::<$ty>($name).ok().map(|f| *f) });
            match f {
                // SAFETY: the real function, with the caller's arguments.
                Some(f) => unsafe { f($($arg),*) },
                None => UNKNOWN,
            }
        }
    }};
}

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
pub unsafe extern "C-unwind" fn cuMemAlloc_v2(dptr: *mut sys::CUdeviceptr, bytesize: usize) -> c_int {
    guard(UNKNOWN, || {
        allocate(
            dptr,
            bytesize,
            std::ptr::null_mut(),
            |s| &s.counters.cu_mem_alloc,
            || call_real!(b"cuMemAlloc_v2", AllocFn, dptr, bytesize),
        )
    })
}

/// `CUresult cuMemFree_v2(CUdeviceptr dptr)`: a gpupool pointer goes back to gpupool
/// (deferred in safe mode, like `cudaFree`); others go to the real function.
///
/// # Safety
/// As CUDA's `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemFree_v2(dptr: sys::CUdeviceptr) -> c_int {
    guard(UNKNOWN, || match owner_of(dptr) {
        Some(s) => status(s.free(dptr)),
        None => call_real!(b"cuMemFree_v2", FreeFn, dptr),
    })
}

/// `CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)`: served
/// by gpupool for `hStream` when a primary context is current; otherwise the real function.
///
/// # Safety
/// As CUDA's `cuMemAllocAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemAllocAsync(
    dptr: *mut sys::CUdeviceptr,
    bytesize: usize,
    stream: sys::CUstream,
) -> c_int {
    guard(UNKNOWN, || {
        allocate(
            dptr,
            bytesize,
            stream,
            |s| &s.counters.cu_mem_alloc_async,
            || call_real!(b"cuMemAllocAsync", AllocAsyncFn, dptr, bytesize, stream),
        )
    })
}

/// `CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)`: a gpupool pointer is freed
/// in `hStream`'s order; others go to the real function.
///
/// # Safety
/// As CUDA's `cuMemFreeAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemFreeAsync(dptr: sys::CUdeviceptr, stream: sys::CUstream) -> c_int {
    guard(UNKNOWN, || match owner_of(dptr) {
        Some(s) => status(s.free_async(dptr, stream as usize)),
        None => call_real!(b"cuMemFreeAsync", FreeAsyncFn, dptr, stream),
    })
}

// Pinned host memory: `cuMemAllocHost_v2`, `cuMemHostAlloc` and `cuMemFreeHost`, served by
// gpupool's caching host allocator.

type HostAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize, u32) -> c_int;
type HostFreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;

/// `CU_MEMHOSTALLOC_PORTABLE`: gpupool's pinned memory is portable. `DEVICEMAP` and
/// `WRITECOMBINED` ask for memory of another kind, which the real function gives.
const SERVED_HOST_FLAGS: u32 = 1;

/// `CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)`: served by gpupool's pinned host
/// allocator.
///
/// # Safety
/// As CUDA's `cuMemAllocHost_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> c_int {
    // SAFETY: as this function's contract.
    unsafe { cuMemHostAlloc(pp, bytesize, 0) }
}

/// `CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)`: served by
/// gpupool for flags 0 and `CU_MEMHOSTALLOC_PORTABLE`; others go to the real function.
///
/// # Safety
/// As CUDA's `cuMemHostAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, flags: u32) -> c_int {
    guard(UNKNOWN, || match shim() {
        Some(s) if flags & !SERVED_HOST_FLAGS == 0 => {
            if pp.is_null() {
                return crate::shim::INVALID_VALUE;
            }
            // SAFETY (out): checked non-null; the caller passes a writable `void *`.
            s.serve_host(&s.counters.cu_host_alloc, bytesize, |p| unsafe { *pp = p as *mut c_void })
        }
        s => {
            if let Some(s) = s {
                bump(&s.counters.passed_host_allocs);
            }
            call_real!(b"cuMemHostAlloc", HostAllocFn, pp, bytesize, flags)
        }
    })
}

/// `CUresult cuMemFreeHost(void *p)`: a gpupool block goes back to gpupool, reused only after
/// a synchronisation of the current context's device (as `cudaFreeHost`); other pointers go
/// to the real function.
///
/// # Safety
/// As CUDA's `cuMemFreeHost`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemFreeHost(p: *mut c_void) -> c_int {
    guard(UNKNOWN, || match crate::shim::host_owner_of(p as usize) {
        Some(s) => status(s.free_host(p as usize, s.alloc.driver().current_device().unwrap_or(0))),
        None => call_real!(b"cuMemFreeHost", HostFreeFn, p),
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
        b"cuMemAllocHost" if v2 => cuMemAllocHost_v2 as *mut c_void,
        b"cuMemHostAlloc" => cuMemHostAlloc as *mut c_void,
        b"cuMemFreeHost" => cuMemFreeHost as *mut c_void,
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
/// `cuMemAlloc`, `cuMemFree`, `cuMemAllocAsync`, `cuMemFreeAsync`, `cuMemAllocHost`, `cuMemHostAlloc`,
/// `cuMemFreeHost` and `cuGetProcAddress`.
///
/// # Safety
/// As CUDA's `cuGetProcAddress`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: sys::cuuint64_t,
) -> c_int {
    guard(UNKNOWN, || {
        let r = call_real!(b"cuGetProcAddress", GetProcFn, symbol, pfn, cuda_version, flags);
        // SAFETY: as the caller of cuGetProcAddress promised.
        unsafe { substitute(r, symbol, pfn, cuda_version) }
    })
}

/// `CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t
/// flags, CUdriverProcAddressQueryResult *symbolStatus)` (CUDA 12's `cuGetProcAddress`): as
/// [`cuGetProcAddress`].
///
/// # Safety
/// As CUDA's `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: sys::cuuint64_t,
    status: *mut sys::CUdriverProcAddressQueryResult,
) -> c_int {
    guard(UNKNOWN, || {
        let r = call_real!(b"cuGetProcAddress_v2", GetProcV2Fn, symbol, pfn, cuda_version, flags, status);
        // SAFETY: as the caller of cuGetProcAddress promised.
        unsafe { substitute(r, symbol, pfn, cuda_version) }
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
        assert_eq!(ours(c"cuMemAllocHost", 12080), Some(cuMemAllocHost_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemAllocHost", 3000), None);
        assert_eq!(ours(c"cuMemHostAlloc", 12080), Some(cuMemHostAlloc as *mut c_void));
        assert_eq!(ours(c"cuMemFreeHost", 12080), Some(cuMemFreeHost as *mut c_void));
    }
}
