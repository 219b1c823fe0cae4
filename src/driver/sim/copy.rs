//! Copies between device and pinned host memory, and the streams they run on
//! (`cuStreamCreate`, `cuStreamDestroy`, `cuStreamSynchronize`, `cuMemcpyDtoHAsync`,
//! `cuMemcpyHtoDAsync`): a copy runs at once, after the driver checked, as CUDA does, that the
//! device range is memory it can reach (an allocation, or pages mapped with access) and the
//! host range is pinned.

use super::{DevicePtr, DriverError, HostPtr, SimDriver, SimOp, State, StreamHandle, invalid};
use crate::driver::ops::CopyOps;

/// The first handle of a stream the simulated driver makes: far from the small values tests
/// use for their own streams.
const FIRST_STREAM: StreamHandle = 0x5_0000_0000;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direction {
    ToHost,
    ToDevice,
}

impl State {
    /// Whether `[ptr, ptr + size)` is device memory a copy may touch: inside one allocation,
    /// or mapped with access set over its whole length.
    fn device_reachable(&mut self, ptr: DevicePtr, size: usize) -> bool {
        let end = ptr + size as u64;
        if self.allocations.iter().any(|(&a, &(_, s, _))| ptr >= a && end <= a + s as u64) {
            return true;
        }
        let Some((_, r)) = self.range_of(ptr, size) else { return false };
        r.accessible_over(ptr, size)
    }

    /// Whether `[ptr, ptr + size)` lies inside one pinned host range.
    fn host_pinned(&self, ptr: HostPtr, size: usize) -> bool {
        self.host.range(..=ptr).next_back().is_some_and(|(&start, &(len, _))| ptr + size <= start + len)
    }
}

impl SimDriver {
    /// A copy of `size` bytes to `to` from `from`, which way `dir` says (`to` is the host
    /// pointer for [`Direction::ToHost`]), on `stream`: run at once.
    pub(super) fn copy_now(
        &self,
        dir: Direction,
        to: usize,
        from: usize,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.copies += 1;
        let (op, call) = match dir {
            Direction::ToHost => (SimOp::MemcpyDtoH, "cuMemcpyDtoHAsync"),
            Direction::ToDevice => (SimOp::MemcpyHtoD, "cuMemcpyHtoDAsync"),
        };
        st.fault(op)?;
        let (device, host) = match dir {
            Direction::ToHost => (from as DevicePtr, to),
            Direction::ToDevice => (to as DevicePtr, from),
        };
        if size == 0 || !st.device_reachable(device, size) || !st.host_pinned(host, size) {
            return Err(invalid(call));
        }
        st.streams.entry(stream).or_default();
        st.counts.copied_bytes += size as u64;
        // SAFETY: both ranges were checked above: the device range is memory the simulated
        // driver mapped readable and writable, the host range is pinned memory of the caller's
        // (live until it is freed, which the caller does not do while a copy is queued); the
        // state's lock keeps either from being unmapped meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, size) };
        Ok(())
    }
}

impl CopyOps for SimDriver {
    fn stream_create(&self, _device: i32) -> Result<StreamHandle, DriverError> {
        self.run_hooks(SimOp::StreamCreate);
        let mut st = self.state.lock();
        st.counts.stream_create += 1;
        st.fault(SimOp::StreamCreate)?;
        let stream = FIRST_STREAM + st.next_stream;
        st.next_stream += 1;
        st.copy_streams.insert(stream);
        Ok(stream)
    }

    fn stream_destroy(&self, _device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::StreamDestroy);
        let mut st = self.state.lock();
        st.fault(SimOp::StreamDestroy)?;
        if !st.copy_streams.remove(&stream) {
            return Err(invalid("cuStreamDestroy"));
        }
        st.streams.remove(&stream);
        Ok(())
    }

    fn stream_synchronize(&self, _device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::StreamSynchronize);
        let mut st = self.state.lock();
        st.counts.stream_synchronize += 1;
        st.fault(SimOp::StreamSynchronize)?;
        st.wait_on(Some(stream), "cuStreamSynchronize")?;
        // Copies run at once; work a test holds on the stream runs now that the host waits for
        // it (as `event_synchronize` does), counted for the test.
        if let Some(s) = st.streams.get_mut(&stream) {
            s.host_waits_for_all();
        }
        Ok(())
    }

    fn memcpy_dtoh_async(
        &self,
        _device: i32,
        dst: HostPtr,
        src: DevicePtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemcpyDtoH);
        self.copy_now(Direction::ToHost, dst, src as usize, size, stream)
    }

    fn memcpy_htod_async(
        &self,
        _device: i32,
        dst: DevicePtr,
        src: HostPtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemcpyHtoD);
        self.copy_now(Direction::ToDevice, dst as usize, src, size, stream)
    }
}
