//! Status codes, the thread-local error message, the panic boundary and the out-pointer check.
//!
//! Only this module writes the message a C caller reads, and it alone puts the C function's
//! name in front of it: the core's errors say what went wrong, not which export was called.

use std::cell::RefCell;
use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;

use crate::error::Error;

/// What a gpupool call did. `GPUPOOL_SUCCESS` is 0; on any other value
/// `gpupool_last_error_message()` says what went wrong, and no output was written (the
/// exceptions: `gpupool_memory_summary` and `gpupool_config_string` write `*needed` when the
/// buffer is too small).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gpupool_status {
    /// The call did what it was asked.
    GPUPOOL_SUCCESS = 0,
    /// An argument is wrong: a NULL out-pointer, a device out of range, a size that overflows
    /// when rounded, a buffer too small, an unusable `GPUPOOL_*` environment variable, a
    /// configuration string with an unknown key or a bad value; also `gpupool_set_config`
    /// after a device has started.
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
    /// The stream captures a CUDA graph and the request needs what CUDA forbids during capture:
    /// no cached block of the default pools fits, and a new segment (`cuMemAlloc`) would break
    /// the capture. Nothing was done and the capture is intact. Route the stream's allocations
    /// to a private pool (`gpupool_begin_allocate_to_pool`) or warm up (run the work once
    /// before capturing, so that its blocks are cached).
    GPUPOOL_ERROR_STREAM_CAPTURE = 7,
}

impl gpupool_status {
    /// Every status, for [`gpupool_status::from_u32`]; the test below checks it against the
    /// variants' values.
    const ALL: [gpupool_status; 8] = [
        gpupool_status::GPUPOOL_SUCCESS,
        gpupool_status::GPUPOOL_ERROR_INVALID_VALUE,
        gpupool_status::GPUPOOL_ERROR_OUT_OF_MEMORY,
        gpupool_status::GPUPOOL_ERROR_INVALID_POINTER,
        gpupool_status::GPUPOOL_ERROR_DRIVER_UNAVAILABLE,
        gpupool_status::GPUPOOL_ERROR_CUDA,
        gpupool_status::GPUPOOL_ERROR_INTERNAL,
        gpupool_status::GPUPOOL_ERROR_STREAM_CAPTURE,
    ];

    /// The status whose value is `value`, if there is one: C passes any `uint32_t`, and a
    /// Rust enum must never hold a value outside its variants.
    pub fn from_u32(value: u32) -> Option<gpupool_status> {
        Self::ALL.into_iter().find(|s| *s as u32 == value)
    }

    /// What [`gpupool_status_string`] says of this status.
    pub fn description(self) -> &'static CStr {
        match self {
            gpupool_status::GPUPOOL_SUCCESS => c"success",
            gpupool_status::GPUPOOL_ERROR_INVALID_VALUE => c"invalid value",
            gpupool_status::GPUPOOL_ERROR_OUT_OF_MEMORY => c"out of memory",
            gpupool_status::GPUPOOL_ERROR_INVALID_POINTER => c"invalid pointer",
            gpupool_status::GPUPOOL_ERROR_DRIVER_UNAVAILABLE => c"driver unavailable",
            gpupool_status::GPUPOOL_ERROR_CUDA => c"CUDA error",
            gpupool_status::GPUPOOL_ERROR_INTERNAL => c"internal error",
            gpupool_status::GPUPOOL_ERROR_STREAM_CAPTURE => c"not allowed during stream capture",
        }
    }

    fn of(e: &Error) -> gpupool_status {
        match e {
            Error::InvalidValue(_) => gpupool_status::GPUPOOL_ERROR_INVALID_VALUE,
            Error::OutOfMemory(_) => gpupool_status::GPUPOOL_ERROR_OUT_OF_MEMORY,
            Error::InvalidPointer(_) => gpupool_status::GPUPOOL_ERROR_INVALID_POINTER,
            Error::DriverUnavailable(_) => gpupool_status::GPUPOOL_ERROR_DRIVER_UNAVAILABLE,
            Error::Cuda(_) => gpupool_status::GPUPOOL_ERROR_CUDA,
            Error::Internal(_) => gpupool_status::GPUPOOL_ERROR_INTERNAL,
            Error::Capture(_) => gpupool_status::GPUPOOL_ERROR_STREAM_CAPTURE,
        }
    }
}

