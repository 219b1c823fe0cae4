//! The CUDA runtime's allocation functions (`cuda_runtime_api.h`), interposed (its
//! `cudaStreamDestroy` is `streams.rs`'s). The real ones are found with `dlsym(RTLD_NEXT,
//! ...)`, else in a `libcudart.so*` loaded privately (`real.rs`).

use std::ffi::{c_char, c_int, c_void};

use gpupool::config::DriverKind;

use crate::real::real;
use crate::shim::{INVALID_VALUE, SUCCESS, UNKNOWN, bump, guard, owner_of, shim, status};

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type MallocAsyncFn = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> c_int;
type FreeAsyncFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type GetDeviceFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The runtime's current device (`cudaGetDevice`), or -1 (gpupool's current device) when the
/// runtime cannot say.
fn runtime_device() -> i32 {
    let Some(get) = real!(c"cudaGetDevice", GetDeviceFn) else { return -1 };
    let mut d = 0;
    // SAFETY: writes one int.
    if unsafe { get(&mut d) } == 0 { d } else { -1 }
}

/// `cudaError_t cudaMalloc(void **devPtr, size_t size)`, served by gpupool on the runtime's
/// current device for the legacy default stream. Errors as CUDA's: `cudaErrorInvalidValue`
/// (NULL `devPtr`), `cudaErrorMemoryAllocation`.
///
/// # Safety
/// As CUDA's `cudaMalloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    guard(UNKNOWN, || match shim() {
        // SAFETY (out): checked non-null; the caller passes a writable `void *`.
        Some(s) if !dev_ptr.is_null() => {
            s.serve(&s.counters.cuda_malloc, size, runtime_device(), 0, |p| unsafe { *dev_ptr = p as *mut c_void })
        }
        Some(_) => INVALID_VALUE,
        // SAFETY: the real function, with the caller's arguments.
        None => real!(c"cudaMalloc", MallocFn).map_or(UNKNOWN, |f| unsafe { f(dev_ptr, size) }),
    })
}

/// `cudaError_t cudaFree(void *devPtr)`: a gpupool pointer goes back to gpupool (deferred
/// until a device synchronisation in the default safe mode); every other pointer goes to the
/// real `cudaFree`. NULL: see [`free_null`].
///
/// # Safety
/// As CUDA's `cudaFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaFree(dev_ptr: *mut c_void) -> c_int {
    guard(UNKNOWN, || {
        if dev_ptr.is_null() {
            return free_null();
        }
        match owner_of(dev_ptr as u64) {
            Some(s) => status(s.free(dev_ptr as u64)),
            // SAFETY: the real function, with the caller's arguments.
            None => real!(c"cudaFree", FreeFn).map_or(UNKNOWN, |f| unsafe { f(dev_ptr) }),
        }
    })
}

/// `cudaFree(NULL)`: CUDA performs no operation and returns success, and programs call it to
/// make the runtime initialise. On the simulated device gpupool answers success itself: the
/// simulated device stands in for the GPU, so there is nothing for a runtime to initialise, and
/// the program may have none. Otherwise the real `cudaFree(NULL)` runs, so that the runtime
/// initialises as the program expects, and its status is returned; without a real one,
/// success if gpupool runs, else `cudaErrorUnknown` (no CUDA at all).
fn free_null() -> c_int {
    let started = shim();
    if let Some(s) = started {
        if s.alloc.config().driver == DriverKind::Sim {
            return SUCCESS;
        }
        bump(&s.counters.passed_frees);
    }
    match real!(c"cudaFree", FreeFn) {
        // SAFETY: the real function, with the caller's (NULL) argument.
        Some(f) => unsafe { f(std::ptr::null_mut()) },
        None if started.is_some() => SUCCESS,
        None => UNKNOWN,
    }
}

/// `cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream)`, served by
/// gpupool for `stream` on the runtime's current device.
///
/// # Safety
/// As CUDA's `cudaMallocAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaMallocAsync(dev_ptr: *mut *mut c_void, size: usize, stream: *mut c_void) -> c_int {
    guard(UNKNOWN, || match shim() {
        // SAFETY (out): checked non-null; the caller passes a writable `void *`.
        Some(s) if !dev_ptr.is_null() => {
            s.serve(&s.counters.cuda_malloc_async, size, runtime_device(), stream as usize, |p| unsafe {
                *dev_ptr = p as *mut c_void
            })
        }
        Some(_) => INVALID_VALUE,
        // SAFETY: the real function, with the caller's arguments.
        None => real!(c"cudaMallocAsync", MallocAsyncFn).map_or(UNKNOWN, |f| unsafe { f(dev_ptr, size, stream) }),
    })
}

/// `cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream)`: a gpupool pointer is freed
/// in `stream`'s order (`record_stream` then free); others go to the real function.
///
/// # Safety
/// As CUDA's `cudaFreeAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaFreeAsync(dev_ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guard(UNKNOWN, || match owner_of(dev_ptr as u64) {
        Some(s) => status(s.free_async(dev_ptr as u64, stream as usize)),
        // SAFETY: the real function, with the caller's arguments.
        None => real!(c"cudaFreeAsync", FreeAsyncFn).map_or(UNKNOWN, |f| unsafe { f(dev_ptr, stream) }),
    })
}

