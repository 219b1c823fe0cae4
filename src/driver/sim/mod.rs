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
//! - Pinned host memory: `host_alloc` maps host memory, `host_register` records the caller's
//!   range; the driver keeps which ranges are pinned ([`SimDriver::is_pinned`]), and a
//!   simulated host-to-device copy from memory that is not is counted
//!   ([`SimDriver::memcpy_htod_async`], [`SimCounts::unpinned_copies`]).
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

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{
    CaptureMode, CaptureStatus, DevicePtr, Driver, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
};

/// The kinds of driver call a fault can be injected into: every call of [`Driver`] but
/// `name` and `device_count`, which cannot fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimOp {
    MemAlloc,
    MemFree,
    MemInfo,
    EventCreate,
    EventRecord,
    EventQuery,
    EventSynchronize,
    /// `event_destroy` returns nothing: an injected error makes it leave the event alive (as
    /// a failed `cuEventDestroy` would), a panic panics.
    EventDestroy,
    DeviceSynchronize,
    CurrentDevice,
    CurrentPrimaryDevice,
    VmmGranularity,
    AddressReserve,
    AddressFree,
    MemCreate,
    MemRelease,
    MemMap,
    MemSetAccess,
    MemUnmap,
    HostAlloc,
    HostFree,
    HostRegister,
    HostUnregister,
    StreamDevice,
    StreamGetCaptureInfo,
    ThreadExchangeCaptureMode,
}

impl SimOp {
    // Rust API only: cbindgen run over the whole crate would otherwise put an opaque `SimOp`
    // into the C header.
    /// Every kind, for tests that inject faults into calls of any kind.
    ///
    /// cbindgen:ignore
    pub const ALL: [SimOp; 26] = [
        SimOp::MemAlloc,
        SimOp::MemFree,
        SimOp::MemInfo,
        SimOp::EventCreate,
        SimOp::EventRecord,
        SimOp::EventQuery,
        SimOp::EventSynchronize,
        SimOp::EventDestroy,
        SimOp::DeviceSynchronize,
        SimOp::CurrentDevice,
        SimOp::CurrentPrimaryDevice,
        SimOp::VmmGranularity,
        SimOp::AddressReserve,
        SimOp::AddressFree,
        SimOp::MemCreate,
        SimOp::MemRelease,
        SimOp::MemMap,
        SimOp::MemSetAccess,
        SimOp::MemUnmap,
        SimOp::HostAlloc,
        SimOp::HostFree,
        SimOp::HostRegister,
        SimOp::HostUnregister,
        SimOp::StreamDevice,
        SimOp::StreamGetCaptureInfo,
        SimOp::ThreadExchangeCaptureMode,
    ];

    /// The CUDA driver function that [`super::cuda::CudaDriver`] calls for this kind (the
    /// symbol cudarc looks up in `libcuda.so.1`).
    pub fn symbol(self) -> &'static str {
        match self {
            SimOp::MemAlloc => "cuMemAlloc_v2",
            SimOp::MemFree => "cuMemFree_v2",
            SimOp::MemInfo => "cuMemGetInfo_v2",
            SimOp::EventCreate => "cuEventCreate",
            SimOp::EventRecord => "cuEventRecord",
            SimOp::EventQuery => "cuEventQuery",
            SimOp::EventSynchronize => "cuEventSynchronize",
            SimOp::EventDestroy => "cuEventDestroy_v2",
            SimOp::DeviceSynchronize => "cuCtxSynchronize",
            SimOp::CurrentDevice => "cuCtxGetCurrent",
            SimOp::CurrentPrimaryDevice => "cuDevicePrimaryCtxRetain",
            SimOp::VmmGranularity => "cuMemGetAllocationGranularity",
            SimOp::AddressReserve => "cuMemAddressReserve",
            SimOp::AddressFree => "cuMemAddressFree",
            SimOp::MemCreate => "cuMemCreate",
            SimOp::MemRelease => "cuMemRelease",
            SimOp::MemMap => "cuMemMap",
            SimOp::MemSetAccess => "cuMemSetAccess",
            SimOp::MemUnmap => "cuMemUnmap",
            SimOp::HostAlloc => "cuMemHostAlloc",
            SimOp::HostFree => "cuMemFreeHost",
            SimOp::HostRegister => "cuMemHostRegister_v2",
            SimOp::HostUnregister => "cuMemHostUnregister",
            SimOp::StreamDevice => "cuStreamGetCtx",
            SimOp::StreamGetCaptureInfo => "cuStreamGetCaptureInfo_v2",
            SimOp::ThreadExchangeCaptureMode => "cuThreadExchangeStreamCaptureMode",
        }
    }
}

