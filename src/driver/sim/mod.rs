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
//! This file holds the driver and its state; each mechanism is in a file of its own, and the
//! [`Driver`] impl below forwards each call to it, as an inherent method named `sim_<call>` (an
//! inherent method of the trait's name would shadow the trait's): the devices' physical memory
//! in `backing`, device memory in `memory`, virtual memory in `vmm`, memory shared with other
//! processes in `ipc`, dma-buf descriptors of ranges in `dmabuf`, pinned host memory in `host`,
//! pageable host memory (a sleeping pool's host copy) in `pageable`, streams and events in
//! `streams`, stream capture in `capture`, copies and copy streams in `copy`, injected faults
//! in `faults`, a test's code run at a chosen call in `hooks`, the count of each call made in
//! `counts`; its unit tests in `tests.rs`.

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
mod pageable;
mod streams;
#[cfg(test)]
mod tests;
mod vmm;

use std::cell::Cell;
use std::sync::atomic::AtomicBool;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{
    CaptureMode, CaptureStatus, DevicePtr, Driver, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
};
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

impl Driver for SimDriver {
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

    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.run_hooks(SimOp::MemAlloc);
        self.sim_mem_alloc(device, size)
    }

    fn mem_free(&self, _device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemFree);
        self.sim_mem_free(ptr)
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        self.run_hooks(SimOp::MemInfo);
        self.sim_mem_info(device)
    }

    fn event_create(&self, _device: i32) -> Result<EventHandle, DriverError> {
        self.run_hooks(SimOp::EventCreate);
        self.sim_event_create()
    }

    fn event_record(&self, _device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::EventRecord);
        self.sim_event_record(event, stream)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        self.run_hooks(SimOp::EventQuery);
        self.sim_event_query(event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::EventSynchronize);
        self.sim_event_synchronize(event)
    }

    fn event_destroy(&self, _device: i32, event: EventHandle) {
        self.run_hooks(SimOp::EventDestroy);
        self.sim_event_destroy(event)
    }

    fn device_synchronize(&self, _device: i32) -> Result<(), DriverError> {
        self.run_hooks(SimOp::DeviceSynchronize);
        self.sim_device_synchronize()
    }

    fn current_primary_device(&self) -> Result<Option<i32>, DriverError> {
        self.lock_free_fault(SimOp::CurrentPrimaryDevice)?;
        Ok(Some(CURRENT_DEVICE.with(|c| c.get())))
    }

    fn stream_capture_status(&self, _device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        self.run_hooks(SimOp::StreamGetCaptureInfo);
        self.sim_stream_capture_status(stream)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        self.run_hooks(SimOp::ThreadExchangeCaptureMode);
        self.sim_exchange_capture_mode(mode)
    }

    fn vmm_granularity(&self, _device: i32) -> Result<Option<usize>, DriverError> {
        self.run_hooks(SimOp::VmmGranularity);
        self.sim_vmm_granularity()
    }

    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.run_hooks(SimOp::AddressReserve);
        self.sim_address_reserve(device, size)
    }

    fn address_free(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::AddressFree);
        self.sim_address_free(ptr, size)
    }

    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError> {
        self.run_hooks(SimOp::MemCreate);
        self.sim_mem_create(device, size)
    }

    fn mem_release(&self, _device: i32, handle: PhysHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemRelease);
        self.sim_mem_release(handle)
    }

    fn mem_map(&self, _device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemMap);
        self.sim_mem_map(ptr, size, handle)
    }

    fn mem_set_access(
        &self,
        _device: i32,
        ptr: DevicePtr,
        size: usize,
        to: &[i32],
        read_write: bool,
    ) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemSetAccess);
        self.sim_mem_set_access(ptr, size, to, read_write)
    }

    fn mem_unmap(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemUnmap);
        self.sim_mem_unmap(ptr, size)
    }

    fn handle_is_free(&self, handle: PhysHandle) -> Option<bool> {
        Some(self.handle_mapped_at(handle) == Some(None))
    }

    fn host_alloc(&self, _device: i32, size: usize) -> Result<HostPtr, DriverError> {
        self.run_hooks(SimOp::HostAlloc);
        self.sim_host_alloc(size)
    }

    fn host_free(&self, _device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostFree);
        self.sim_host_free(ptr)
    }

    fn host_register(&self, _device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostRegister);
        self.sim_host_register(ptr, size)
    }

    fn host_unregister(&self, _device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostUnregister);
        self.sim_host_unregister(ptr)
    }

    fn host_map(&self, size: usize, huge_pages: bool) -> Result<HostPtr, DriverError> {
        self.run_hooks(SimOp::HostMap);
        self.sim_host_map(size, huge_pages)
    }

    fn host_unmap(&self, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostUnmap);
        self.sim_host_unmap(ptr, size)
    }

    fn stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError> {
        self.run_hooks(SimOp::StreamDevice);
        self.sim_stream_device(stream)
    }

    fn stream_create(&self, _device: i32) -> Result<StreamHandle, DriverError> {
        self.run_hooks(SimOp::StreamCreate);
        self.sim_stream_create()
    }

    fn stream_destroy(&self, _device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::StreamDestroy);
        self.sim_stream_destroy(stream)
    }

    fn stream_synchronize(&self, _device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::StreamSynchronize);
        self.sim_stream_synchronize(stream)
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
        self.sim_memcpy(copy::Direction::ToHost, dst, src as usize, size, stream)
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
        self.sim_memcpy(copy::Direction::ToDevice, dst as usize, src, size, stream)
    }

    fn device_uuid(&self, device: i32) -> Result<[u8; 16], DriverError> {
        self.run_hooks(SimOp::DeviceUuid);
        self.sim_device_uuid(device)
    }

    fn mem_export(&self, _device: i32, handle: PhysHandle) -> Result<std::os::fd::OwnedFd, DriverError> {
        self.run_hooks(SimOp::MemExport);
        self.sim_mem_export(handle)
    }

    fn mem_import(&self, device: i32, fd: std::os::fd::BorrowedFd<'_>, size: usize) -> Result<PhysHandle, DriverError> {
        self.run_hooks(SimOp::MemImport);
        self.sim_mem_import(device, fd, size)
    }

    fn ipc_get_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<[u8; 64], DriverError> {
        self.run_hooks(SimOp::IpcGetMemHandle);
        self.sim_ipc_get_mem_handle(device, ptr)
    }

    fn ipc_open_mem_handle(&self, _device: i32, handle: &[u8; 64]) -> Result<DevicePtr, DriverError> {
        self.run_hooks(SimOp::IpcOpenMemHandle);
        self.sim_ipc_open_mem_handle(handle)
    }

    fn ipc_close_mem_handle(&self, _device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::IpcCloseMemHandle);
        self.sim_ipc_close_mem_handle(ptr)
    }

    fn mem_range_dmabuf(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<std::os::fd::OwnedFd, DriverError> {
        self.run_hooks(SimOp::MemGetHandleForAddressRange);
        self.sim_mem_range_dmabuf(device, ptr, size)
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