/// Bytes kept of a message, its NUL included; `gpupool_last_error_message`'s doc states it.
/// PyTorch's out-of-memory text, the longest gpupool writes, is about 600 bytes.
const MESSAGE_CAPACITY: usize = 1024;
const TRUNCATED: &str = "...";

thread_local! {
    // A byte array, initialised at compile time: it needs no destructor, so the first failing
    // call of a thread registers nothing and allocates nothing. A `CString` here registered a
    // TLS destructor on first use, and leaked when that use came from a pthread-key destructor,
    // which glibc runs after the thread's TLS destructors.
    static LAST_ERROR: RefCell<[u8; MESSAGE_CAPACITY]> = const { RefCell::new([0; MESSAGE_CAPACITY]) };
}

/// Stores `parts`, concatenated, as this thread's message: NUL bytes become spaces, and a
/// message longer than `MESSAGE_CAPACITY - 1` bytes is cut at a character boundary and ends
/// with "...".
fn set_last_error(parts: &[&str]) {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let room = MESSAGE_CAPACITY - 1;
    let budget = if total > room { room - TRUNCATED.len() } else { total };
    LAST_ERROR.with_borrow_mut(|buf| {
        let mut len = 0;
        for part in parts {
            let mut take = part.len().min(budget - len);
            while !part.is_char_boundary(take) {
                take -= 1;
            }
            for (dst, &src) in buf[len..len + take].iter_mut().zip(part.as_bytes()) {
                *dst = if src == 0 { b' ' } else { src };
            }
            len += take;
            if take < part.len() {
                buf[len..len + TRUNCATED.len()].copy_from_slice(TRUNCATED.as_bytes());
                len += TRUNCATED.len();
                break;
            }
        }
        buf[len] = 0;
    });
}

/// Runs the body of the export `call`: an error becomes its status and this thread's last
/// message, `"{call}: {what went wrong}"`; a panic becomes `GPUPOOL_ERROR_INTERNAL`. No panic
/// leaves this function, so none crosses into C.
///
/// The thread's end (`pthread_exit`, or cancellation) inside a callback of the call goes on
/// once the call is done, out of the export (`crate::callout`), which must therefore be
/// `extern "C-unwind"`; meanwhile cancellation is disabled in gpupool's own code, which
/// reaches cancellation points that an unwind must not cross ([`crate::callout::Entry`]).
pub(crate) fn boundary(call: &str, body: impl FnOnce() -> Result<(), Error>) -> gpupool_status {
    let entry = crate::callout::Entry::enter();
    let status = guarded(call, body);
    drop(entry);
    if crate::callout::exiting() {
        crate::callout::continue_exit();
    }
    status
}

/// [`boundary`] for an export whose body is the hit path's malloc (PyTorch's, CuPy's and ONNX
/// Runtime's hooks), which pays nothing for a thread's end: the hit path makes no callout, and
/// its cold paths end their call with the panic that carries the end ([`failed`] and
/// [`panicked`] go on with it).
#[inline(always)]
pub(crate) fn boundary_hot(call: &str, body: impl FnOnce() -> Result<(), Error>) -> gpupool_status {
    guarded(call, body)
}

/// [`boundary_hot`] for the hit path's bodies, whose errors are boxed (see
/// `Allocator::malloc_in_parent`).
#[inline(always)]
pub(crate) fn boundary_boxed(call: &str, body: impl FnOnce() -> Result<(), Box<Error>>) -> gpupool_status {
    guarded(call, body)
}

#[inline(always)]
fn guarded<E: std::borrow::Borrow<Error>>(call: &str, body: impl FnOnce() -> Result<(), E>) -> gpupool_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => gpupool_status::GPUPOOL_SUCCESS,
        Ok(Err(e)) => failed(call, e.borrow()),
        Err(payload) => panicked(call, payload),
    }
}

/// The status of an export that failed with `e`, its message this thread's last.
#[cold]
#[inline(never)]
fn failed(call: &str, e: &Error) -> gpupool_status {
    // The call failed after its thread's end was stopped in a callback (an out-of-memory
    // observer that called pthread_exit): the end goes on.
    if crate::callout::exiting() {
        crate::callout::continue_exit();
    }
    set_last_error(&[call, ": ", e.message()]);
    gpupool_status::of(e)
}

