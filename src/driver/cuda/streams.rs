//! Events, synchronisation and stream capture: the event calls, `cuCtxSynchronize`, and a
//! stream's capture status and the thread's capture mode (answered as "not capturing" by a
//! driver without the capture functions).

use cudarc::driver::sys;

use super::{CaptureMode, CaptureStatus, CudaDriver, DriverError, EventHandle, StreamHandle, check};
use crate::driver::ops::StreamOps;

impl StreamOps for CudaDriver {
    fn event_create(&self, device: i32) -> Result<EventHandle, DriverError> {
        self.in_context(device, || {
            let mut ev: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            // SAFETY: writes one event handle.
            check("cuEventCreate", unsafe { sys::cuEventCreate(&mut ev, flags) })?;
            Ok(EventHandle(ev as u64))
        })
    }

    fn event_record(&self, device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        self.in_context(device, || {
            // SAFETY: the event came from event_create; the stream is the caller's handle.
            check("cuEventRecord", unsafe { sys::cuEventRecord(event.0 as sys::CUevent, stream as sys::CUstream) })
        })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        // SAFETY: the event came from event_create.
        let r = unsafe { sys::cuEventQuery(event.0 as sys::CUevent) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|_| true)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: the event came from event_create.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) })
    }

    fn event_destroy(&self, device: i32, event: EventHandle) {
        // SAFETY: the event came from event_create and is no longer used. A failure leaks one
        // event and needs no report.
        let _ = self
            .in_context(device, || check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) }));
    }

    fn device_synchronize(&self, device: i32) -> Result<(), DriverError> {
        // SAFETY: no arguments; runs in the device's primary context.
        self.in_context(device, || check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }))
    }

    /// In the device's primary context, where the legacy default stream (0) is the one the
    /// runtime API's kernels use.
    fn stream_capture_status(&self, device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        if !self.capture {
            return Ok(CaptureStatus::None);
        }
        self.in_context(device, || {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            let mut id: sys::cuuint64_t = 0;
            // SAFETY: writes the status and the id; the graph and dependency outputs are
            // optional (NULL). The stream is the caller's handle.
            check("cuStreamGetCaptureInfo", unsafe {
                sys::cuStreamGetCaptureInfo_v2(
                    stream as sys::CUstream,
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            })?;
            Ok(capture_status(status, id))
        })
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        if !self.capture {
            return Ok(mode);
        }
        let mut m = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: reads and writes one mode; affects the calling thread only.
        check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) })?;
        Ok(match m {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }
}

/// The status `cuStreamGetCaptureInfo` wrote, with the capture's id when active.
pub(super) fn capture_status(status: sys::CUstreamCaptureStatus, id: u64) -> CaptureStatus {
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active(id),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated,
    }
}
