//! Stream capture (CUDA graphs): the captures a test begins and ends, the calling thread's
//! capture mode, and CUDA's rules for the calls it forbids while a stream captures (which
//! fail with CUDA's codes and invalidate the capture). The driver calls that read them
//! (`stream_capture_status`, `exchange_capture_mode`) are in `streams`, with the other calls of
//! [`StreamOps`](crate::driver::ops::StreamOps).

use std::cell::Cell;

use super::{CaptureMode, CaptureStatus, DriverError, EventHandle, SimDriver, State, StreamHandle};

/// A capture under way on a stream.
pub(super) struct Capture {
    pub(super) id: u64,
    pub(super) stream: StreamHandle,
    mode: CaptureMode,
    /// The thread that began it (CUDA's "local thread" of the capture).
    thread: std::thread::ThreadId,
    /// Cleared by a forbidden call; [`SimDriver::end_capture`] then reports the capture
    /// failed.
    pub(super) valid: bool,
}

/// What CUDA answers a call it forbids during capture.
fn capture_unsupported(call: &'static str) -> DriverError {
    DriverError::Cuda { call, code: 900, name: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED".into() }
}

thread_local! {
    /// The thread's capture mode (`cuThreadExchangeStreamCaptureMode`); CUDA starts every
    /// thread in global mode.
    pub(super) static THREAD_CAPTURE_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

impl State {
    /// CUDA's rule for a "potentially unsafe" call (`cuMemAlloc`, `cuMemFree`, the virtual
    /// memory calls) made by the calling thread, from `cudaThreadExchangeStreamCaptureMode`:
    /// in global mode, the thread may not make one while a capture it began (not relaxed) is
    /// under way, nor while another thread's global-mode capture is; in thread-local mode,
    /// only its own captures count; in relaxed mode, none. A forbidden call fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the captures that forbade it.
    pub(super) fn unsafe_call(&mut self, call: &'static str) -> Result<(), DriverError> {
        if self.captures.is_empty() {
            return Ok(());
        }
        let mode = THREAD_CAPTURE_MODE.with(|m| m.get());
        let me = std::thread::current().id();
        let mut forbidden = false;
        for c in &mut self.captures {
            let blocks = match mode {
                CaptureMode::Relaxed => false,
                CaptureMode::ThreadLocal => c.thread == me && c.mode != CaptureMode::Relaxed,
                CaptureMode::Global => {
                    (c.thread == me && c.mode != CaptureMode::Relaxed)
                        || (c.thread != me && c.mode == CaptureMode::Global)
                }
            };
            if blocks {
                c.valid = false;
                forbidden = true;
            }
        }
        if forbidden {
            self.counts.capture_violations += 1;
            return Err(capture_unsupported(call));
        }
        Ok(())
    }

    /// Waiting on `stream` (or, `None`, on the whole device): forbidden while the stream (any
    /// stream) captures, in every mode; the capture is invalidated.
    pub(super) fn wait_on(&mut self, stream: Option<StreamHandle>, call: &'static str) -> Result<(), DriverError> {
        let mut forbidden = false;
        for c in self.captures.iter_mut().filter(|c| stream.is_none_or(|s| s == c.stream)) {
            c.valid = false;
            forbidden = true;
        }
        if forbidden {
            self.counts.capture_violations += 1;
            return Err(capture_unsupported(call));
        }
        Ok(())
    }

    /// An event recorded during a capture is a node of the graph: querying or waiting for it
    /// fails with `CUDA_ERROR_CAPTURED_EVENT` (and, while its capture is under way, invalidates
    /// it).
    pub(super) fn captured_event(&mut self, event: EventHandle, call: &'static str) -> Result<(), DriverError> {
        let Some(&id) = self.captured_events.get(&event.0) else { return Ok(()) };
        if let Some(c) = self.captures.iter_mut().find(|c| c.id == id) {
            c.valid = false;
        }
        self.counts.capture_violations += 1;
        Err(DriverError::Cuda { call, code: 907, name: "CUDA_ERROR_CAPTURED_EVENT".into() })
    }
}

impl SimDriver {
    /// Begins capturing `stream` in `mode` on the calling thread (`cuStreamBeginCapture`). Until
    /// [`SimDriver::end_capture`], the calls CUDA forbids fail as on the GPU and invalidate
    /// the capture: `cuMemAlloc`, `cuMemFree` and the virtual memory calls from a thread the
    /// capture modes restrict (see `cuThreadExchangeStreamCaptureMode`: a global-mode capture
    /// restricts every thread in global mode, a thread-local one its own thread, a relaxed one
    /// none), synchronising the device or the stream, and querying or synchronising an event
    /// recorded on the stream during the capture. Recording events is allowed.
    ///
    /// Errors: `CUDA_ERROR_ILLEGAL_STATE` (401) when the stream captures already.
    pub fn begin_capture(&self, stream: StreamHandle, mode: CaptureMode) -> Result<u64, DriverError> {
        let mut st = self.state.lock();
        if st.captures.iter().any(|c| c.stream == stream) {
            return Err(DriverError::Cuda {
                call: "cuStreamBeginCapture",
                code: 401,
                name: "CUDA_ERROR_ILLEGAL_STATE".into(),
            });
        }
        st.next_capture += 1;
        let id = st.next_capture;
        st.captures.push(Capture { id, stream, mode, thread: std::thread::current().id(), valid: true });
        Ok(id)
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture`): true when it is valid (a graph
    /// would be made), false when a forbidden call invalidated it (CUDA answers
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
    ///
    /// Errors: `CUDA_ERROR_ILLEGAL_STATE` (401) when the stream is not capturing.
    pub fn end_capture(&self, stream: StreamHandle) -> Result<bool, DriverError> {
        let mut st = self.state.lock();
        let Some(i) = st.captures.iter().position(|c| c.stream == stream) else {
            return Err(DriverError::Cuda {
                call: "cuStreamEndCapture",
                code: 401,
                name: "CUDA_ERROR_ILLEGAL_STATE".into(),
            });
        };
        Ok(st.captures.remove(i).valid)
    }

    /// Invalidates the capture of `stream`, as a call of the program's own that CUDA forbids
    /// during capture would (a `cudaMalloc` in global mode, a kernel launch that fails). Returns
    /// whether the stream was capturing.
    pub fn invalidate_capture(&self, stream: StreamHandle) -> bool {
        let mut st = self.state.lock();
        st.captures.iter_mut().find(|c| c.stream == stream).map(|c| c.valid = false).is_some()
    }

    /// The capture status of `stream`, counting no call (for tests).
    pub fn capture_status(&self, stream: StreamHandle) -> CaptureStatus {
        let st = self.state.lock();
        match st.captures.iter().find(|c| c.stream == stream) {
            None => CaptureStatus::None,
            Some(c) if c.valid => CaptureStatus::Active(c.id),
            Some(_) => CaptureStatus::Invalidated,
        }
    }
}
