//! The simulated device: host memory posing as device memory, for tests and for trying gpupool
//! on a machine without a GPU.
//!
//! - Memory: each allocation is its own anonymous `mmap` (reserved lazily by the kernel, so a
//!   large capacity costs nothing until written), and the pointers are real host pointers a
//!   test may read and write. Each device has a fixed capacity; past it `mem_alloc` fails with
//!   [`DriverError::OutOfMemory`], as `cuMemAlloc` does.
//! - Streams and events: a stream completes its work at once unless a test holds it
//!   ([`SimDriver::hold_stream`]); an event recorded on a held stream stays incomplete until
//!   the stream is released. `event_synchronize` stands for waiting on the device: it completes
//!   the stream's work up to the event.
//! - Faults: [`SimDriver::inject_fault`] makes a chosen later call of one kind fail.
//!
//! Selected with `GPUPOOL_DRIVER=sim`; capacity and device count from `GPUPOOL_SIM_CAPACITY`
//! and `GPUPOOL_SIM_DEVICES` (see [`crate::config`]).

use std::cell::Cell;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{DevicePtr, Driver, DriverError, EventHandle, MemInfo, StreamHandle};

/// The kinds of driver call a fault can be injected into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimOp {
    MemAlloc,
    MemFree,
    EventCreate,
    EventRecord,
    EventQuery,
    EventSynchronize,
    DeviceSynchronize,
}

/// How often each driver call was made, for tests that check what the allocator asked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounts {
    pub mem_alloc: u64,
    pub mem_free: u64,
    pub event_create: u64,
    pub event_record: u64,
    pub event_query: u64,
    pub event_synchronize: u64,
    pub event_destroy: u64,
    pub device_synchronize: u64,
}

#[derive(Default)]
struct SimStream {
    recorded: u64,
    completed: u64,
    held: bool,
}

struct Fault {
    op: SimOp,
    skip: u32,
    error: DriverError,
}

#[derive(Default)]
struct State {
    used: Vec<usize>,
    allocations: FxHashMap<DevicePtr, (i32, usize)>,
    streams: FxHashMap<StreamHandle, SimStream>,
    events: FxHashMap<u64, Option<(StreamHandle, u64)>>,
    next_event: u64,
    faults: Vec<Fault>,
    counts: SimCounts,
}

impl State {
    fn fault(&mut self, op: SimOp) -> Result<(), DriverError> {
        if let Some(i) = self.faults.iter().position(|f| f.op == op) {
            if self.faults[i].skip == 0 {
                return Err(self.faults.remove(i).error);
            }
            self.faults[i].skip -= 1;
        }
        Ok(())
    }
}

thread_local! {
    static CURRENT_DEVICE: Cell<i32> = const { Cell::new(0) };
}

/// A simulated set of devices. Thread-safe; all state sits behind one mutex (the simulated
/// driver is not on the allocator's hit path).
pub struct SimDriver {
    devices: i32,
    capacity: usize,
    state: Mutex<State>,
}

impl SimDriver {
    /// `devices` devices of `capacity` bytes each.
    pub fn new(devices: i32, capacity: usize) -> SimDriver {
        SimDriver {
            devices,
            capacity,
            state: Mutex::new(State { used: vec![0; devices.max(0) as usize], ..State::default() }),
        }
    }

    /// Sets the calling thread's current device (the simulated `cudaSetDevice`).
    pub fn set_current_device(device: i32) {
        CURRENT_DEVICE.with(|c| c.set(device));
    }

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

    /// Makes a later call of kind `op` fail with `error`: the call after `skip` successful ones.
    /// Faults of one kind fire in the order they were injected.
    pub fn inject_fault(&self, op: SimOp, skip: u32, error: DriverError) {
        self.state.lock().faults.push(Fault { op, skip, error });
    }

    /// How often each call was made so far.
    pub fn counts(&self) -> SimCounts {
        self.state.lock().counts
    }

