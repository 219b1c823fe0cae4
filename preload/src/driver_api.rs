//! The driver API's allocation functions (`cuda.h`) and `cuGetProcAddress`, interposed, and
//! handed out by the shim's `dlsym` (`dlsym.rs`) to programs that open the driver
//! themselves. The real ones are called through cudarc's handle of `libcuda.so` (`real.rs`).
//!
//! Without `libcuda.so` there is no driver for a call the shim does not serve (a pointer that
//! is not gpupool's, NULL, an allocation outside a primary context, `cuGetProcAddress`): it
//! returns `CUDA_ERROR_NOT_INITIALIZED`, which is what the driver answers to every call until
//! `cuInit` has succeeded, and `cuInit` cannot succeed without the library. Nothing is printed
//! and cudarc's handle is never touched: it panics when the library is missing.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::AtomicU64;

use cudarc::driver::sys;

use crate::real::call_real;
use crate::shim::{Shim, UNKNOWN, bump, guard, owner_of, shim, status};

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

/// `CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)`, the `cuMemFreeAsync` of
/// a program built for the per-thread default stream (and what `cuGetProcAddress` gives for
/// `cuMemFreeAsync` with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`): a gpupool pointer
/// freed on a stream it names is freed in that stream's order, as [`cuMemFreeAsync`]; on the
/// NULL stream (the calling thread's own, which gpupool cannot tell from the legacy one) it is
/// freed as by `cuMemFree` (deferred in safe mode). Others go to the real function, as do all
/// per-thread allocations (`cuMemAllocAsync_ptsz` is not interposed): a program that allocates
/// with one and frees with the other keeps working.
///
/// # Safety
/// As CUDA's `cuMemFreeAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuMemFreeAsync_ptsz(dptr: sys::CUdeviceptr, stream: sys::CUstream) -> c_int {
    guard(UNKNOWN, || match owner_of(dptr) {
        Some(s) if stream.is_null() => status(s.free(dptr)),
        Some(s) => status(s.free_async(dptr, stream as usize)),
        None => call_real!(b"cuMemFreeAsync_ptsz", FreeAsyncFn, dptr, stream),
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
/// for the CUDA version the caller was built for), if the shim has one. `per_thread`: the
/// lookup asked for the per-thread default stream's variants (the flag
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`, or the default flags through a `_ptsz`
/// lookup function), for which the driver gives `cuMemAllocAsync_ptsz` and
/// `cuMemFreeAsync_ptsz`, whose NULL stream is the calling thread's own: the allocation is not
/// served (gpupool would take its NULL stream for the legacy one), and the driver's is
/// returned; the free is [`cuMemFreeAsync_ptsz`], and `cuGetProcAddress` the `_ptsz` one, so
/// that lookups through it keep asking for the per-thread variants.
pub(crate) fn ours(symbol: &CStr, cuda_version: c_int, per_thread: bool) -> Option<*mut c_void> {
    // Before CUDA 3.2, "cuMemAlloc" and "cuMemFree" meant the 32-bit functions, which gpupool
    // does not serve.
    let v2 = cuda_version >= 3020;
    Some(match symbol.to_bytes() {
        b"cuMemAlloc" if v2 => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree" if v2 => cuMemFree_v2 as *mut c_void,
        b"cuMemAllocAsync" if !per_thread => cuMemAllocAsync as *mut c_void,
        b"cuMemFreeAsync" if per_thread => cuMemFreeAsync_ptsz as *mut c_void,
        b"cuMemFreeAsync" => cuMemFreeAsync as *mut c_void,
        b"cuMemAllocHost" if v2 => cuMemAllocHost_v2 as *mut c_void,
        b"cuMemHostAlloc" => cuMemHostAlloc as *mut c_void,
        b"cuMemFreeHost" => cuMemFreeHost as *mut c_void,
        b"cuGetProcAddress" if cuda_version >= 12000 && per_thread => cuGetProcAddress_v2_ptsz as *mut c_void,
        b"cuGetProcAddress" if cuda_version >= 12000 => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        _ => return crate::streams::ours(symbol.to_bytes(), cuda_version),
    })
}

/// The shim's definition of a driver symbol by its exported name (what `dlsym` is asked
/// for: `cuMemAlloc_v2`, not `cuMemAlloc`), if the shim has one: the functions it exports.
/// Used by `dlsym.rs`, built only where that is.
#[cfg_attr(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")), allow(dead_code))]
pub(crate) fn served_by_name(name: &[u8]) -> Option<*mut c_void> {
    Some(match name {
        b"cuMemAlloc_v2" => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree_v2" => cuMemFree_v2 as *mut c_void,
        b"cuMemAllocAsync" => cuMemAllocAsync as *mut c_void,
        b"cuMemFreeAsync" => cuMemFreeAsync as *mut c_void,
        b"cuMemFreeAsync_ptsz" => cuMemFreeAsync_ptsz as *mut c_void,
        b"cuMemAllocHost_v2" => cuMemAllocHost_v2 as *mut c_void,
        b"cuMemHostAlloc" => cuMemHostAlloc as *mut c_void,
        b"cuMemFreeHost" => cuMemFreeHost as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        b"cuGetProcAddress_v2" => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress_v2_ptsz" => cuGetProcAddress_v2_ptsz as *mut c_void,
        _ => return crate::streams::driver_by_name(name),
    })
}

/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM` and `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`
/// (the runtime's `cudaEnableLegacyStream`, `cudaEnablePerThreadDefaultStream` have the same
/// values).
const LEGACY_STREAM: u64 = 1;
const PER_THREAD_STREAM: u64 = 2;

/// Whether a lookup with `flags` asks for the per-thread default stream's variants: the flag
/// says so, or no flag does and the lookup function was the `_ptsz` one (`ptsz`).
pub(crate) fn per_thread(flags: u64, ptsz: bool) -> bool {
    flags & PER_THREAD_STREAM != 0 || (ptsz && flags & LEGACY_STREAM == 0)
}

/// After a real lookup that returned `r`, puts the shim's function in `*pfn` where it has one,
/// and counts the lookup as served or passed through. Nothing is substituted when gpupool did
/// not start (every call would pass through anyway) or the lookup failed. A memory function
/// the shim does not serve (`cuMemCreate`, ...) is handed out behind a trampoline that counts
/// its calls for the exit report (`passed.rs`), whether gpupool started or not.
///
/// # Safety
/// `symbol` is NUL-terminated or null, and `pfn` writable or null, as the caller of
/// cuGetProcAddress (or cudaGetDriverEntryPoint) promised.
pub(crate) unsafe fn substitute(
    r: c_int,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    per_thread: bool,
) -> c_int {
    // SAFETY: as this function's contract.
    let served = || unsafe {
        if r != 0 || symbol.is_null() || pfn.is_null() || (*pfn).is_null() || shim().is_none() {
            return None;
        }
        ours(CStr::from_ptr(symbol), cuda_version, per_thread)
    };
    match served() {
        Some(f) => {
            // SAFETY: as this function's contract (checked non-null).
            unsafe { *pfn = f };
            bump(&crate::lookups::SERVED);
        }
        None => {
            bump(&crate::lookups::PASSED);
            // SAFETY: as this function's contract; *pfn is the driver's answer, written back
            // behind a trampoline that counts its calls where it is a memory function the shim
            // does not serve (passed.rs).
            unsafe {
                if r == 0 && !symbol.is_null() && !pfn.is_null() {
                    *pfn = crate::passed::wrap(CStr::from_ptr(symbol).to_bytes(), *pfn);
                }
            }
        }
    }
    r
}

/// `CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t
/// flags)` (CUDA 11.3 to 11.8's signature): the real lookup, with the shim's functions for
/// `cuMemAlloc`, `cuMemFree`, `cuMemAllocAsync` (not its per-thread stream variant), `cuMemFreeAsync`
/// (both variants), `cuMemAllocHost`, `cuMemHostAlloc`, `cuMemFreeHost`, `cuGetProcAddress`, `cuStreamDestroy`.
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
        unsafe { substitute(r, symbol, pfn, cuda_version, per_thread(flags, false)) }
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
        unsafe { substitute(r, symbol, pfn, cuda_version, per_thread(flags, false)) }
    })
}