/// The status of an export that panicked.
#[cold]
#[inline(never)]
fn panicked(call: &str, payload: Box<dyn std::any::Any + Send>) -> gpupool_status {
    // The panic that carries a thread's end out of a complete call (`crate::callout`): no bug.
    if super::is_thread_exit(&*payload) {
        drop(payload);
        crate::callout::continue_exit();
    }
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message");
    set_last_error(&[call, ": internal error: gpupool panicked (", what, "); please report this"]);
    gpupool_status::GPUPOOL_ERROR_INTERNAL
}

/// A caller's out-pointer that [`out_ptr`] found non-NULL.
pub(crate) struct Out<T>(NonNull<T>);

impl<T> Out<T> {
    /// Writes `value` through the caller's pointer.
    ///
    /// # Safety
    /// The pointer must be valid for a write of one aligned `T`, as every export that takes an
    /// out-pointer requires of its caller.
    pub(crate) unsafe fn write(self, value: T) {
        // SAFETY: non-NULL (checked by `out_ptr`) and writable per this function's contract.
        unsafe { self.0.as_ptr().write(value) }
    }

    /// The pointer, for an export that reads its argument before writing it.
    pub(crate) fn as_ptr(&self) -> *mut T {
        self.0.as_ptr()
    }
}

/// Checks the out-pointer argument `arg` of an export: NULL is `InvalidValue`, naming `arg`
/// (the boundary adds the export's name). Checked before anything else, so that a NULL
/// changes nothing.
/// Inlined, with the error out of line: the hit path's exports check their out-pointer first,
/// and building the error's closure there cost three instructions a call (callgrind,
/// `tests/c/hit_loop.c`).
#[inline(always)]
pub(crate) fn out_ptr<T>(ptr: *mut T, arg: &str) -> Result<Out<T>, Error> {
    match NonNull::new(ptr) {
        Some(p) => Ok(Out(p)),
        None => Err(null_out(arg)),
    }
}

#[cold]
#[inline(never)]
fn null_out(arg: &str) -> Error {
    Error::InvalidValue(format!("{arg} is NULL; it must point to storage for the result"))
}

/// Writes `text` for an export with snprintf's two-call convention: `*needed` (when not NULL)
/// gets the bytes the text takes with its NUL, written even when the buffer is too small; then
/// the NUL-terminated text goes to `buf` (when not NULL) if `len` holds it. `what` names the
/// text in the error.
///
/// Errors: [`Error::InvalidValue`] when `len` is too small (the buffer is untouched).
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes; `needed` NULL or writable.
pub(crate) unsafe fn write_text(
    text: &str,
    what: &str,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> Result<(), Error> {
    let n = text.len() + 1;
    if !needed.is_null() {
        // SAFETY: non-NULL, caller-owned. Written before the length check, on purpose.
        unsafe { *needed = n };
    }
    if !buf.is_null() {
        if len < n {
            return Err(Error::InvalidValue(format!("the buffer has {len} bytes but the {what} needs {n}")));
        }
        // SAFETY: the caller's buffer holds `len >= n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
            *buf.add(text.len()) = 0;
        }
    }
    Ok(())
}

/// --------------------------------------------------------------------------------------------
/// Errors
/// --------------------------------------------------------------------------------------------
///
/// Every function of this header returns a `gpupool_status` but the three below, which return
/// strings. On failure, `gpupool_last_error_message()` of the calling thread says why, starting
/// with the function's name, and no output was written (except `*needed` of
/// `gpupool_memory_summary` and `gpupool_config_string`). No panic crosses into C: a bug in gpupool
/// is `GPUPOOL_ERROR_INTERNAL`.
///
/// --------------------------------------------------------------------------------------------
///
/// The message of the last call on this thread that did not return `GPUPOOL_SUCCESS`,
/// `"<function>: <what went wrong>"`, or "" if there was none. Successful calls leave it as it
/// was. At most 1023 bytes: a longer message is cut at a UTF-8 character boundary and ends
/// with "...".
///
/// Ownership: the string belongs to gpupool and stays valid until the next failing gpupool
/// call on the same thread, or the thread's exit; copy it to keep it. Thread-safe: each
/// thread has its own, which costs no allocation and no exit handler, so gpupool may be
/// called from any thread at any time, including from pthread-key destructors.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_last_error_message() -> *const c_char {
    LAST_ERROR.with(|e| e.as_ptr().cast())
}