    /// Bytes currently allocated on `device` through this driver.
    pub fn used(&self, device: i32) -> usize {
        self.state.lock().used[device as usize]
    }

    /// Events created and not destroyed.
    pub fn live_events(&self) -> usize {
        self.state.lock().events.len()
    }

    fn event_done(st: &State, event: EventHandle) -> Result<bool, DriverError> {
        match st.events.get(&event.0) {
            None => Err(invalid("cuEventQuery")),
            Some(None) => Ok(true),
            Some(Some((stream, ticket))) => Ok(st.streams.get(stream).is_none_or(|s| s.completed >= *ticket)),
        }
    }
}

fn invalid(call: &'static str) -> DriverError {
    DriverError::Cuda { call, code: 1, name: "CUDA_ERROR_INVALID_VALUE".into() }
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> i32 {
        self.devices
    }

    fn current_device(&self) -> Result<i32, DriverError> {
        Ok(CURRENT_DEVICE.with(|c| c.get()))
    }

    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_alloc += 1;
        st.fault(SimOp::MemAlloc)?;
        if size == 0 {
            return Err(invalid("cuMemAlloc"));
        }
        let d = device as usize;
        if size > self.capacity - st.used[d] {
            return Err(DriverError::OutOfMemory);
        }
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(DriverError::OutOfMemory);
        }
        st.used[d] += size;
        st.allocations.insert(p as DevicePtr, (device, size));
        Ok(p as DevicePtr)
    }

    fn mem_free(&self, _device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_free += 1;
        st.fault(SimOp::MemFree)?;
        let (device, size) = st.allocations.remove(&ptr).ok_or_else(|| invalid("cuMemFree"))?;
        st.used[device as usize] -= size;
        // SAFETY: `ptr` and `size` are exactly a mapping made by `mem_alloc` and not yet unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        let st = self.state.lock();
        Ok(MemInfo { free: self.capacity - st.used[device as usize], total: self.capacity })
    }

    fn event_create(&self, _device: i32) -> Result<EventHandle, DriverError> {
        let mut st = self.state.lock();
        st.counts.event_create += 1;
        st.fault(SimOp::EventCreate)?;
        st.next_event += 1;
        let id = st.next_event;
        st.events.insert(id, None);
        Ok(EventHandle(id))
    }

    fn event_record(&self, _device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.event_record += 1;
        st.fault(SimOp::EventRecord)?;
        if !st.events.contains_key(&event.0) {
            return Err(invalid("cuEventRecord"));
        }
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
        let mut st = self.state.lock();
        st.counts.event_query += 1;
        st.fault(SimOp::EventQuery)?;
        SimDriver::event_done(&st, event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.event_synchronize += 1;
        st.fault(SimOp::EventSynchronize)?;
        if let Some(Some((stream, ticket))) = st.events.get(&event.0).copied() {
            let s = st.streams.entry(stream).or_default();
            s.completed = s.completed.max(ticket);
            Ok(())
        } else {
            SimDriver::event_done(&st, event).map(|_| ())
        }
    }

    fn event_destroy(&self, _device: i32, event: EventHandle) {
        let mut st = self.state.lock();
        st.counts.event_destroy += 1;
        st.events.remove(&event.0);
    }

    /// The simulated device runs no work, so there is nothing to wait for (a held stream stays
    /// held): counts the call, or fails with an injected fault.
    fn device_synchronize(&self, _device: i32) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.device_synchronize += 1;
        st.fault(SimOp::DeviceSynchronize)?;
        Ok(())
    }

    fn current_primary_device(&self) -> Result<Option<i32>, DriverError> {
        Ok(Some(CURRENT_DEVICE.with(|c| c.get())))
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        for (&ptr, &(_, size)) in self.state.get_mut().allocations.iter() {
            // SAFETY: every entry is a live mapping made by `mem_alloc`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        }
    }
}