/// What an injected fault does to the call it fires on. The call changes nothing in the
/// simulated device (no memory allocated or freed, no event created, recorded or destroyed)
/// before failing or panicking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimFault {
    /// The call returns this error.
    Fail(DriverError),
    /// The call returns [`DriverError::Unavailable`] naming the call's symbol
    /// ([`SimOp::symbol`]): what the driver layer reports for a function that the installed
    /// `libcuda.so.1` lacks (an old driver), instead of cudarc's panic.
    MissingSymbol,
    /// The call panics with cudarc's message for a symbol missing from `libcuda.so.1`
    /// (`Missing symbol cuMemAlloc_v2: ...`), which is what cudarc does on the first call of a
    /// function the installed driver lacks. The message ends with [`SIM_PANIC_MARK`].
    Panic,
}

/// The end of the message of every panic injected with [`SimFault::Panic`], so that a test
/// can tell injected panics from real ones (and keep its panic hook quiet about them).
pub const SIM_PANIC_MARK: &str = "(panic injected by the simulated device)";

impl SimFault {
    /// The error of a missing `symbol`, as [`SimFault::MissingSymbol`] returns it.
    pub fn missing_symbol_error(symbol: &str) -> DriverError {
        DriverError::Unavailable(format!(
            "the CUDA driver library (libcuda.so.1) has no function {symbol}: the NVIDIA driver is too old for gpupool"
        ))
    }
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
    pub address_reserve: u64,
    pub mem_create: u64,
    pub mem_map: u64,
    pub mem_set_access: u64,
    pub mem_unmap: u64,
    pub host_alloc: u64,
    pub host_free: u64,
    pub host_register: u64,
    pub host_unregister: u64,
    /// Copies through [`SimDriver::memcpy_htod_async`] whose source was not wholly pinned: on
    /// a GPU they would be synchronous staging copies, not asynchronous DMA.
    pub unpinned_copies: u64,
    /// `stream_capture_status` calls (each a `cuStreamGetCaptureInfo`).
    pub capture_info: u64,
    /// Calls that CUDA forbids while a stream captures, made while one did: each failed and
    /// invalidated a capture. A capture-safe allocator keeps this at 0.
    pub capture_violations: u64,
}

/// A capture under way on a stream.
struct Capture {
    id: u64,
    stream: StreamHandle,
    mode: CaptureMode,
    /// The thread that began it (CUDA's "local thread" of the capture).
    thread: std::thread::ThreadId,
    /// Cleared by a forbidden call; [`SimDriver::end_capture`] then reports the capture
    /// failed.
    valid: bool,
}

/// What CUDA answers a call it forbids during capture.
fn capture_unsupported(call: &'static str) -> DriverError {
    DriverError::Cuda { call, code: 900, name: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED".into() }
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
    fault: SimFault,
}

/// A reserved address range: host address space without access (`PROT_NONE`), whose pages
/// become readable and writable while mapped.
struct Range {
    device: i32,
    size: usize,
    /// Mapped pieces: start -> (size, handle).
    mapped: std::collections::BTreeMap<DevicePtr, (usize, u64)>,
    /// Pieces whose access was set (start -> size); a subset of `mapped`.
    accessible: FxHashMap<DevicePtr, usize>,
}

impl Range {
    /// The mapped pieces (start, size, handle) that make up `[ptr, ptr + size)` exactly, or
    /// `None` when some byte of it is not mapped or a piece sticks out of it.
    fn pieces(&self, ptr: DevicePtr, size: usize) -> Option<Vec<(DevicePtr, usize, u64)>> {
        let end = ptr + size as u64;
        let pieces: Vec<_> = self.mapped.range(ptr..end).map(|(&a, &(s, h))| (a, s, h)).collect();
        let covered = pieces.iter().try_fold(ptr, |at, &(a, s, _)| (a == at).then_some(a + s as u64));
        (covered == Some(end)).then_some(pieces)
    }
}

/// A physical allocation: its device, size and where it is mapped, if anywhere.
struct Handle {
    device: i32,
    size: usize,
    mapped_at: Option<DevicePtr>,
}

/// How a range of host memory is pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HostKind {
    /// Allocated and pinned by `host_alloc` (an anonymous mapping of the driver's).
    Allocated,
    /// The caller's memory, pinned by `host_register`.
    Registered,
}

