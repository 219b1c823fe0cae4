//! How the shim reaches the real CUDA functions behind its own, for every module that
//! interposes one (`driver_api.rs`, `runtime_api.rs`, `streams.rs`, `vmm.rs`).
//!
//! The driver's are looked up in cudarc's handle of `libcuda.so`, which cudarc opens itself;
//! its lookups come from inside this library, which the shim's `dlsym` passes to glibc, so
//! they always reach the driver's definitions, never the shim's. Without `libcuda.so` a call
//! that would go to the driver returns `CUDA_ERROR_NOT_INITIALIZED` ([`call_real`]), and
//! cudarc's handle is never touched: it panics when the library is missing.
//!
//! The runtime's are found with `dlsym(RTLD_NEXT, ...)`: the `libcudart.so` the program links,
//! when it is in the global scope; else in the `libcudart.so*` loaded privately (`RTLD_LOCAL`,
//! as Python loads an extension module and the runtime it links).
//!
//! Its own module, below the interposing ones and above `shim.rs` only (whose statuses the
//! macros return), so that the interposers may use one another's lookups without importing
//! each other.

use std::ffi::{CStr, CString, c_int, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys;

/// Whether `libcuda.so` can be opened (as cudarc looks for it), checked once.
pub(crate) fn have_libcuda() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the library; nothing is called through it.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Calls the real driver's `$name` (declared by CUDA as `$ty`) with `$args`, or returns
/// `CUDA_ERROR_NOT_INITIALIZED` without `libcuda.so` and `CUDA_ERROR_UNKNOWN` when the
/// driver lacks the symbol (one older than the function).
macro_rules! call_real {
    ($name:literal, $ty:ty, $($arg:expr),*) => {{
        static SLOT: ::std::sync::OnceLock<Option<$ty>> = ::std::sync::OnceLock::new();
        if !$crate::real::have_libcuda() {
            $crate::shim::NOT_INITIALIZED
        } else {
            // SAFETY: the library is present, so cudarc's handle opens it without panicking; a
            // symbol of this name has CUDA's signature `$ty`.
            let f = *SLOT.get_or_init(|| unsafe { ::cudarc::driver::sys::culib().get::<$ty>($name).ok().map(|f| *f) });
            match f {
                // SAFETY: the real function, with the caller's arguments.
                Some(f) => unsafe { f($($arg),*) },
                None => $crate::shim::UNKNOWN,
            }
        }
    }};
}
pub(crate) use call_real;

/// The real runtime's definition of `name`, or null, looked up once: the next definition
/// after this library (`RTLD_NEXT`, which sees only the global scope), else the one in a
/// loaded `libcudart.so*` ([`in_loaded_runtime`]). A program that calls a runtime function
/// has its runtime loaded by then, so the first lookup finds it if anything does.
pub(crate) fn next(name: &CStr, slot: &OnceLock<usize>) -> usize {
    *slot.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; the result is only compared or transmuted
        // to the function type CUDA declares for that name.
        let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        if f != 0 { f } else { in_loaded_runtime(name) }
    })
}

/// `name` in a loaded library whose file name starts with `libcudart.so` (any version, any
/// folder), or 0. A runtime loaded with `RTLD_LOCAL` (a Python extension module's) is not in
/// the global scope that `RTLD_NEXT` searches, yet the program's calls reach the shim, whose
/// exports come first. The names are gathered by `dl_iterate_phdr` first, then each library
/// is asked through a handle of its own (`RTLD_NOLOAD`: nothing new is opened), outside the
/// loader's lock that `dl_iterate_phdr` holds.
fn in_loaded_runtime(name: &CStr) -> usize {
    unsafe extern "C" fn gather(info: *mut libc::dl_phdr_info, _: usize, data: *mut c_void) -> c_int {
        // SAFETY: glibc passes a valid info whose name is NUL-terminated or null; data is the
        // Vec below.
        let (info, found) = unsafe { (&*info, &mut *data.cast::<Vec<CString>>()) };
        if !info.dlpi_name.is_null() {
            // SAFETY: as above.
            let path = unsafe { CStr::from_ptr(info.dlpi_name) };
            let file = path.to_bytes().rsplit(|&b| b == b'/').next().unwrap_or_default();
            if file.starts_with(b"libcudart.so") {
                found.push(path.to_owned());
            }
        }
        0
    }
    let mut found: Vec<CString> = Vec::new();
    // SAFETY: `gather` matches dl_iterate_phdr's callback and only reads its arguments.
    unsafe { libc::dl_iterate_phdr(Some(gather), (&raw mut found).cast()) };
    for path in found {
        // SAFETY: NUL-terminated strings; RTLD_NOLOAD opens nothing, and the reference taken is
        // given back once the symbol is found (the library stays loaded: the program holds it).
        unsafe {
            let h = libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if h.is_null() {
                continue;
            }
            let f = libc::dlsym(h, name.as_ptr()) as usize;
            libc::dlclose(h);
            if f != 0 {
                return f;
            }
        }
    }
    0
}

/// The real runtime's `$name` (a C string literal) as CUDA's type `$ty`, or `None` ([`next`]).
macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static SLOT: ::std::sync::OnceLock<usize> = ::std::sync::OnceLock::new();
        let f = $crate::real::next($name, &SLOT);
        // SAFETY: a non-null result of dlsym for this CUDA symbol has CUDA's signature.
        (f != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(f) })
    }};
}
pub(crate) use real;
