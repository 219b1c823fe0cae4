//! Knowing whether a CUDA graph capture is under way, at no cost to the cache-hit path.
//!
//! CUDA forbids, while a stream captures, the calls that would break the capture: allocating
//! or freeing device memory from a restricted thread, synchronising the device or the stream,
//! querying an event recorded into the capture. gpupool asks only where it is about to make
//! such a call: before a new segment (a cache miss), before querying the events of
//! `record_stream` frees, and when freeing a block that other streams used. The hit path
//! (malloc and free served from the cache) asks nothing.
//!
//! Two signals, as in PyTorch (`CUDACachingAllocator.cpp`): the routes to private pools by
//! stream or filter active on the device (PyTorch `captures_underway`, set by
//! `beginAllocateToPool`): while any is, no event is queried or recorded for a free, nothing
//! is given back to the driver or synchronised, and new segments are made with the thread's
//! capture mode relaxed; and the capture status of a stream gpupool is about to use
//! (`cuStreamGetCaptureInfo`, PyTorch `currentStreamCaptureStatusMayInitCtx`): the allocating
//! stream at a cache miss, and the streams of `record_stream` when their events are recorded.
//! Only streams the program is using at that moment are asked: `cuStreamGetCaptureInfo` on a
//! stream the program has destroyed crashes inside libcuda (seen on an H100 with driver 580),
//! so a capture gpupool found but no route announced is not remembered and asked about later.
//! As in PyTorch, such a capture in global mode is broken by another thread's cache miss
//! (`cuMemAlloc`) or `empty_cache`: capture through a private pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::driver::{CaptureStatus, Driver, StreamHandle};
use crate::error::Error;

/// One device's view of capture: its active routes, and the driver to ask a stream's status.
pub(crate) struct CaptureProbe {
    driver: Arc<dyn Driver>,
    device: i32,
    /// Routes to private pools active on the device (see `caching::pools`), plus one while the
    /// default pools sleep (`caching::sleep`); malloc reads it with one relaxed load to know
    /// whether to look for a route (and so finds, at no cost to the hit path, that the default
    /// pools refuse it).
    routes: AtomicUsize,
    /// The routes alone, and whether the default pools sleep; written under `writer`.
    routed: AtomicUsize,
    default_asleep: AtomicBool,
    writer: Mutex<()>,
    /// Of those, the routes by stream or by filter: `torch.cuda.graph`'s, made for a capture.
    /// A route by thread (`use_mem_pool`) is not.
    capture_routes: AtomicUsize,
}

impl CaptureProbe {
    pub fn new(driver: Arc<dyn Driver>, device: i32) -> CaptureProbe {
        CaptureProbe {
            driver,
            device,
            routes: AtomicUsize::new(0),
            capture_routes: AtomicUsize::new(0),
            routed: AtomicUsize::new(0),
            default_asleep: AtomicBool::new(false),
            writer: Mutex::new(()),
        }
    }

    /// How many routes are active: 0 on every path of a program that uses no private pool.
    #[inline(always)]
    pub fn routes(&self) -> usize {
        self.routes.load(Ordering::Relaxed)
    }

    /// Whether a route by stream or filter (made for a capture) is active.
    #[inline]
    pub fn capture_routed(&self) -> bool {
        self.capture_routes.load(Ordering::Relaxed) > 0
    }

    /// Sets the count of active routes, and of those made for a capture; called with the
    /// device's pool lock held.
    pub fn set_routes(&self, all: usize, for_capture: usize) {
        let _w = self.writer.lock();
        self.routed.store(all, Ordering::Relaxed);
        let asleep = self.default_asleep.load(Ordering::Relaxed) as usize;
        self.routes.store(all + asleep, Ordering::Relaxed);
        self.capture_routes.store(for_capture, Ordering::Relaxed);
    }

    /// Routes to private pools active now (without the default pools' sleep).
    pub fn routed(&self) -> usize {
        self.routed.load(Ordering::Relaxed)
    }

    /// Sets whether the default pools sleep: while they do, every allocation looks for a
    /// route, and one that no route takes is refused (see `pools::device::route_for`).
    pub fn set_default_asleep(&self, asleep: bool) {
        let _w = self.writer.lock();
        self.default_asleep.store(asleep, Ordering::Relaxed);
        self.routes.store(self.routed.load(Ordering::Relaxed) + asleep as usize, Ordering::Relaxed);
    }

    /// Whether the default pools sleep.
    pub fn default_asleep(&self) -> bool {
        self.default_asleep.load(Ordering::Relaxed)
    }

    /// The capture status of `stream` on this device (`cuStreamGetCaptureInfo`). `stream`
    /// must be one the program is using now (see the module).
    ///
    /// Errors: [`Error::Cuda`] when the driver cannot say.
    pub fn status(&self, stream: StreamHandle) -> Result<CaptureStatus, Error> {
        self.driver
            .stream_capture_status(self.device, stream)
            .map_err(|e| Error::driver_call(e, "asking whether the stream captures a CUDA graph"))
    }

    /// Whether a capture may be under way on the device as far as gpupool knows: a route by
    /// stream or filter is active (PyTorch's `captures_underway`). Asked before giving memory
    /// back to the driver, synchronising, or making a segment.
    pub fn any_underway(&self) -> bool {
        self.capture_routed()
    }

    /// Runs `f` with the calling thread's capture mode relaxed when a capture may be under
    /// way (see [`CaptureProbe::any_underway`]), so that the driver call it makes (a new
    /// segment) breaks no capture of another stream or thread; as PyTorch's
    /// `cudaMallocMaybeCapturing` does for the capturing stream.
    pub fn relaxed_if_underway<R>(
        &self,
        underway: bool,
        f: impl FnOnce() -> Result<R, crate::driver::DriverError>,
    ) -> Result<R, crate::driver::DriverError> {
        if !underway {
            return f();
        }
        let old = self.driver.exchange_capture_mode(crate::driver::CaptureMode::Relaxed)?;
        let _restore = scopeguard::guard((), |()| {
            let _ = self.driver.exchange_capture_mode(old);
        });
        f()
    }

    /// Whether a capture may be under way for a free whose block other streams used: a route
    /// by stream or filter is active on the device (PyTorch's test, `captures_underway`, but for
    /// the routes by thread of `use_mem_pool`, which capture nothing: deferring every
    /// `record_stream` free of the device while one lasts would hold their memory back), or
    /// one of `streams` captures. Asks the driver only when no such route is active;
    /// `streams` are those whose events are about to be recorded, so alive.
    pub fn underway(&self, streams: impl IntoIterator<Item = StreamHandle>) -> bool {
        if self.capture_routed() {
            return true;
        }
        streams.into_iter().any(|s| matches!(self.status(s), Ok(st) if st.is_capturing()))
    }
}

/// The error of a call that would synchronise or give memory back to the driver while a capture
/// may be under way: `doing` says what was asked.
pub(crate) fn refused_during_capture(device: i32, doing: &str) -> Error {
    Error::Capture(format!(
        "{doing} on device {device} would synchronise the device or give memory back to the driver while a CUDA \
         graph capture may be under way there (a route to a private pool by stream or filter is active), which would break the capture; nothing was done: call it once the capture and \
         gpupool_end_allocate_to_pool are done"
    ))
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
