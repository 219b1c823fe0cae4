//! The driver layer: everything gpupool asks of a device, behind one trait, [`Driver`], made of
//! one sub-trait per topic ([`ops`]).
//!
//! Two implementations: [`cuda::CudaDriver`] (the CUDA driver API through cudarc, on each
//! device's primary context) and [`sim::SimDriver`] (host memory posing as device memory, with
//! streams and events a test controls and faults injected on demand). The allocator core only
//! sees this trait, so everything above it is tested without a GPU. None of these calls is on
//! the cache-hit path.
//!
//! Each operation is written twice: declared, with the documentation of the CUDA call it
//! mirrors, in its sub-trait in `ops.rs`, and implemented, body and all, in the impl of that
//! sub-trait in each driver's file of the mechanism (`cuda/vmm.rs`, `sim/vmm.rs`, ...).
//!
//! - `ops.rs`: the sub-traits (devices, device memory, events and stream capture, virtual
//!   memory, host memory, copies, memory shared with other processes, dma-bufs): the manual for
//!   driver authors, and what a caller imports (`use crate::driver::ops::*;`) to call a driver's
//!   methods on a driver type (through `dyn Driver` they need no import).
//! - `cuda/`: the CUDA driver, through cudarc's bindings of the driver API.
//! - `sim/`: the simulated device, for tests and for machines without a GPU.
//! - `pageable.rs`: ordinary host memory of gpupool's own (`mmap`, `munmap`), what a sleeping
//!   pool's host copy is made of.

pub mod cuda;
pub mod ops;
pub mod pageable;
pub mod sim;

use std::fmt;

use ops::{CopyOps, DeviceOps, DmabufOps, HostMemoryOps, IpcOps, MemoryOps, StreamOps, VirtualMemoryOps};

/// A device address (CUDA `CUdeviceptr`).
pub type DevicePtr = u64;
/// A stream, by the value of its handle (`cudaStream_t`/`CUstream`; 0 is the legacy default
/// stream). Streams are told apart by handle value, as PyTorch does.
pub type StreamHandle = usize;

/// An event created by a driver (CUDA `CUevent`, as an integer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventHandle(pub u64);

/// A physical allocation of device memory, mapped into reserved address ranges by the
/// virtual memory calls (CUDA `CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// Device memory figures from the driver (CUDA `cuMemGetInfo`), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: usize,
    pub total: usize,
}

/// Whether a stream is capturing work into a CUDA graph (`CUstreamCaptureStatus`, with the
/// capture's id from `cuStreamGetCaptureInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing (`CU_STREAM_CAPTURE_STATUS_NONE`): work runs as it is queued.
    None,
    /// Capturing (`CU_STREAM_CAPTURE_STATUS_ACTIVE`); the id is unique to this capture
    /// sequence in the process.
    Active(u64),
    /// The capture was invalidated by an illegal call (`CU_STREAM_CAPTURE_STATUS_INVALIDATED`)
    /// and is not yet ended; the stream is still in capture mode.
    Invalidated,
}

impl CaptureStatus {
    /// Whether the stream is in capture mode (active or invalidated): nothing may wait on it.
    pub fn is_capturing(self) -> bool {
        self != CaptureStatus::None
    }
}

/// How a capture, or a thread, restricts the "potentially unsafe" calls made while a capture is
/// underway (CUDA `CUstreamCaptureMode`; the CUDA Runtime API's
/// `cudaThreadExchangeStreamCaptureMode` describes the rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`: a thread whose own capture was not begun relaxed, or
    /// any thread while another thread's global capture is underway, may not make unsafe calls.
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: only the thread's own captures restrict it.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: the thread is not restricted.
    Relaxed,
}

/// What a driver call can fail with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverError {
    /// The device has no memory left for the request (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// Any other failure of a driver call, with the call's name and CUDA's error code and name.
    Cuda { call: &'static str, code: i32, name: String },
    /// There is no driver library or no device.
    Unavailable(String),
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverError::OutOfMemory => write!(f, "the device is out of memory"),
            DriverError::Cuda { call, code, name } => write!(f, "{call} failed with {name} ({code})"),
            DriverError::Unavailable(why) => write!(f, "{why}"),
        }
    }
}

/// What the allocator needs from a device: every operation of the sub-traits in [`ops`], one
/// per topic (devices, device memory, events and capture, virtual memory, host memory, copies,
/// memory shared with other processes, dma-bufs). Implementations are shared by all threads.
///
/// Device ordinals passed in are valid (`0..device_count()`); the allocator checks them first.
///
/// A driver implements the sub-traits and nothing else: every `Send + Sync` type that implements
/// them all is a `Driver` (the blanket impl below). The allocator holds one as `Arc<dyn Driver>`,
/// through which every method of the sub-traits is called with no import (a trait object's
/// methods, its supertraits' included, are always in scope); calling them on a driver type
/// itself (a test's `SimDriver`) needs the sub-traits in scope: `use crate::driver::ops::*;`.
pub trait Driver:
    DeviceOps + MemoryOps + StreamOps + VirtualMemoryOps + HostMemoryOps + CopyOps + IpcOps + DmabufOps + Send + Sync
{
}

impl<T> Driver for T where
    T: DeviceOps
        + MemoryOps
        + StreamOps
        + VirtualMemoryOps
        + HostMemoryOps
        + CopyOps
        + IpcOps
        + DmabufOps
        + Send
        + Sync
{
}

/// A host address (a `void *` of page-locked host memory, as an integer).
pub type HostPtr = usize;
