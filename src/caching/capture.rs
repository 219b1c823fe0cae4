//! Knowing whether a CUDA graph capture is under way, at no cost to the cache-hit path.
//!
//! CUDA forbids, while a stream captures, the calls that would break the capture: allocating
//! or freeing device memory from a restricted thread, synchronising the device or the stream,
//! querying an event recorded into the capture. gpupool asks only where it is about to make
//! such a call: before a new segment (a cache miss), before querying the events of
//! `record_stream` frees, and when freeing a block that other streams used. The hit path
//! (malloc and free served from the cache) asks nothing.
//!
//! Two signals, as in PyTorch (`CUDACachingAllocator.cpp`): the routes to private pools
//! active on the device (PyTorch `captures_underway`, set by `beginAllocateToPool`): while any
//! is, no event is queried or recorded for a free; and the capture status of the streams
//! concerned (`cuStreamGetCaptureInfo`, PyTorch `currentStreamCaptureStatusMayInitCtx`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::driver::{CaptureStatus, Driver, StreamHandle};
use crate::error::Error;

/// One device's view of capture: its active routes, and the driver to ask a stream's status.
pub(crate) struct CaptureProbe {
    driver: Arc<dyn Driver>,
    device: i32,
    /// Routes to private pools active on the device (see `device::pools`); malloc reads it
    /// with one relaxed load to know whether to look for a route.
    routes: AtomicUsize,
}

impl CaptureProbe {
    pub fn new(driver: Arc<dyn Driver>, device: i32) -> CaptureProbe {
        CaptureProbe { driver, device, routes: AtomicUsize::new(0) }
    }

    /// How many routes are active: 0 on every path of a program that uses no private pool.
    #[inline(always)]
    pub fn routes(&self) -> usize {
        self.routes.load(Ordering::Relaxed)
    }

    /// Counts a route begun (`+1`) or ended (`-n`); called with the device's pool lock held.
    pub fn set_routes(&self, n: usize) {
        self.routes.store(n, Ordering::Relaxed);
    }

    /// The capture status of `stream` on this device (`cuStreamGetCaptureInfo`).
    ///
    /// Errors: [`Error::Cuda`] when the driver cannot say.
    pub fn status(&self, stream: StreamHandle) -> Result<CaptureStatus, Error> {
        self.driver
            .stream_capture_status(self.device, stream)
            .map_err(|e| Error::driver_call(e, "asking whether the stream captures a CUDA graph"))
    }

    /// Whether a capture may be under way for a free whose block other streams used: a route
    /// is active on the device (PyTorch's test, `captures_underway`), or one of `streams`
    /// captures. Asks the driver only when no route is active.
    pub fn underway(&self, streams: impl IntoIterator<Item = StreamHandle>) -> Result<bool, Error> {
        if self.routes() > 0 {
            return Ok(true);
        }
        for s in streams {
            if self.status(s)?.is_capturing() {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// The message of a request that a stream under capture cannot have: the default pools would
/// need the driver, which CUDA forbids during capture.
pub(crate) fn needs_private_pool(device: i32, stream: StreamHandle, size: usize, status: CaptureStatus) -> Error {
    let state = match status {
        CaptureStatus::Invalidated => "captures a CUDA graph (already invalidated)",
        _ => "captures a CUDA graph",
    };
    Error::Capture(format!(
        "a request of {size} bytes on device {device}, stream {stream:#x}, which {state}, finds no cached block in the \
         default pools, and a new segment (cuMemAlloc) is forbidden during capture; capture needs a private pool \
         (gpupool_begin_allocate_to_pool before the capture begins) or a warm-up run that leaves the blocks cached; \
         the capture was not disturbed"
    ))
}
