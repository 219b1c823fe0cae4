//! The C boundary. `include/gpupool.h` is generated from this module by cbindgen; every doc
//! comment here is the C user's manual.
//!
//! Rules every export follows (after rustls-ffi):
//! - Every call returns a `gpupool_status`; outputs go through out-pointers and are written
//!   only on success.
//! - The body runs inside [`status::boundary`], which turns an error into its status and a
//!   thread-local message (`gpupool_last_error_message`) and a panic into
//!   `GPUPOOL_ERROR_INTERNAL`: no panic crosses into C.
//! - The process-wide allocator starts on the first call that needs it, with the driver
//!   `GPUPOOL_DRIVER` names; if that fails, every such call returns the same status and
//!   message.

pub mod memory;
pub mod sim;
pub mod stats;
pub mod status;
pub mod torch;

use std::sync::{Arc, OnceLock};

use crate::Allocator;
use crate::config::Config;
use crate::driver::sim::SimDriver;
use crate::error::Error;

/// An opaque CUDA stream (`struct CUstream_st`, as `cuda.h` and `cuda_runtime_api.h` declare
/// it), so that `cudaStream_t` and `CUstream` convert to [`gpupool_stream_t`] without a cast.
/// Declared, never defined: gpupool only passes the handle on.
#[allow(non_camel_case_types)]
pub struct CUstream_st {
    _private: [u8; 0],
}

/// A CUDA stream handle: `cudaStream_t` and `CUstream` pass as they are. NULL (0) is the
/// legacy default stream. gpupool tells streams apart by handle value, as PyTorch does; a
/// destroyed stream's handle reused for a new stream names the same pools.
#[allow(non_camel_case_types)]
pub type gpupool_stream_t = *mut CUstream_st;

pub(crate) struct Runtime {
    pub allocator: Allocator,
    pub sim: Option<Arc<SimDriver>>,
}

static RUNTIME: OnceLock<Result<Runtime, Error>> = OnceLock::new();

/// The process-wide allocator behind the C API, started on first use from the `GPUPOOL_*`
/// variables. For Rust code in the same process that must share it with C callers (the
/// LD_PRELOAD shim): what it allocates, `gpupool_stats` counts.
///
/// Errors: the error the first start failed with ([`Error::DriverUnavailable`], or
/// [`Error::InvalidValue`] for a bad variable), every time.
pub fn process_allocator() -> Result<&'static Allocator, Error> {
    runtime().map(|rt| &rt.allocator)
}

/// The process-wide allocator, started on first use from the `GPUPOOL_*` variables.
pub(crate) fn runtime() -> Result<&'static Runtime, Error> {
    // Before the first lock: in a forked child, the parent's start may be half done.
    crate::caching::fork::check()?;
    let rt = RUNTIME.get_or_init(|| {
        let config = Config::from_env()?;
        let (allocator, sim) = Allocator::from_config(config)?;
        Ok(Runtime { allocator, sim })
    });
    rt.as_ref().map_err(Clone::clone)
}