// Pinned host memory: `cudaMallocHost`, `cudaHostAlloc` and `cudaFreeHost`, served by gpupool's
// caching host allocator (the one `gpupool_host_malloc` uses).

type HostAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize, u32) -> c_int;

/// `cudaHostAllocDefault` and `cudaHostAllocPortable`: what gpupool's pinned memory is (every
/// block is portable). `cudaHostAllocMapped` and `cudaHostAllocWriteCombined` ask for memory
/// of another kind, which the real function gives.
const SERVED_HOST_FLAGS: u32 = 1;

/// The device a pinned free waits for: the runtime's current device, else gpupool's.
fn free_device(s: &crate::shim::Shim) -> i32 {
    match runtime_device() {
        -1 => s.alloc.driver().current_device().unwrap_or(0),
        d => d,
    }
}

/// `cudaError_t cudaMallocHost(void **ptr, size_t size)`, served by gpupool's pinned host
/// allocator (size rounded up to its size class, see `gpupool_host_malloc`; 0 gives NULL and
/// success).
///
/// # Safety
/// As CUDA's `cudaMallocHost`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaMallocHost(ptr: *mut *mut c_void, size: usize) -> c_int {
    // SAFETY: as this function's contract.
    unsafe { cudaHostAlloc(ptr, size, 0) }
}

/// `cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags)`: served by
/// gpupool for `cudaHostAllocDefault` and `cudaHostAllocPortable`; other flags go to the real
/// function.
///
/// # Safety
/// As CUDA's `cudaHostAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaHostAlloc(ptr: *mut *mut c_void, size: usize, flags: u32) -> c_int {
    guard(UNKNOWN, || match shim() {
        // SAFETY (out): checked non-null; the caller passes a writable `void *`.
        Some(s) if flags & !SERVED_HOST_FLAGS == 0 => {
            if ptr.is_null() {
                return INVALID_VALUE;
            }
            s.serve_host(&s.counters.cuda_host_alloc, size, |p| unsafe { *ptr = p as *mut c_void })
        }
        s => {
            if let Some(s) = s {
                bump(&s.counters.passed_host_allocs);
            }
            // SAFETY: the real function, with the caller's arguments.
            real!(c"cudaHostAlloc", HostAllocFn).map_or(UNKNOWN, |f| unsafe { f(ptr, size, flags) })
        }
    })
}

/// `cudaError_t cudaFreeHost(void *ptr)`: a gpupool block goes back to gpupool, reused only
/// after a synchronisation of the current device (CUDA's `cudaFreeHost` waits for it); every
/// other pointer, NULL included, goes to the real function.
///
/// # Safety
/// As CUDA's `cudaFreeHost`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaFreeHost(ptr: *mut c_void) -> c_int {
    guard(UNKNOWN, || match crate::shim::host_owner_of(ptr as usize) {
        Some(s) => status(s.free_host(ptr as usize, free_device(s))),
        // SAFETY: the real function, with the caller's arguments.
        None => real!(c"cudaFreeHost", FreeFn).map_or(UNKNOWN, |f| unsafe { f(ptr) }),
    })
}

// The runtime's way to the driver's functions: `cudaGetDriverEntryPoint` (CUDA 11.3; CUDA 12
// added its `driverStatus` argument) and `cudaGetDriverEntryPointByVersion` (CUDA 12.5), each
// with a `_ptsz` twin for programs built for the per-thread default stream. The real lookup
// runs, then the shim's functions replace the driver's where it serves them, as for
// `cuGetProcAddress` (`driver_api::substitute`).

type EntryPointFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, u64, *mut c_int) -> c_int;
type EntryPointByVersionFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, u32, u64, *mut c_int) -> c_int;
type RuntimeVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The CUDA version the program's runtime was built as (`cudaRuntimeGetVersion`), which
/// `cudaGetDriverEntryPoint` asks the driver for; CUDA 12.0 when the runtime cannot say (the
/// version only picks which `cuGetProcAddress` the shim gives, CUDA 12's from 12.0 on).
fn runtime_version() -> c_int {
    let Some(get) = real!(c"cudaRuntimeGetVersion", RuntimeVersionFn) else { return 12000 };
    let mut v = 0;
    // SAFETY: writes one int.
    if unsafe { get(&mut v) } == 0 && v > 0 { v } else { 12000 }
}

/// `cudaGetDriverEntryPoint` and its `_ptsz` twin (`ptsz`): the real function `real`, then the
/// shim's driver functions where it serves them. The fourth argument is passed on as it came:
/// a program built for CUDA 11 passes three, and its runtime reads three.
fn entry_point(
    real: Option<EntryPointFn>,
    symbol: *const c_char,
    func: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
    ptsz: bool,
) -> c_int {
    // SAFETY: the real function, with the caller's arguments.
    let Some(r) = real.map(|f| unsafe { f(symbol, func, flags, status) }) else { return UNKNOWN };
    let per_thread = crate::driver_api::per_thread(flags, ptsz);
    // SAFETY: as the caller of cudaGetDriverEntryPoint promised.
    unsafe { crate::driver_api::substitute(r, symbol, func, runtime_version(), per_thread) }
}