/// A short description of a status ("success", "out of memory", ...), for any value:
/// an unknown value gives "unknown gpupool_status". Takes a plain `uint32_t`, so a value
/// outside the enum is not undefined behaviour.
///
/// Ownership: a static string; never free it. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_status_string(status: u32) -> *const c_char {
    gpupool_status::from_u32(status).map_or(c"unknown gpupool_status", gpupool_status::description).as_ptr()
}

/// The library's version, "MAJOR.MINOR.PATCH".
///
/// Ownership: a static string; never free it. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: the buffer is always NUL-terminated.
        unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_str().unwrap().to_owned()
    }

    #[test]
    fn from_u32_knows_every_status_and_nothing_else() {
        for (i, s) in gpupool_status::ALL.into_iter().enumerate() {
            assert_eq!(s as u32, i as u32, "ALL is in value order, without gaps");
            assert_eq!(gpupool_status::from_u32(i as u32), Some(s));
        }
        let next = gpupool_status::ALL.len() as u32;
        assert_eq!(gpupool_status::from_u32(next), None);
        assert_eq!(gpupool_status::from_u32(u32::MAX), None);
        // A variant missing from ALL would make `of` return a status that from_u32 cannot name.
        for e in [
            Error::InvalidValue(String::new()),
            Error::OutOfMemory(String::new()),
            Error::InvalidPointer(String::new()),
            Error::DriverUnavailable(String::new()),
            Error::Cuda(String::new()),
            Error::Internal(String::new()),
        ] {
            let s = gpupool_status::of(&e);
            assert_eq!(gpupool_status::from_u32(s as u32), Some(s));
        }
    }

    #[test]
    fn boundary_names_the_call() {
        let s = boundary("gpupool_test", || Err(Error::InvalidPointer("pointer 0x10 is not ours".into())));
        assert_eq!(s, gpupool_status::GPUPOOL_ERROR_INVALID_POINTER);
        assert_eq!(last(), "gpupool_test: pointer 0x10 is not ours");
        assert_eq!(boundary("gpupool_test", || Ok(())), gpupool_status::GPUPOOL_SUCCESS);
        assert_eq!(last(), "gpupool_test: pointer 0x10 is not ours", "success leaves the message");
        let s = boundary("gpupool_test", || panic!("broken invariant"));
        assert_eq!(s, gpupool_status::GPUPOOL_ERROR_INTERNAL);
        assert!(last().starts_with("gpupool_test: internal error: gpupool panicked (broken invariant)"));
        // Cancellation is disabled during the call, and restored after it.
        let outside = crate::callout::disable_cancel();
        crate::callout::restore_cancel(outside);
        let mut during = outside;
        boundary("gpupool_test", || {
            during = crate::callout::disable_cancel();
            crate::callout::restore_cancel(during);
            Ok(())
        });
        assert_ne!(during, outside);
        let after = crate::callout::disable_cancel();
        crate::callout::restore_cancel(after);
        assert_eq!(after, outside);
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        // 'é' is two bytes: an odd prefix puts every cut position inside a character once.
        for pad in 0..2 {
            let long = format!("{}{}", "x".repeat(pad), "é".repeat(MESSAGE_CAPACITY));
            set_last_error(&["gpupool_test", ": ", &long]);
            let m = last();
            assert!(m.len() < MESSAGE_CAPACITY);
            assert!(m.len() >= MESSAGE_CAPACITY - 1 - TRUNCATED.len() - 1);
            assert!(m.starts_with("gpupool_test: "));
            assert!(m.ends_with("é..."), "{m}");
        }
        let exact = "y".repeat(MESSAGE_CAPACITY - 1);
        set_last_error(&[&exact]);
        assert_eq!(last(), exact, "a message that fits is kept whole");
        set_last_error(&["a\0b"]);
        assert_eq!(last(), "a b");
    }
}
