//! `dlsym`, interposed, so that a program which opens the driver itself
//! (`dlopen("libcuda.so.1")`, then `dlsym(handle, "cuMemAlloc_v2")`, as XLA, JAX and other
//! runtimes do) gets the shim's functions: a lookup of a driver symbol the shim serves
//! (`driver_api::served_by_name`) that glibc answers with a definition in `libcuda.so*`
//! returns the shim's definition; so does a lookup of a runtime function the shim serves
//! (`runtime_api::served_by_name`) that glibc finds in a `libcudart.so*` (the runtime opened
//! by the program, as XLA's and cuda-python's loaders do). Every other lookup is glibc's,
//! unchanged; `RTLD_DEFAULT` and `RTLD_NEXT` are never answered by the shim (where the shim
//! comes first, they find its definitions anyway).
//!
//! `dlsym` depends on its caller: `RTLD_NEXT` means "the next object after the caller's", and
//! glibc finds the caller from its own return address. So the exported `dlsym` is a naked
//! function that asks [`decide`] (with the caller's return address) whether to answer, and
//! otherwise *jumps* to glibc's `dlsym` with the caller's arguments and return address intact:
//! glibc then sees the program's caller, never the shim, and `RTLD_NEXT` keeps its meaning.
//!
//! The shim's own lookups (cudarc's handle of `libcuda.so`, through which gpupool and the
//! shim's pass-through reach the real driver, and `dlsym(RTLD_NEXT, ...)` for the runtime's
//! functions) come from code inside this library; [`decide`] passes every lookup whose caller
//! lies in this library straight to glibc, so the shim never gets its own functions back
//! where it wants the driver's, and nothing recurses.
//!
//! Only on x86-64 Linux with glibc (the machines gpupool's GPU runs have); elsewhere `dlsym`
//! is not interposed and a program that resolves the driver itself is not served.

use std::ffi::{CStr, c_char, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::lookups;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym`, which the naked `dlsym` jumps to; set by [`real_dlsym`] before [`decide`]
/// returns. Read by the assembly, so a plain pointer-sized static.
static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// The `dlsym` the process would have without the shim. Found with `dlvsym(RTLD_NEXT, "dlsym",
/// version)`: the shim cannot name `dlsym` itself (that is this library's), and `dlvsym` is
/// not interposed. glibc 2.34 moved `dlsym` from `libdl.so.2` into `libc.so.6` with the
/// default version `GLIBC_2.34`, keeping `GLIBC_2.2.5` (x86-64's base version) as an alias of
/// the same function, so `GLIBC_2.34` is asked first and the base version serves glibc before
/// 2.34 (whose `libdl.so.2` Rust's standard library links). No `__libc_dlsym` or `_dl_sym`:
/// those are GLIBC_PRIVATE and changed meaning across releases. Another preloaded library
/// after this one that interposes `dlsym` too is found first, and chained.
fn real_dlsym() -> *mut c_void {
    let known = REAL_DLSYM.load(Ordering::Acquire);
    if !known.is_null() {
        return known;
    }
    let mut found = not_found as DlsymFn as *mut c_void;
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
        // SAFETY: NUL-terminated names; the result is glibc's dlsym or null.
        let f = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !f.is_null() {
            found = f;
            break;
        }
    }
    // Threads racing here all find the same function.
    REAL_DLSYM.store(found, Ordering::Release);
    found
}

/// Stands in for glibc's `dlsym` if it cannot be found (no glibc): every lookup fails.
unsafe extern "C" fn not_found(_: *mut c_void, _: *const c_char) -> *mut c_void {
    null_mut()
}

/// The load address of this library, 0 until known.
static OUR_BASE: AtomicUsize = AtomicUsize::new(0);

/// The load address of the object that holds `addr` (`dladdr`), or 0.
fn object_of(addr: *const c_void) -> usize {
    // SAFETY: Dl_info is plain data; dladdr only reads the loader's tables.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(addr, &mut info) == 0 { 0 } else { info.dli_fbase as usize }
    }
}

