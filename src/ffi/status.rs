//! Status codes, the thread-local error message, and the panic boundary.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::Error;

/// What a gpupool call did. `GPUPOOL_SUCCESS` is 0; on any other value
/// `gpupool_last_error_message()` says what went wrong, and no output was written.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gpupool_status {
    /// The call did what it was asked.
    GPUPOOL_SUCCESS = 0,
    /// An argument is wrong: a NULL out-pointer, a device out of range, a size that overflows
    /// when rounded, a buffer too small, an unusable `GPUPOOL_*` environment variable.
    GPUPOOL_ERROR_INVALID_VALUE = 1,
    /// The device has no memory for the request, even after gpupool released its cache and
    /// retried (like PyTorch's `OutOfMemoryError`).
    GPUPOOL_ERROR_OUT_OF_MEMORY = 2,
    /// A pointer gpupool did not hand out, a pointer into the middle of a block, or a block
    /// already freed.
    GPUPOOL_ERROR_INVALID_POINTER = 3,
    /// No driver: `libcuda.so.1` is missing, the driver failed to start, or there is no device.
    /// Set `GPUPOOL_DRIVER=sim` to use the simulated device.
    GPUPOOL_ERROR_DRIVER_UNAVAILABLE = 4,
    /// A CUDA driver call failed; the message names the call and CUDA's error.
    GPUPOOL_ERROR_CUDA = 5,
    /// A bug in gpupool (it panicked); the message says where. Please report it.
    GPUPOOL_ERROR_INTERNAL = 6,
}

impl gpupool_status {
    fn of(e: &Error) -> gpupool_status {
        match e {
            Error::InvalidValue(_) => gpupool_status::GPUPOOL_ERROR_INVALID_VALUE,
            Error::OutOfMemory(_) => gpupool_status::GPUPOOL_ERROR_OUT_OF_MEMORY,
            Error::InvalidPointer(_) => gpupool_status::GPUPOOL_ERROR_INVALID_POINTER,
            Error::DriverUnavailable(_) => gpupool_status::GPUPOOL_ERROR_DRIVER_UNAVAILABLE,
            Error::Cuda(_) => gpupool_status::GPUPOOL_ERROR_CUDA,
            Error::Internal(_) => gpupool_status::GPUPOOL_ERROR_INTERNAL,
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// Runs the body of an export: an error becomes its status and this thread's last message; a
/// panic becomes `GPUPOOL_ERROR_INTERNAL`.
pub(crate) fn boundary(call: &str, body: impl FnOnce() -> Result<(), Error>) -> gpupool_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => gpupool_status::GPUPOOL_SUCCESS,
        Ok(Err(e)) => {
            set_last_error(e.message());
            gpupool_status::of(&e)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            set_last_error(&format!("{call}: internal error: gpupool panicked ({what}); please report this"));
            gpupool_status::GPUPOOL_ERROR_INTERNAL
        }
    }
}

/// The message of the last call on this thread that did not return `GPUPOOL_SUCCESS`, or ""
/// if there was none. Successful calls leave it as it was.
///
/// Ownership: the string belongs to gpupool and stays valid until the next failing gpupool
/// call on the same thread; copy it to keep it. Thread-safe: each thread has its own.
#[unsafe(no_mangle)]
pub extern "C" fn gpupool_last_error_message() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"(no message: this thread is exiting)".as_ptr())
}

/// A short description of a status ("success", "out of memory", ...), for any value:
/// an unknown value gives "unknown gpupool_status". Takes a plain `uint32_t`, so a value
/// outside the enum is not undefined behaviour.
///
/// Ownership: a static string; never free it. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn gpupool_status_string(status: u32) -> *const c_char {
    let s = match status {
        0 => c"success",
        1 => c"invalid value",
        2 => c"out of memory",
        3 => c"invalid pointer",
        4 => c"driver unavailable",
        5 => c"CUDA error",
        6 => c"internal error",
        _ => c"unknown gpupool_status",
    };
    s.as_ptr()
}

/// The library's version, "MAJOR.MINOR.PATCH".
///
/// Ownership: a static string; never free it. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn gpupool_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