/// `cuGetProcAddress_v2_ptsz`, the `cuGetProcAddress` of a program built for the per-thread
/// default stream (`--default-stream per-thread`), whose default flags mean per-thread
/// variants: as [`cuGetProcAddress_v2`].
///
/// # Safety
/// As CUDA's `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuGetProcAddress_v2_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: sys::cuuint64_t,
    status: *mut sys::CUdriverProcAddressQueryResult,
) -> c_int {
    guard(UNKNOWN, || {
        let r = call_real!(b"cuGetProcAddress_v2_ptsz", GetProcV2Fn, symbol, pfn, cuda_version, flags, status);
        // SAFETY: as the caller of cuGetProcAddress promised.
        unsafe { substitute(r, symbol, pfn, cuda_version, per_thread(flags, true)) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_proc_address_answers_for_the_allocation_symbols_only() {
        assert_eq!(ours(c"cuMemAlloc", 12080, false), Some(cuMemAlloc_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemFree", 13000, false), Some(cuMemFree_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemAllocAsync", 11020, false), Some(cuMemAllocAsync as *mut c_void));
        assert_eq!(ours(c"cuMemFreeAsync", 11020, false), Some(cuMemFreeAsync as *mut c_void));
        assert_eq!(ours(c"cuGetProcAddress", 12000, false), Some(cuGetProcAddress_v2 as *mut c_void));
        assert_eq!(ours(c"cuGetProcAddress", 11080, false), Some(cuGetProcAddress as *mut c_void));
        // The 32-bit functions of CUDA before 3.2, and everything else, stay the driver's.
        assert_eq!(ours(c"cuMemAlloc", 3000, false), None);
        assert_eq!(ours(c"cuMemAlloc_v2", 12080, false), None);
        assert_eq!(ours(c"cuLaunchKernel", 12080, false), None);
        assert_eq!(ours(c"cuMemAllocHost", 12080, false), Some(cuMemAllocHost_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemAllocHost", 3000, false), None);
        assert_eq!(ours(c"cuMemHostAlloc", 12080, false), Some(cuMemHostAlloc as *mut c_void));
        assert_eq!(ours(c"cuMemFreeHost", 12080, false), Some(cuMemFreeHost as *mut c_void));
    }

    #[test]
    fn per_thread_stream_lookups_keep_the_drivers_stream_ordered_functions() {
        assert!(!per_thread(0, false) && !per_thread(1, false) && !per_thread(1, true));
        assert!(per_thread(2, false) && per_thread(0, true) && per_thread(2, true));
        assert_eq!(ours(c"cuMemAllocAsync", 12080, true), None);
        assert_eq!(ours(c"cuMemFreeAsync", 12080, true), Some(cuMemFreeAsync_ptsz as *mut c_void));
        assert_eq!(ours(c"cuMemAlloc", 12080, true), Some(cuMemAlloc_v2 as *mut c_void));
        assert_eq!(ours(c"cuMemFree", 12080, true), Some(cuMemFree_v2 as *mut c_void));
        assert_eq!(ours(c"cuGetProcAddress", 12080, true), Some(cuGetProcAddress_v2_ptsz as *mut c_void));
        assert_eq!(ours(c"cuGetProcAddress", 11080, true), Some(cuGetProcAddress as *mut c_void));
    }

    #[test]
    fn every_driver_lookup_answers_with_the_shims_stream_destroy() {
        let (v2, legacy) =
            (crate::streams::cuStreamDestroy_v2 as *mut c_void, crate::streams::cuStreamDestroy as *mut c_void);
        for (version, per_thread) in [(4000, false), (12080, false), (12080, true), (13000, true)] {
            assert_eq!(ours(c"cuStreamDestroy", version, per_thread), Some(v2));
        }
        assert_eq!(ours(c"cuStreamDestroy", 3020, false), Some(legacy));
        assert_eq!(ours(c"cuStreamDestroy_v2", 12080, false), None);
        assert_eq!(
            (served_by_name(b"cuStreamDestroy_v2"), served_by_name(b"cuStreamDestroy")),
            (Some(v2), Some(legacy))
        );
        assert_eq!(served_by_name(b"cuStreamDestroy_v2_ptsz"), None);
    }

    #[test]
    fn dlsym_answers_for_the_exported_names_only() {
        assert_eq!(served_by_name(b"cuMemAlloc_v2"), Some(cuMemAlloc_v2 as *mut c_void));
        assert_eq!(served_by_name(b"cuGetProcAddress_v2_ptsz"), Some(cuGetProcAddress_v2_ptsz as *mut c_void));
        for name in [&b"cuMemAlloc"[..], b"cuMemAllocAsync_ptsz", b"cuMemCreate", b"cuInit", b""] {
            assert_eq!(served_by_name(name), None, "{}", String::from_utf8_lossy(name));
        }
    }
}
