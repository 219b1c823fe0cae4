//! Fault injection: which call a test makes fail, and how ([`SimOp`], [`SimFault`]), the table
//! of faults waiting to fire, and the check every simulated call makes against it first
//! ([`State::fault`]), so that a faulted call changes nothing before it fails or panics.

use std::sync::atomic::Ordering;

use super::{DriverError, SimDriver, State};

/// The kinds of driver call a fault can be injected into: every call of
/// [`Driver`](crate::driver::Driver) but `name` and `device_count`, which cannot fail.
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
    StreamCreate,
    StreamDestroy,
    StreamSynchronize,
    MemcpyDtoH,
    MemcpyHtoD,
    /// `host_map`: the system's `mmap` of a sleeping pool's host copy, not a CUDA call.
    HostMap,
    /// `host_unmap`: the system's `munmap`, not a CUDA call.
    HostUnmap,
    DeviceUuid,
    MemExport,
    MemImport,
    IpcGetMemHandle,
    IpcOpenMemHandle,
    IpcCloseMemHandle,
    /// `mem_range_dmabuf`: a dma-buf descriptor of a range (`gpupool_segment_mapped_range`).
    MemGetHandleForAddressRange,
}

impl SimOp {
    // Rust API only: cbindgen run over the whole crate would otherwise put an opaque `SimOp`
    // into the C header.
    /// Every kind, for tests that inject faults into calls of any kind.
    ///
    /// cbindgen:ignore
    pub const ALL: [SimOp; 40] = [
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
        SimOp::StreamCreate,
        SimOp::StreamDestroy,
        SimOp::StreamSynchronize,
        SimOp::MemcpyDtoH,
        SimOp::MemcpyHtoD,
        SimOp::HostMap,
        SimOp::HostUnmap,
        SimOp::DeviceUuid,
        SimOp::MemExport,
        SimOp::MemImport,
        SimOp::IpcGetMemHandle,
        SimOp::IpcOpenMemHandle,
        SimOp::IpcCloseMemHandle,
        SimOp::MemGetHandleForAddressRange,
    ];

    /// The CUDA driver function that [`crate::driver::cuda::CudaDriver`] calls for this kind (the
    /// symbol cudarc looks up in `libcuda.so.1`); for [`SimOp::HostMap`] and
    /// [`SimOp::HostUnmap`], the system call.
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
            SimOp::StreamCreate => "cuStreamCreate",
            SimOp::StreamDestroy => "cuStreamDestroy_v2",
            SimOp::StreamSynchronize => "cuStreamSynchronize",
            SimOp::MemcpyDtoH => "cuMemcpyDtoHAsync_v2",
            SimOp::MemcpyHtoD => "cuMemcpyHtoDAsync_v2",
            // The system's calls, which every host has: a missing-symbol fault there stands
            // for a refusal.
            SimOp::HostMap => "mmap",
            SimOp::HostUnmap => "munmap",
            SimOp::DeviceUuid => "cuDeviceGetUuid_v2",
            SimOp::MemExport => "cuMemExportToShareableHandle",
            SimOp::MemImport => "cuMemImportFromShareableHandle",
            SimOp::IpcGetMemHandle => "cuIpcGetMemHandle",
            SimOp::IpcOpenMemHandle => "cuIpcOpenMemHandle_v2",
            SimOp::IpcCloseMemHandle => "cuIpcCloseMemHandle",
            SimOp::MemGetHandleForAddressRange => "cuMemGetHandleForAddressRange",
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

pub(super) struct Fault {
    op: SimOp,
    skip: u32,
    fault: SimFault,
}

impl State {
    /// Fires the next fault injected into `op` if its turn has come. A panic fault panics here,
    /// with the state's lock held by the caller: parking_lot's mutex is not poisoned, and the
    /// guard unlocks it as the panic unwinds.
    pub(super) fn fault(&mut self, op: SimOp) -> Result<(), DriverError> {
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

impl SimDriver {
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
    /// Its hooks run here too ([`SimDriver::on_call`] arms the same flag): these calls are on
    /// the hit path of an allocation on device -1, which pays one load for both.
    pub(super) fn lock_free_fault(&self, op: SimOp) -> Result<(), DriverError> {
        if !self.armed.load(Ordering::Acquire) {
            return Ok(());
        }
        self.run_hooks(op);
        self.state.lock().fault(op)
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
}