/// Whether the code at `caller` belongs to this library (the shim, gpupool, cudarc).
fn is_ours(caller: *const c_void) -> bool {
    let mut base = OUR_BASE.load(Ordering::Relaxed);
    if base == 0 {
        base = object_of(is_ours as fn(*const c_void) -> bool as *const c_void);
        OUR_BASE.store(base, Ordering::Relaxed);
    }
    base != 0 && object_of(caller) == base
}

/// What the exported `dlsym` returns for `dlsym(handle, symbol)` called from `caller`: the
/// shim's function, or null for "ask glibc" (then the naked `dlsym` jumps to
/// [`REAL_DLSYM`], which this function has set). No panic leaves it (`guard`); it never starts
/// gpupool.
extern "C" fn decide(handle: *mut c_void, symbol: *const c_char, caller: *const c_void) -> *mut c_void {
    let real = real_dlsym();
    crate::shim::guard(null_mut(), || {
        if symbol.is_null() || handle.is_null() || handle == libc::RTLD_NEXT {
            return null_mut();
        }
        // SAFETY: dlsym's caller passes a NUL-terminated name (glibc would read it too).
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        // The driver API's names are "cu" and a capital (cuMemAlloc_v2, cuGetProcAddress), the
        // runtime's "cuda" and a capital; other lookups (cuBLAS's cublas*, ...) go to glibc.
        // Whether a lookup is the driver's or the runtime's is glibc's answer's: a definition
        // in a library whose file name starts with libcuda.so or libcudart.so. So a handle of
        // the driver opened by any name or path, and one of a library that links it, are
        // served alike; the handle itself is never looked at (glibc judges it). The runtime
        // has no one soname (libcudart.so.11.0, .12, .13, in a wheel's folder) either.
        let runtime = match name {
            [b'c', b'u', b'd', b'a', c, ..] if c.is_ascii_uppercase() => true,
            [b'c', b'u', c, ..] if c.is_ascii_uppercase() => false,
            _ => return null_mut(),
        };
        // The caller's object (dladdr, which walks the loaded objects) is asked only here.
        if is_ours(caller) {
            return null_mut();
        }
        // SAFETY: glibc's dlsym, with the caller's arguments. Its dlerror state is the
        // answer's when the shim answers: cleared, as after a successful dlsym.
        let theirs = unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(real)(handle, symbol) };
        let (library, ours) = if runtime {
            (&b"libcudart.so"[..], crate::runtime_api::served_by_name(name))
        } else {
            (&b"libcuda.so"[..], crate::driver_api::served_by_name(name))
        };
        if !defined_in(theirs, library) {
            // Not the driver's or the runtime's (or missing: a program probing for a function
            // that too old a driver lacks sees it missing): glibc's answer.
            return null_mut();
        }
        match ours {
            Some(ours) => {
                crate::shim::bump(&lookups::SERVED);
                ours
            }
            None => {
                // Runtime lookups the shim does not serve are not counted: only the driver's.
                if !runtime {
                    crate::shim::bump(&lookups::PASSED);
                }
                // A memory function the shim does not serve: glibc's answer behind a
                // trampoline that counts its calls (passed.rs); anything else: glibc's.
                let counted = crate::passed::wrap(name, theirs);
                if counted == theirs { null_mut() } else { counted }
            }
        }
    })
}

/// Whether `f` (null, or an address glibc's dlsym gave) lies in a library whose file name
/// starts with `prefix`.
fn defined_in(f: *mut c_void, prefix: &[u8]) -> bool {
    if f.is_null() {
        return false;
    }
    // SAFETY: Dl_info is plain data; dladdr only reads the loader's tables, and its file name
    // is NUL-terminated while the library is loaded (it holds `f`).
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(f, &mut info) == 0 || info.dli_fname.is_null() {
            return false;
        }
        let path = CStr::from_ptr(info.dli_fname).to_bytes();
        path.rsplit(|&b| b == b'/').next().is_some_and(|file| file.starts_with(prefix))
    }
}