#[derive(Default)]
struct State {
    used: Vec<usize>,
    allocations: FxHashMap<DevicePtr, (i32, usize)>,
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
    /// Streams a test placed on a device ([`SimDriver::set_stream_device`]).
    stream_devices: FxHashMap<StreamHandle, i32>,
}

impl State {
    /// Fires the next fault injected into `op` if its turn has come. A panic fault panics here,
    /// with the state's lock held by the caller: parking_lot's mutex is not poisoned, and the
    /// guard unlocks it as the panic unwinds.
    fn fault(&mut self, op: SimOp) -> Result<(), DriverError> {
        if let Some(i) = self.faults.iter().position(|f| f.op == op) {
            if self.faults[i].skip == 0 {
                return match self.faults.remove(i).fault {
                    SimFault::Fail(e) => Err(e),
                    SimFault::MissingSymbol => Err(SimFault::missing_symbol_error(op.symbol())),
                    SimFault::Panic => {
                        panic!("Missing symbol {0}: libcuda.so.1: undefined symbol: {0} {SIM_PANIC_MARK}", op.symbol())
                    }
                };
            }
            self.faults[i].skip -= 1;
        }
        Ok(())
    }
}

// Rust API only: cbindgen run over the whole crate would otherwise put it into the C header.
/// The simulated device's virtual memory page size (the H100's minimum granularity).
///
/// cbindgen:ignore
pub const SIM_GRANULARITY: usize = 2 << 20;

impl State {
    /// The reserved range that contains `[ptr, ptr + size)`, by its base.
    fn range_of(&mut self, ptr: DevicePtr, size: usize) -> Option<(DevicePtr, &mut Range)> {
        let (&base, r) = self.ranges.range_mut(..=ptr).next_back()?;
        (ptr - base + size as u64 <= r.size as u64).then_some((base, r))
    }
}

/// `prot` on `[ptr, ptr + size)` of host address space the simulated driver reserved; with
/// `PROT_NONE` the pages are also dropped (their contents are lost, as an unmapped page's).
fn protect(ptr: DevicePtr, size: usize, prot: libc::c_int) -> bool {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
    // SAFETY: the range lies inside a reservation of this driver (checked by the callers), so
    // MAP_FIXED replaces only pages the driver owns.
    let p = unsafe { libc::mmap(ptr as *mut libc::c_void, size, prot, flags, -1, 0) };
    p != libc::MAP_FAILED
}

