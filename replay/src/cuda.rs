//! Replaying on the GPU: gpupool's CUDA driver on device 0, and one real stream
//! (`cuStreamCreate`, non-blocking, in the device's primary context) for each stream of the
//! trace, as `examples/c/bench.c` replays.

use std::sync::Arc;

use cudarc::driver::sys;
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::StreamHandle;
use gpupool::driver::cuda::CudaDriver;

use crate::run::{Outcome, replay};
use crate::trace::Trace;

/// Device 0 of the machine, through gpupool's CUDA driver. Not `Send`: its context is made
/// current on the thread that opened it, which makes the streams and replays.
pub struct Gpu {
    driver: Arc<CudaDriver>,
    context: sys::CUcontext,
}

/// Turns a driver call's status into a message naming the call.
fn check(call: &str, r: sys::CUresult) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(format!("{call} failed with {r:?}")) }
}

impl Gpu {
    /// Starts the CUDA driver (gpupool's, which checks for `libcuda.so.1` and every function it
    /// calls before calling any) and makes device 0's primary context current on this thread,
    /// for the streams.
    ///
    /// Errors: no driver library or no device (the message says so), or a driver call failed.
    pub fn open() -> Result<Gpu, String> {
        let driver = CudaDriver::new().map_err(|e| format!("no GPU to replay on: {e}"))?;
        let mut device = 0;
        let mut context = std::ptr::null_mut();
        // SAFETY: the driver library is loaded and initialised (CudaDriver::new called cuInit and
        // checked these functions); each call writes one value of the type given.
        unsafe {
            check("cuDeviceGet", sys::cuDeviceGet(&mut device, 0))?;
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut context, device))?;
        }
        Ok(Gpu { driver: Arc::new(driver), context })
    }

    /// Replays `trace` under `config` with a fresh allocator over the GPU, on new streams; then
    /// gives the cache back (while the streams still exist: PyTorch 2.11 with expandable
    /// segments dies on a destroyed one, and gpupool synchronises the device, never a stream)
    /// and destroys the streams.
    ///
    /// Errors: a stream cannot be created, or the allocator failed otherwise than out of memory.
    pub fn replay(&self, trace: &Trace, config: &Config) -> Result<Outcome, String> {
        let streams = Streams::create(self.context, trace.streams.len())?;
        let a = Allocator::new(self.driver.clone(), config.clone());
        let outcome = replay(&a, 0, trace, &streams.0).map_err(|e| e.to_string());
        let emptied = a.empty_cache(0).map_err(|e| format!("empty_cache after the replay: {e}"));
        drop(a);
        drop(streams);
        let outcome = outcome?;
        emptied?;
        Ok(outcome)
    }
}

/// Streams created for a replay, synchronised and destroyed when dropped.
struct Streams(Vec<StreamHandle>);

impl Streams {
    fn create(context: sys::CUcontext, n: usize) -> Result<Streams, String> {
        // SAFETY: the context is device 0's primary context, retained by `Gpu::open`.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context) })?;
        let mut streams = Streams(Vec::with_capacity(n));
        for _ in 0..n {
            let mut s: sys::CUstream = std::ptr::null_mut();
            // SAFETY: writes one stream handle; a context is current.
            check("cuStreamCreate", unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            })?;
            streams.0.push(s as StreamHandle);
        }
        Ok(streams)
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        for &s in &self.0 {
            // SAFETY: each handle came from cuStreamCreate and is destroyed once, here; a
            // failure leaves a stream behind, which the process's exit reclaims.
            unsafe {
                let _ = sys::cuStreamSynchronize(s as sys::CUstream);
                let _ = sys::cuStreamDestroy_v2(s as sys::CUstream);
            }
        }
    }
}
