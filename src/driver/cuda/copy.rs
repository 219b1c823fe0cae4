//! Copies between device memory and pinned host memory on streams of gpupool's own
//! (`cuStreamCreate`, `cuStreamDestroy`, `cuStreamSynchronize`, `cuMemcpyDtoHAsync`,
//! `cuMemcpyHtoDAsync`), for `gpupool_sleep` and `gpupool_wake`. Every driver has them, but
//! they are looked up on first use rather than at start ([`COPY_FUNCTIONS`]), so that a partial
//! driver library that never sleeps a pool still starts.

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::loading::{exported, first_missing};
use super::{CudaDriver, DevicePtr, DriverError, HostPtr, StreamHandle, check};
use crate::driver::ops::CopyOps;

/// The driver functions of the copies, checked once, at the first copy stream.
pub(super) const COPY_FUNCTIONS: [&str; 5] =
    ["cuStreamCreate", "cuStreamDestroy_v2", "cuStreamSynchronize", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2"];

/// [`DriverError::Unavailable`] naming the first copy function the library lacks, if any.
fn copy_functions() -> Result<(), DriverError> {
    static MISSING: OnceLock<Option<&'static str>> = OnceLock::new();
    match *MISSING.get_or_init(|| first_missing(&COPY_FUNCTIONS, exported)) {
        None => Ok(()),
        Some(name) => Err(DriverError::Unavailable(format!(
            "the CUDA driver library (libcuda.so.1) lacks {name}, which gpupool_sleep and gpupool_wake copy with"
        ))),
    }
}

impl CopyOps for CudaDriver {
    fn stream_create(&self, device: i32) -> Result<StreamHandle, DriverError> {
        copy_functions()?;
        self.in_context(device, || {
            let mut s: sys::CUstream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: writes one stream handle.
            check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
            Ok(s as StreamHandle)
        })
    }

    fn stream_destroy(&self, device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        copy_functions()?;
        // SAFETY: a stream from stream_create, no longer used by gpupool.
        self.in_context(device, || {
            check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(stream as sys::CUstream) })
        })
    }

    fn stream_synchronize(&self, device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        copy_functions()?;
        // SAFETY: a stream from stream_create.
        self.in_context(device, || {
            check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) })
        })
    }

    fn memcpy_dtoh_async(
        &self,
        device: i32,
        dst: HostPtr,
        src: DevicePtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        copy_functions()?;
        self.in_context(device, || {
            // SAFETY: the caller keeps both ranges valid until the stream has passed the copy.
            check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst as *mut std::ffi::c_void, src, size, stream as sys::CUstream)
            })
        })
    }

    fn memcpy_htod_async(
        &self,
        device: i32,
        dst: DevicePtr,
        src: HostPtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        copy_functions()?;
        self.in_context(device, || {
            // SAFETY: the caller keeps both ranges valid until the stream has passed the copy.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, size, stream as sys::CUstream)
            })
        })
    }
}