thread_local! {
    static CURRENT_DEVICE: Cell<i32> = const { Cell::new(0) };
    /// The thread's capture mode (`cuThreadExchangeStreamCaptureMode`); CUDA starts every
    /// thread in global mode.
    static THREAD_CAPTURE_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

impl State {
    /// CUDA's rule for a "potentially unsafe" call (`cuMemAlloc`, `cuMemFree`, the virtual
    /// memory calls) made by the calling thread, from `cudaThreadExchangeStreamCaptureMode`:
    /// in global mode, the thread may not make one while a capture it began (not relaxed) is
    /// under way, nor while another thread's global-mode capture is; in thread-local mode,
    /// only its own captures count; in relaxed mode, none. A forbidden call fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the captures that forbade it.
    fn unsafe_call(&mut self, call: &'static str) -> Result<(), DriverError> {
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
    fn wait_on(&mut self, stream: Option<StreamHandle>, call: &'static str) -> Result<(), DriverError> {
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
    fn captured_event(&mut self, event: EventHandle, call: &'static str) -> Result<(), DriverError> {
        let Some(&id) = self.captured_events.get(&event.0) else { return Ok(()) };
        if let Some(c) = self.captures.iter_mut().find(|c| c.id == id) {
            c.valid = false;
        }
        self.counts.capture_violations += 1;
        Err(DriverError::Cuda { call, code: 907, name: "CUDA_ERROR_CAPTURED_EVENT".into() })
    }
}

/// A simulated set of devices. Thread-safe; all state sits behind one mutex (the simulated
/// driver is not on the allocator's hit path).
pub struct SimDriver {
    devices: i32,
    capacity: usize,
    state: Mutex<State>,
    /// Whether any fault was ever injected: until then the calls that take no lock otherwise
    /// (`current_device`, `current_primary_device`) need not take it to look for one.
    armed: AtomicBool,
}

impl SimDriver {
    /// `devices` devices of `capacity` bytes each.
    pub fn new(devices: i32, capacity: usize) -> SimDriver {
        SimDriver {
            devices,
            capacity,
            state: Mutex::new(State { used: vec![0; devices.max(0) as usize], ..State::default() }),
            armed: AtomicBool::new(false),
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

    /// Makes a later call of kind `op` fail with `error`: the call after `skip` successful ones.
    /// Faults of one kind fire in the order they were injected. Same as
    /// `inject(op, skip, SimFault::Fail(error))`.
    pub fn inject_fault(&self, op: SimOp, skip: u32, error: DriverError) {
        self.inject(op, skip, SimFault::Fail(error));
    }

    /// Makes a later call of kind `op` do what `fault` says: the call after `skip` calls of that
    /// kind that went through (counted from the first fault of the kind still waiting: faults
    /// of one kind fire one after another, in the order they were injected). So
    /// `inject(op, n - 1, f)` on a fresh driver fires on the `n`th call of kind `op`.
    pub fn inject(&self, op: SimOp, skip: u32, fault: SimFault) {
        self.state.lock().faults.push(Fault { op, skip, fault });
        self.armed.store(true, Ordering::Release);
    }

    /// The fault check of a call that otherwise takes no lock.
    fn lock_free_fault(&self, op: SimOp) -> Result<(), DriverError> {
        if self.armed.load(Ordering::Acquire) { self.state.lock().fault(op) } else { Ok(()) }
    }

    /// Makes a later call of kind `op` panic as cudarc does for a missing symbol: the call
    /// after `skip` that went through. Same as `inject(op, skip, SimFault::Panic)`.
    pub fn inject_panic(&self, op: SimOp, skip: u32) {
        self.inject(op, skip, SimFault::Panic);
    }

    /// Drops every fault that has not fired yet; returns how many there were.
    pub fn clear_faults(&self) -> usize {
        let mut st = self.state.lock();
        let n = st.faults.len();
        st.faults.clear();
        n
    }

    /// Faults injected that have not fired yet.
    pub fn pending_faults(&self) -> usize {
        self.state.lock().faults.len()
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

    /// Reserved address ranges not yet freed, and physical handles not yet released, on every
    /// device.
    pub fn live_vmm(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.ranges.len(), st.handles.len())
    }

    /// Bytes mapped with access set on `device` (what a kernel could touch).
    pub fn accessible(&self, device: i32) -> usize {
        let st = self.state.lock();
        st.ranges.values().filter(|r| r.device == device).flat_map(|r| r.accessible.values()).sum()
    }

    /// Allocations made by `mem_alloc` and not yet freed, on every device.
    pub fn live_allocations(&self) -> usize {
        self.state.lock().allocations.len()
    }

    /// Whether `[ptr, ptr + len)` lies wholly inside one pinned host range (from `host_alloc`
    /// or `host_register`): what a copy must read from to be asynchronous on a GPU.
    pub fn is_pinned(&self, ptr: HostPtr, len: usize) -> bool {
        let st = self.state.lock();
        st.host.range(..=ptr).next_back().is_some_and(|(&start, &(size, _))| ptr + len <= start + size)
    }

    /// A host-to-device copy of `len` bytes from `src` to `dst` on `stream` (the simulated
    /// `cuMemcpyHtoDAsync`): the bytes are copied at once. Returns whether the source was
    /// wholly pinned; a copy from memory that is not is counted in
    /// [`SimCounts::unpinned_copies`], which is how a test sees a copy that on a GPU would
    /// not have been asynchronous.
    ///
    /// # Safety
    /// `src` must be readable and `dst` writable for `len` bytes, and not overlap.
    pub unsafe fn memcpy_htod_async(&self, dst: DevicePtr, src: HostPtr, len: usize, _stream: StreamHandle) -> bool {
        let pinned = self.is_pinned(src, len);
        if !pinned {
            self.state.lock().counts.unpinned_copies += 1;
        }
        // SAFETY: per this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
        pinned
    }

    /// Places `stream` on `device`, for [`Driver::stream_device`] (a stream no test placed
    /// belongs to the calling thread's current device).
    pub fn set_stream_device(&self, stream: StreamHandle, device: i32) {
        self.state.lock().stream_devices.insert(stream, device);
    }

    /// Host ranges pinned now: (allocated by `host_alloc`, registered by `host_register`).
    pub fn live_host(&self) -> (usize, usize) {
        let st = self.state.lock();
        let allocated = st.host.values().filter(|(_, k)| *k == HostKind::Allocated).count();
        (allocated, st.host.len() - allocated)
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
        self.lock_free_fault(SimOp::CurrentDevice)?;
        Ok(CURRENT_DEVICE.with(|c| c.get()))
    }

    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_alloc += 1;
        st.fault(SimOp::MemAlloc)?;
        st.unsafe_call("cuMemAlloc")?;
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
        st.unsafe_call("cuMemFree")?;
        let (device, size) = st.allocations.remove(&ptr).ok_or_else(|| invalid("cuMemFree"))?;
        st.used[device as usize] -= size;
        // SAFETY: `ptr` and `size` are exactly a mapping made by `mem_alloc` and not yet unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::MemInfo)?;
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
        let mut st = self.state.lock();
        st.counts.event_query += 1;
        st.fault(SimOp::EventQuery)?;
        st.captured_event(event, "cuEventQuery")?;
        SimDriver::event_done(&st, event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.event_synchronize += 1;
        st.fault(SimOp::EventSynchronize)?;
        st.captured_event(event, "cuEventSynchronize")?;
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
        if st.fault(SimOp::EventDestroy).is_ok() {
            st.events.remove(&event.0);
            st.captured_events.remove(&event.0);
        }
    }

    /// The simulated device runs no work, so there is nothing to wait for (a held stream stays
    /// held): counts the call, or fails or panics with an injected fault, or fails as CUDA
    /// does while a stream captures.
    fn device_synchronize(&self, _device: i32) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.device_synchronize += 1;
        st.fault(SimOp::DeviceSynchronize)?;
        st.wait_on(None, "cuCtxSynchronize")?;
        Ok(())
    }

    fn current_primary_device(&self) -> Result<Option<i32>, DriverError> {
        self.lock_free_fault(SimOp::CurrentPrimaryDevice)?;
        Ok(Some(CURRENT_DEVICE.with(|c| c.get())))
    }

    fn stream_capture_status(&self, _device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
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
        self.lock_free_fault(SimOp::ThreadExchangeCaptureMode)?;
        Ok(THREAD_CAPTURE_MODE.with(|m| m.replace(mode)))
    }

    fn vmm_granularity(&self, _device: i32) -> Result<Option<usize>, DriverError> {
        self.state.lock().fault(SimOp::VmmGranularity)?;
        Ok(Some(SIM_GRANULARITY))
    }

    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        let mut st = self.state.lock();
        st.counts.address_reserve += 1;
        st.fault(SimOp::AddressReserve)?;
        st.unsafe_call("cuMemAddressReserve")?;
        if size == 0 || size % SIM_GRANULARITY != 0 {
            return Err(invalid("cuMemAddressReserve"));
        }
        // Host address space without access, aligned to the granularity: reserve one page
        // more and trim.
        let len = size + SIM_GRANULARITY;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // SAFETY: an anonymous mapping with no address hint; the result is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(DriverError::OutOfMemory);
        }
        let start = p as usize;
        let base = start.next_multiple_of(SIM_GRANULARITY);
        // SAFETY: both pieces lie in the mapping just made and are trimmed off it.
        unsafe {
            if base > start {
                libc::munmap(p, base - start);
            }
            let end = base + size;
            if start + len > end {
                libc::munmap(end as *mut libc::c_void, start + len - end);
            }
        }
        let range = Range { device, size, mapped: Default::default(), accessible: Default::default() };
        st.ranges.insert(base as DevicePtr, range);
        Ok(base as DevicePtr)
    }

    fn address_free(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::AddressFree)?;
        st.unsafe_call("cuMemAddressFree")?;
        match st.ranges.get(&ptr) {
            Some(r) if r.size == size && r.mapped.is_empty() => {}
            _ => return Err(invalid("cuMemAddressFree")),
        }
        st.ranges.remove(&ptr);
        // SAFETY: exactly a reservation made by `address_reserve`, wholly unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }

    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_create += 1;
        st.fault(SimOp::MemCreate)?;
        st.unsafe_call("cuMemCreate")?;
        if size == 0 || size % SIM_GRANULARITY != 0 {
            return Err(invalid("cuMemCreate"));
        }
        let d = device as usize;
        if size > self.capacity - st.used[d] {
            return Err(DriverError::OutOfMemory);
        }
        st.used[d] += size;
        st.next_handle += 1;
        let id = st.next_handle;
        st.handles.insert(id, Handle { device, size, mapped_at: None });
        Ok(PhysHandle(id))
    }

    fn mem_release(&self, _device: i32, handle: PhysHandle) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::MemRelease)?;
        st.unsafe_call("cuMemRelease")?;
        match st.handles.get(&handle.0) {
            Some(h) if h.mapped_at.is_none() => {}
            _ => return Err(invalid("cuMemRelease")),
        }
        let h = st.handles.remove(&handle.0).expect("checked above");
        st.used[h.device as usize] -= h.size;
        Ok(())
    }

    fn mem_map(&self, _device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_map += 1;
        st.fault(SimOp::MemMap)?;
        st.unsafe_call("cuMemMap")?;
        let fits = st.handles.get(&handle.0).is_some_and(|h| h.size == size && h.mapped_at.is_none());
        let Some((_, r)) = st.range_of(ptr, size).filter(|_| fits && ptr % SIM_GRANULARITY as u64 == 0) else {
            return Err(invalid("cuMemMap"));
        };
        let overlaps = r.mapped.range(..ptr + size as u64).next_back().is_some_and(|(&a, &(s, _))| a + s as u64 > ptr);
        if overlaps {
            return Err(invalid("cuMemMap"));
        }
        r.mapped.insert(ptr, (size, handle.0));
        st.handles.get_mut(&handle.0).expect("checked above").mapped_at = Some(ptr);
        Ok(())
    }

    fn mem_set_access(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_set_access += 1;
        st.fault(SimOp::MemSetAccess)?;
        st.unsafe_call("cuMemSetAccess")?;
        let Some((_, r)) = st.range_of(ptr, size) else {
            return Err(invalid("cuMemSetAccess"));
        };
        let Some(pieces) = r.pieces(ptr, size) else {
            return Err(invalid("cuMemSetAccess"));
        };
        if !protect(ptr, size, libc::PROT_READ | libc::PROT_WRITE) {
            return Err(DriverError::OutOfMemory);
        }
        r.accessible.extend(pieces.into_iter().map(|(a, s, _)| (a, s)));
        Ok(())
    }

    fn mem_unmap(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_unmap += 1;
        st.fault(SimOp::MemUnmap)?;
        st.unsafe_call("cuMemUnmap")?;
        let Some((_, r)) = st.range_of(ptr, size) else {
            return Err(invalid("cuMemUnmap"));
        };
        // CUDA unmaps whole mappings only.
        let Some(pieces) = r.pieces(ptr, size) else {
            return Err(invalid("cuMemUnmap"));
        };
        if !protect(ptr, size, libc::PROT_NONE) {
            return Err(DriverError::OutOfMemory);
        }
        for &(a, _, _) in &pieces {
            r.mapped.remove(&a);
            r.accessible.remove(&a);
        }
        for (_, _, h) in pieces {
            st.handles.get_mut(&h).expect("a mapped handle exists").mapped_at = None;
        }
        Ok(())
    }

    fn host_alloc(&self, _device: i32, size: usize) -> Result<HostPtr, DriverError> {
        self.sim_host_alloc(size)
    }

    fn host_free(&self, _device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.sim_host_free(ptr)
    }

    fn host_register(&self, _device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        self.sim_host_register(ptr, size)
    }

    fn host_unregister(&self, _device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.sim_host_unregister(ptr)
    }

    fn stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError> {
        self.sim_stream_device(stream)
    }
}