/// `cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr, unsigned long long
/// flags, cudaDriverEntryPointQueryResult *driverStatus)`: the runtime's lookup, with the
/// shim's functions for the driver symbols `cuGetProcAddress` gives them for (at the
/// runtime's own CUDA version). Errors: the real function's; `cudaErrorUnknown` without a
/// runtime.
///
/// # Safety
/// As CUDA's `cudaGetDriverEntryPoint`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    func: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guard(UNKNOWN, || entry_point(real!(c"cudaGetDriverEntryPoint", EntryPointFn), symbol, func, flags, status, false))
}

/// `cudaGetDriverEntryPoint_ptsz`, for programs built for the per-thread default stream: as
/// [`cudaGetDriverEntryPoint`].
///
/// # Safety
/// As CUDA's `cudaGetDriverEntryPoint`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaGetDriverEntryPoint_ptsz(
    symbol: *const c_char,
    func: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guard(UNKNOWN, || {
        entry_point(real!(c"cudaGetDriverEntryPoint_ptsz", EntryPointFn), symbol, func, flags, status, true)
    })
}

/// `cudaGetDriverEntryPointByVersion` and its `_ptsz` twin: as [`entry_point`], at the
/// version the caller asks for.
fn entry_point_by_version(
    real: Option<EntryPointByVersionFn>,
    args: (*const c_char, *mut *mut c_void, u32, u64, *mut c_int),
    ptsz: bool,
) -> c_int {
    let (symbol, func, version, flags, status) = args;
    // SAFETY: the real function, with the caller's arguments.
    let Some(r) = real.map(|f| unsafe { f(symbol, func, version, flags, status) }) else { return UNKNOWN };
    let per_thread = crate::driver_api::per_thread(flags, ptsz);
    let version = c_int::try_from(version).unwrap_or(c_int::MAX);
    // SAFETY: as the caller of cudaGetDriverEntryPointByVersion promised.
    unsafe { crate::driver_api::substitute(r, symbol, func, version, per_thread) }
}

/// `cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr, unsigned
/// int cudaVersion, unsigned long long flags, cudaDriverEntryPointQueryResult *driverStatus)`:
/// the runtime's lookup, with the shim's functions where `cuGetProcAddress` at `cudaVersion`
/// gives them. Errors: the real function's; `cudaErrorUnknown` without a runtime.
///
/// # Safety
/// As CUDA's `cudaGetDriverEntryPointByVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: u32,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guard(UNKNOWN, || {
        let real = real!(c"cudaGetDriverEntryPointByVersion", EntryPointByVersionFn);
        entry_point_by_version(real, (symbol, func, version, flags, status), false)
    })
}

/// `cudaGetDriverEntryPointByVersion_ptsz`, for programs built for the per-thread default
/// stream: as [`cudaGetDriverEntryPointByVersion`].
///
/// # Safety
/// As CUDA's `cudaGetDriverEntryPointByVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaGetDriverEntryPointByVersion_ptsz(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: u32,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guard(UNKNOWN, || {
        let real = real!(c"cudaGetDriverEntryPointByVersion_ptsz", EntryPointByVersionFn);
        entry_point_by_version(real, (symbol, func, version, flags, status), true)
    })
}

/// The shim's definition of a runtime function by its exported name, if the shim has one,
/// for `dlsym` in a handle that reaches the runtime (`dlsym.rs`).
#[cfg_attr(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")), allow(dead_code))]
pub(crate) fn served_by_name(name: &[u8]) -> Option<*mut c_void> {
    Some(match name {
        b"cudaMalloc" => cudaMalloc as *mut c_void,
        b"cudaFree" => cudaFree as *mut c_void,
        b"cudaMallocAsync" => cudaMallocAsync as *mut c_void,
        b"cudaFreeAsync" => cudaFreeAsync as *mut c_void,
        b"cudaMallocHost" => cudaMallocHost as *mut c_void,
        b"cudaHostAlloc" => cudaHostAlloc as *mut c_void,
        b"cudaFreeHost" => cudaFreeHost as *mut c_void,
        b"cudaGetDriverEntryPoint" => cudaGetDriverEntryPoint as *mut c_void,
        b"cudaGetDriverEntryPoint_ptsz" => cudaGetDriverEntryPoint_ptsz as *mut c_void,
        b"cudaGetDriverEntryPointByVersion" => cudaGetDriverEntryPointByVersion as *mut c_void,
        b"cudaGetDriverEntryPointByVersion_ptsz" => cudaGetDriverEntryPointByVersion_ptsz as *mut c_void,
        b"cudaStreamDestroy" => crate::streams::cudaStreamDestroy as *mut c_void,
        _ => return None,
    })
}
