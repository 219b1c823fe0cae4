//! The simulated device: host memory posing as device memory, for tests and for trying gpupool
//! on a machine without a GPU.
//!
//! - Memory: each device's physical memory is one sparse `memfd` (`backing`: it costs host
//!   memory only as it is written), each allocation and each physical handle an extent of it,
//!   mapped shared where it is used, and the pointers are real host pointers a test may read
//!   and write. A file from the start, so that another process may map it (IPC) without its
//!   bytes ever moving. Each device has a fixed capacity; past it `mem_alloc` fails with
//!   [`DriverError::OutOfMemory`], as `cuMemAlloc` does; pinned host memory is capped by the
//!   host's memory ([`SimDriver::set_host_capacity`]), as `cuMemHostAlloc` is by what the
//!   host can pin.
//! - Streams and events: a stream completes its work at once unless a test holds it
//!   ([`SimDriver::hold_stream`]); an event recorded on a held stream stays incomplete until
//!   the stream is released. `event_synchronize` stands for waiting on the device: it completes
//!   the stream's work up to the event.
//! - Pinned host memory: `host_alloc` maps host memory, `host_register` records the caller's
//!   range; the driver keeps which ranges are pinned ([`SimDriver::is_pinned`]), and a
//!   simulated host-to-device copy from memory that is not is counted
//!   ([`SimDriver::memcpy_htod_async`], [`SimCounts::unpinned_copies`]).
//! - Hooks: [`SimDriver::on_call`] runs a test's code at the start of a chosen later call, to
//!   put another call at one exact point inside an operation of the allocator.
//! - Faults: [`SimDriver::inject`] makes a chosen later call of one kind fail with an error,
//!   fail as a driver library lacking the call's symbol would be reported
//!   ([`SimFault::MissingSymbol`]), or panic as cudarc does when `libcuda.so.1` lacks the
//!   symbol ([`SimFault::Panic`]): the allocator above must survive each of them.
//!
//! - Stream capture: a test begins and ends a capture on a stream ([`SimDriver::begin_capture`],
//!   [`SimDriver::end_capture`]) in one of CUDA's modes. While a stream captures, the calls
//!   CUDA forbids fail as on the GPU, with CUDA's codes, and invalidate the capture (see
//!   [`SimDriver::begin_capture`]); [`SimCounts::capture_violations`] counts them. The
//!   simulated streams belong to no device, so synchronising any device waits on every
//!   capturing stream.
//!
//! Selected with `GPUPOOL_DRIVER=sim`; capacity and device count from `GPUPOOL_SIM_CAPACITY`
//! and `GPUPOOL_SIM_DEVICES` (see [`crate::config`]).
//!
//! This file holds the driver and its state, and the devices' calls ([`DeviceOps`]). Each
//! mechanism is in a file of its own, which implements its sub-trait of
//! [`Driver`](super::Driver) (see [`ops`](super::ops)), each call's body in the impl, starting
//! with the hooks of [`SimDriver::on_call`] and the faults of [`SimDriver::inject`]: the
//! devices' physical memory in `backing`, device memory (`MemoryOps`) in `memory`, virtual
//! memory (`VirtualMemoryOps`) in `vmm`, memory shared with other processes (`IpcOps`) in
//! `ipc`, dma-buf descriptors of ranges (`DmabufOps`) in `dmabuf`, pinned and pageable host
//! memory (`HostMemoryOps`; pageable memory is a sleeping pool's host copy) in `host`, streams,
//! events and the calls of stream capture (`StreamOps`) in `streams`, the captures a test
//! begins and ends and CUDA's rules during them in `capture`, copies and copy streams
//! (`CopyOps`) in `copy`, injected faults in `faults`, a test's code run at a chosen call in
//! `hooks`, the count of each call made in `counts`, the maps a multi-mapping allocator would
//! have been spared in `multimap`; its unit tests in `tests.rs`.

mod backing;
mod capture;
mod copy;
mod counts;
mod dmabuf;
mod faults;
mod hooks;
mod host;
mod ipc;
mod memory;
mod multimap;
mod streams;
#[cfg(test)]
mod tests;
mod vmm;

use std::cell::Cell;
use std::sync::atomic::AtomicBool;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{
    CaptureMode, CaptureStatus, DevicePtr, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
};
use crate::driver::ops::DeviceOps;
use capture::Capture;
pub use counts::SimCounts;
use faults::Fault;
pub use faults::{SIM_PANIC_MARK, SimFault, SimOp};
use host::HostKind;
use streams::SimStream;
pub use vmm::SIM_GRANULARITY;
use vmm::{Handle, Range};