/// `void *dlsym(void *handle, const char *symbol)`, as glibc's (which answers every lookup
/// the shim does not, with the caller's return address, so `RTLD_NEXT` and `dlerror` behave
/// as without the shim), except that a driver or runtime function the shim serves, which
/// glibc finds in `libcuda.so*` or `libcudart.so*`, gives the shim's function. Thread-safe,
/// as glibc's.
///
/// # Safety
/// As glibc's `dlsym`: `symbol` is NUL-terminated, `handle` is `RTLD_DEFAULT`, `RTLD_NEXT` or
/// a handle `dlopen` returned and `dlclose` has not closed.
///
/// Not exported from the crate's own unit-test binary: there, nothing needs it, and a
/// sanitizer's runtime (AddressSanitizer's interceptors, set up before `main`) would resolve
/// its functions through it before anything of the shim can run (SIGSEGV). The C tests
/// (`tests/c/test_preload_dlopen.c`) test the exported one, in `libgpupool_preload.so`.
#[unsafe(naked)]
#[cfg_attr(not(test), unsafe(no_mangle))]
#[cfg_attr(test, allow(dead_code))]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // On entry rsp is 8 mod 16 (the return address); two pushes and 8 bytes make it 0 mod 16
    // for the call, as the ABI wants. decide(handle, symbol, return address) in rdi, rsi, rdx.
    // The CFI lines describe the frame, so that debuggers, profilers and unwinders walk
    // through this function (rustc writes none for a naked one).
    core::arch::naked_asm!(
        ".cfi_startproc",
        "push rdi",
        ".cfi_adjust_cfa_offset 8",
        "push rsi",
        ".cfi_adjust_cfa_offset 8",
        "sub rsp, 8",
        ".cfi_adjust_cfa_offset 8",
        "mov rdx, qword ptr [rsp + 24]",
        "call {decide}",
        "add rsp, 8",
        ".cfi_adjust_cfa_offset -8",
        "pop rsi",
        ".cfi_adjust_cfa_offset -8",
        "pop rdi",
        ".cfi_adjust_cfa_offset -8",
        "test rax, rax",
        "jz 2f",
        "ret",
        // glibc's dlsym, entered as if the program had called it.
        "2:",
        "jmp qword ptr [rip + {real}]",
        ".cfi_endproc",
        decide = sym decide,
        real = sym REAL_DLSYM,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibcs_dlsym_is_found_and_answers() {
        let real = real_dlsym();
        assert!(!real.is_null() && real != not_found as DlsymFn as *mut c_void);
        // SAFETY: glibc's dlsym with a NUL-terminated name.
        let f = unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(real)(libc::RTLD_DEFAULT, c"malloc".as_ptr()) };
        assert!(!f.is_null());
    }

    #[test]
    fn lookups_that_are_not_in_libcudas_handle_are_left_to_glibc() {
        // libc's code, not this object's: a function no sanitizer intercepts (under
        // AddressSanitizer `malloc` is the interceptor linked into the test binary).
        let foreign = libc::gnu_get_libc_version as *const c_void;
        assert!(!is_ours(foreign));
        assert!(is_ours(decide as *const c_void));
        for handle in [libc::RTLD_DEFAULT, libc::RTLD_NEXT] {
            assert!(decide(handle, c"cuMemAlloc_v2".as_ptr(), foreign).is_null());
        }
        // No libcuda.so is loaded in the test process: nothing is the driver's.
        // SAFETY: opens this process's own handle, closed again.
        let me = unsafe { libc::dlopen(std::ptr::null(), libc::RTLD_NOW) };
        assert!(!defined_in(foreign as *mut c_void, b"libcuda.so"));
        assert!(defined_in(foreign as *mut c_void, b"libc.so"));
        assert!(decide(me, c"cuMemAlloc_v2".as_ptr(), foreign).is_null());
        assert!(decide(me, std::ptr::null(), foreign).is_null());
        // SAFETY: the handle opened above.
        unsafe { libc::dlclose(me) };
    }
}
