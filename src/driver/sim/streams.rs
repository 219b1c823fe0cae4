//! Streams and events: a stream completes its work at once unless a test holds it, and an
//! event is complete once its stream's work up to it is; the event calls, the device's
//! synchronisation, and the two calls of stream capture (a stream's status, the thread's mode,
//! both kept in `capture`).

use super::capture::THREAD_CAPTURE_MODE;
use super::{CaptureMode, CaptureStatus, DriverError, EventHandle, SimDriver, SimOp, State, StreamHandle, invalid};
use crate::driver::ops::StreamOps;

#[derive(Default)]
pub(super) struct SimStream {
    recorded: u64,
    completed: u64,
    held: bool,
    /// Times a host wait (`cuEventSynchronize`, `cuStreamSynchronize`) completed work of this
    /// stream while it was held (the host waited for it: the simulated device runs it then).
    waits: u64,
}

impl SimStream {
    /// A host wait for the stream's work up to `ticket`: it runs now, held or not, and a wait
    /// that ran held work is counted.
    fn host_waits_for(&mut self, ticket: u64) {
        if self.held && ticket > self.completed {
            self.waits += 1;
        }
        self.completed = self.completed.max(ticket);
    }

    /// A host wait for all the work recorded on the stream (`cuStreamSynchronize`).
    pub(super) fn host_waits_for_all(&mut self) {
        self.host_waits_for(self.recorded);
    }
}

impl SimDriver {
    /// From now on, work recorded on `stream` does not complete until [`SimDriver::release_stream`].
    pub fn hold_stream(&self, stream: StreamHandle) {
        self.state.lock().streams.entry(stream).or_default().held = true;
    }

    /// Completes all work recorded on `stream` and stops holding it.
    pub fn release_stream(&self, stream: StreamHandle) {
        let mut st = self.state.lock();
        let s = st.streams.entry(stream).or_default();
        s.held = false;
        s.completed = s.recorded;
    }

    /// How many times a host wait (`cuEventSynchronize`) completed work held on `stream`: a
    /// test that holds a stream sees which of its work gpupool waited for (a real device
    /// would have run it meanwhile).
    pub fn stream_waits(&self, stream: StreamHandle) -> u64 {
        self.state.lock().streams.get(&stream).map_or(0, |s| s.waits)
    }

    /// Events created and not destroyed.
    pub fn live_events(&self) -> usize {
        self.state.lock().events.len()
    }

    /// Places `stream` on `device`, for [`DeviceOps::stream_device`](crate::driver::ops::DeviceOps::stream_device)
    /// (a stream no test placed belongs to the calling thread's current device).
    pub fn set_stream_device(&self, stream: StreamHandle, device: i32) {
        self.state.lock().stream_devices.insert(stream, device);
    }

    fn event_done(st: &State, event: EventHandle) -> Result<bool, DriverError> {
        match st.events.get(&event.0) {
            None => Err(invalid("cuEventQuery")),
            Some(None) => Ok(true),
            Some(Some((stream, ticket))) => Ok(st.streams.get(stream).is_none_or(|s| s.completed >= *ticket)),
        }
    }
}

impl StreamOps for SimDriver {
    fn event_create(&self, _device: i32) -> Result<EventHandle, DriverError> {
        self.run_hooks(SimOp::EventCreate);
        let mut st = self.state.lock();
        st.counts.event_create += 1;
        st.fault(SimOp::EventCreate)?;
        st.next_event += 1;
        let id = st.next_event;
        st.events.insert(id, None);
        Ok(EventHandle(id))
    }

    fn event_record(&self, _device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::EventRecord);
        let mut st = self.state.lock();
        st.counts.event_record += 1;
        st.fault(SimOp::EventRecord)?;
        if !st.events.contains_key(&event.0) {
            return Err(invalid("cuEventRecord"));
        }
        // Recorded into the graph, not run: the stream's work does not advance.
        if let Some(id) = st.captures.iter().find(|c| c.stream == stream).map(|c| c.id) {
            st.captured_events.insert(event.0, id);
            return Ok(());
        }
        st.captured_events.remove(&event.0);
        let s = st.streams.entry(stream).or_default();
        s.recorded += 1;
        if !s.held {
            s.completed = s.recorded;
        }
        let ticket = s.recorded;
        st.events.insert(event.0, Some((stream, ticket)));
        Ok(())
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        self.run_hooks(SimOp::EventQuery);
        let mut st = self.state.lock();
        st.counts.event_query += 1;
        st.fault(SimOp::EventQuery)?;
        st.captured_event(event, "cuEventQuery")?;
        SimDriver::event_done(&st, event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::EventSynchronize);
        let mut st = self.state.lock();
        st.counts.event_synchronize += 1;
        st.fault(SimOp::EventSynchronize)?;
        st.captured_event(event, "cuEventSynchronize")?;
        if let Some(Some((stream, ticket))) = st.events.get(&event.0).copied() {
            st.streams.entry(stream).or_default().host_waits_for(ticket);
            Ok(())
        } else {
            SimDriver::event_done(&st, event).map(|_| ())
        }
    }

    fn event_destroy(&self, _device: i32, event: EventHandle) {
        self.run_hooks(SimOp::EventDestroy);
        let mut st = self.state.lock();
        st.counts.event_destroy += 1;
        if st.fault(SimOp::EventDestroy).is_ok() {
            st.events.remove(&event.0);
            st.captured_events.remove(&event.0);
        }
    }

    /// The simulated device runs no work, so there is nothing to wait for (a held stream stays
    /// held): counts the call, or fails or panics with an injected fault, or fails as CUDA
    /// does while a stream captures.
    fn device_synchronize(&self, _device: i32) -> Result<(), DriverError> {
        self.run_hooks(SimOp::DeviceSynchronize);
        let mut st = self.state.lock();
        st.counts.device_synchronize += 1;
        st.fault(SimOp::DeviceSynchronize)?;
        st.wait_on(None, "cuCtxSynchronize")?;
        Ok(())
    }

    fn stream_capture_status(&self, _device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        self.run_hooks(SimOp::StreamGetCaptureInfo);
        let mut st = self.state.lock();
        st.counts.capture_info += 1;
        st.fault(SimOp::StreamGetCaptureInfo)?;
        Ok(match st.captures.iter().find(|c| c.stream == stream) {
            None => CaptureStatus::None,
            Some(c) if c.valid => CaptureStatus::Active(c.id),
            Some(_) => CaptureStatus::Invalidated,
        })
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        // The lock-free fault check runs the call's hooks too (`on_call` arms its flag): a
        // second `run_hooks` here ran each hook twice and counted each call twice.
        self.lock_free_fault(SimOp::ThreadExchangeCaptureMode)?;
        Ok(THREAD_CAPTURE_MODE.with(|m| m.replace(mode)))
    }
}
