//! The error type of gpupool's Rust API; the C boundary maps each kind to a `gpupool_status`.

use std::fmt;

use crate::driver::DriverError;

/// Why a call failed. Each carries the message the caller is shown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// An argument is wrong: a device out of range, a size that overflows, a NULL out-pointer.
    InvalidValue(String),
    /// The device has no memory for the request even after the cache was released.
    OutOfMemory(String),
    /// A pointer gpupool did not hand out, an interior pointer, or a double free.
    InvalidPointer(String),
    /// No driver: no `libcuda.so.1`, no device, or the simulated device not selected.
    DriverUnavailable(String),
    /// A driver call failed for another reason.
    Cuda(String),
    /// A bug in gpupool (a caught panic, a broken invariant).
    Internal(String),
    /// The request needs a driver call that CUDA forbids while the stream captures a CUDA
    /// graph (a new segment for the default pools); nothing was done and the capture is intact.
    Capture(String),
}

impl Error {
    /// The message, without the kind.
    pub fn message(&self) -> &str {
        match self {
            Error::InvalidValue(m)
            | Error::OutOfMemory(m)
            | Error::InvalidPointer(m)
            | Error::DriverUnavailable(m)
            | Error::Cuda(m)
            | Error::Internal(m)
            | Error::Capture(m) => m,
        }
    }

    /// Wraps a driver failure, saying what gpupool was doing when it happened.
    pub fn driver(e: DriverError, doing: &str) -> Error {
        match e {
            DriverError::OutOfMemory => Error::OutOfMemory(format!("the device is out of memory while {doing}")),
            DriverError::Unavailable(why) => Error::DriverUnavailable(why),
            e @ DriverError::Cuda { .. } => Error::Cuda(format!("{e} while {doing}")),
        }
    }
}

impl Error {
    /// Wraps the failure of a driver call that allocates nothing for the caller (an event
    /// query or wait): the driver running out of memory there is a CUDA error, not the
    /// caller's request failing, so it is never [`Error::OutOfMemory`].
    pub(crate) fn driver_call(e: DriverError, doing: &str) -> Error {
        match e {
            DriverError::OutOfMemory => {
                Error::Cuda(format!("a driver call failed with CUDA_ERROR_OUT_OF_MEMORY while {doing}"))
            }
            e => Error::driver(e, doing),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Error {}

/// The hit path returns its errors boxed, so that its answer fits two registers (see
/// `DeviceAllocator::free_if_listed`); `?` unboxes them where an `Error` is wanted.
impl From<Box<Error>> for Error {
    fn from(e: Box<Error>) -> Error {
        *e
    }
}