#[derive(Default)]
struct State {
    used: Vec<usize>,
    /// Each device's physical memory, made at its first allocation.
    files: FxHashMap<i32, backing::DeviceFile>,
    /// Allocations of `mem_alloc`: start -> (device, size, offset in the device's file).
    allocations: FxHashMap<DevicePtr, (i32, usize, u64)>,
    ranges: std::collections::BTreeMap<DevicePtr, Range>,
    handles: FxHashMap<u64, Handle>,
    next_handle: u64,
    streams: FxHashMap<StreamHandle, SimStream>,
    events: FxHashMap<u64, Option<(StreamHandle, u64)>>,
    /// Events last recorded on a stream during its capture, by event, with the capture's id:
    /// a node of the graph, which cannot be queried or waited for.
    captured_events: FxHashMap<u64, u64>,
    captures: Vec<Capture>,
    next_capture: u64,
    next_event: u64,
    faults: Vec<Fault>,
    counts: SimCounts,
    /// Pinned host ranges: start -> (size, how).
    host: std::collections::BTreeMap<HostPtr, (usize, HostKind)>,
    /// Bytes pinned now (allocated and registered), and the most the host may pin.
    pinned: usize,
    host_capacity: usize,
    /// Pageable host memory mapped by `host_map`: start -> size.
    pageable: std::collections::BTreeMap<HostPtr, usize>,
    /// Streams made by `stream_create` and not destroyed, and the next one's handle.
    copy_streams: rustc_hash::FxHashSet<StreamHandle>,
    next_stream: StreamHandle,
    /// Streams a test placed on a device ([`SimDriver::set_stream_device`]).
    stream_devices: FxHashMap<StreamHandle, i32>,
    /// Allocations of other processes mapped by `ipc_open_mem_handle`: start -> size.
    opened: FxHashMap<DevicePtr, usize>,
    /// The handle last mapped over each address, to count the maps a multi-mapping allocator
    /// would have been spared (`multimap`).
    last_mapped: multimap::LastMapped,
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
    /// Whether any fault was ever injected or hook set: until then the calls that take no lock otherwise
    /// (`current_device`, `current_primary_device`) need not take it to look for one.
    armed: AtomicBool,
    /// Code of a test's run at chosen calls ([`SimDriver::on_call`]).
    hooks: hooks::Hooks,
}

impl SimDriver {
    /// `devices` devices of `capacity` bytes each.
    pub fn new(devices: i32, capacity: usize) -> SimDriver {
        SimDriver {
            devices,
            capacity,
            state: Mutex::new(State {
                used: vec![0; devices.max(0) as usize],
                host_capacity: host::physical_memory(),
                ..State::default()
            }),
            armed: AtomicBool::new(false),
            hooks: hooks::Hooks::default(),
        }
    }

    /// Sets the calling thread's current device (the simulated `cudaSetDevice`).
    pub fn set_current_device(device: i32) {
        CURRENT_DEVICE.with(|c| c.set(device));
    }

    /// How often each call was made so far.
    pub fn counts(&self) -> SimCounts {
        self.state.lock().counts
    }
}

fn invalid(call: &'static str) -> DriverError {
    DriverError::Cuda { call, code: 1, name: "CUDA_ERROR_INVALID_VALUE".into() }
}

impl DeviceOps for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> i32 {
        self.devices
    }

    fn current_device(&self) -> Result<i32, DriverError> {
        self.lock_free_fault(SimOp::CurrentDevice)?;
        Ok(CURRENT_DEVICE.with(|c| c.get()))
    }

    fn current_primary_device(&self) -> Result<Option<i32>, DriverError> {
        self.lock_free_fault(SimOp::CurrentPrimaryDevice)?;
        Ok(Some(CURRENT_DEVICE.with(|c| c.get())))
    }

    fn stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError> {
        self.run_hooks(SimOp::StreamDevice);
        let mut st = self.state.lock();
        st.fault(SimOp::StreamDevice)?;
        Ok(st.stream_devices.get(&stream).copied().unwrap_or_else(|| CURRENT_DEVICE.with(|c| c.get())))
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        for (&ptr, &(size, kind)) in self.state.get_mut().host.iter() {
            if kind == HostKind::Allocated {
                // SAFETY: every such entry is a live mapping made by `host_alloc`.
                unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
            }
        }
        for (&ptr, &size) in self.state.get_mut().pageable.iter() {
            // SAFETY: every entry is a live mapping made by `host_map`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        }
        for (&ptr, &(_, size, _)) in self.state.get_mut().allocations.iter() {
            // SAFETY: every entry is a live mapping made by `mem_alloc`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        }
        for (&ptr, &size) in self.state.get_mut().opened.iter() {
            // SAFETY: every entry is a live mapping made by `ipc_open_mem_handle`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        }
        for (&ptr, r) in self.state.get_mut().ranges.iter() {
            // SAFETY: every entry is a live reservation made by `address_reserve`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, r.size) };
        }
        for h in self.state.get_mut().handles.values() {
            if let vmm::Backing::Imported { hold } = h.backing {
                // SAFETY: every such hold is a live mapping made by `mem_import`.
                unsafe { libc::munmap(hold as *mut libc::c_void, h.size) };
            }
        }
    }
}