impl SimDriver {
    fn host_error(call: &'static str, code: i32, name: &str) -> DriverError {
        DriverError::Cuda { call, code, name: name.into() }
    }
}

// The pinned host memory calls, apart from the others so that they read as one group.
impl SimDriver {
    fn sim_host_alloc(&self, size: usize) -> Result<HostPtr, DriverError> {
        let mut st = self.state.lock();
        st.counts.host_alloc += 1;
        st.fault(SimOp::HostAlloc)?;
        if size == 0 {
            return Err(invalid("cuMemHostAlloc"));
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
        st.host.insert(p as HostPtr, (size, HostKind::Allocated));
        Ok(p as HostPtr)
    }

    fn sim_host_free(&self, ptr: HostPtr) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.host_free += 1;
        st.fault(SimOp::HostFree)?;
        match st.host.get(&ptr) {
            Some(&(size, HostKind::Allocated)) => {
                st.host.remove(&ptr);
                // SAFETY: exactly a mapping made by host_alloc and not yet unmapped.
                unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
                Ok(())
            }
            _ => Err(invalid("cuMemFreeHost")),
        }
    }

    fn sim_host_register(&self, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.host_register += 1;
        st.fault(SimOp::HostRegister)?;
        if ptr == 0 || size == 0 {
            return Err(invalid("cuMemHostRegister"));
        }
        let end = ptr + size;
        let before = st.host.range(..end).next_back().is_some_and(|(&a, &(s, _))| a + s > ptr);
        if before {
            return Err(SimDriver::host_error("cuMemHostRegister", 712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"));
        }
        st.host.insert(ptr, (size, HostKind::Registered));
        Ok(())
    }

    fn sim_host_unregister(&self, ptr: HostPtr) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.host_unregister += 1;
        st.fault(SimOp::HostUnregister)?;
        match st.host.get(&ptr) {
            Some(&(_, HostKind::Registered)) => {
                st.host.remove(&ptr);
                Ok(())
            }
            _ => Err(SimDriver::host_error("cuMemHostUnregister", 713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")),
        }
    }

    fn sim_stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError> {
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
        for (&ptr, &(_, size)) in self.state.get_mut().allocations.iter() {
            // SAFETY: every entry is a live mapping made by `mem_alloc`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        }
        for (&ptr, r) in self.state.get_mut().ranges.iter() {
            // SAFETY: every entry is a live reservation made by `address_reserve`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, r.size) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_fires_on_the_chosen_call_of_its_kind_only() {
        let sim = SimDriver::new(1, 1 << 30);
        sim.inject(SimOp::MemAlloc, 2, SimFault::Fail(DriverError::OutOfMemory));
        let _ = sim.event_create(0).unwrap();
        let a = sim.mem_alloc(0, 4096).unwrap();
        let b = sim.mem_alloc(0, 4096).unwrap();
        assert_eq!(sim.mem_alloc(0, 4096), Err(DriverError::OutOfMemory), "the third call fails");
        assert_eq!(sim.pending_faults(), 0);
        let c = sim.mem_alloc(0, 4096).unwrap();
        for p in [a, b, c] {
            sim.mem_free(0, p).unwrap();
        }
        assert_eq!((sim.used(0), sim.live_allocations()), (0, 0));
    }

    #[test]
    fn a_missing_symbol_is_reported_by_name_and_a_panic_names_it_too() {
        let sim = SimDriver::new(1, 1 << 30);
        sim.inject(SimOp::MemInfo, 0, SimFault::MissingSymbol);
        match sim.mem_info(0) {
            Err(DriverError::Unavailable(m)) => assert!(m.contains("cuMemGetInfo_v2"), "{m}"),
            other => panic!("{other:?}"),
        }
        sim.inject_panic(SimOp::CurrentDevice, 0);
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.current_device())).unwrap_err();
        let msg = payload.downcast_ref::<String>().unwrap();
        assert!(msg.starts_with("Missing symbol cuCtxGetCurrent: ") && msg.ends_with(SIM_PANIC_MARK), "{msg}");
        // The state's lock was released by the unwinding, and nothing changed.
        assert_eq!(sim.current_device(), Ok(0));
        sim.inject(SimOp::EventDestroy, 0, SimFault::Fail(DriverError::OutOfMemory));
        let ev = sim.event_create(0).unwrap();
        sim.event_destroy(0, ev);
        assert_eq!(sim.live_events(), 1, "a failed destroy leaves the event alive");
        sim.event_destroy(0, ev);
        assert_eq!(sim.live_events(), 0);
        sim.inject_panic(SimOp::MemAlloc, 5);
        assert_eq!(sim.clear_faults(), 1);
        sim.mem_free(0, sim.mem_alloc(0, 512).unwrap()).unwrap();
    }
}
