//! The CUDA driver, through cudarc's bindings of the driver API (`libcuda.so.1`, loaded at run
//! time so gpupool builds and links with no CUDA toolkit).
//!
//! Every call runs in the device's primary context (`cuDevicePrimaryCtxRetain`), pushed for the
//! call and popped after, so the caller's current context is left as it was and pointers are
//! valid for code that uses the runtime API (which also uses primary contexts).
//!
//! cudarc panics when its library is missing, or when a function it is asked for is missing
//! from it (a partial stub, as some containers ship); [`CudaDriver::new`] checks for the
//! library and for every function gpupool calls first, and returns
//! [`DriverError::Unavailable`] naming what is missing instead, printing nothing.
//!
//! The virtual memory calls (expandable segments) are optional: a driver without them still
//! starts. Their functions are looked up once at start, apart from the required ones; when one is
//! missing, or the device cannot manage virtual memory, `vmm_granularity` says so
//! (`Ok(None)`) and the allocator keeps to `cuMemAlloc` segments, as PyTorch does when
//! `expandable_segments` cannot be honoured.
//!
//! This file holds the driver's state. Each sub-trait of [`Driver`](super::Driver) (see
//! [`ops`](super::ops)) is implemented in the file of its mechanism, each call's body in the
//! impl: loading the library and the devices in `loading`; the primary contexts, and the
//! devices' calls ([`DeviceOps`](super::ops::DeviceOps)), in `context`; device memory and
//! pinned host memory (`MemoryOps`, `HostMemoryOps`) in `memory`; virtual memory
//! (`VirtualMemoryOps`) in `vmm`; copies and copy streams (`CopyOps`) in `copy`; events,
//! synchronisation and stream capture (`StreamOps`) in `streams`; memory shared with other
//! processes (`IpcOps`: the device's UUID, pages exported as file descriptors, legacy IPC
//! handles) in `ipc`; dma-buf descriptors for transports (`DmabufOps`) in `dmabuf`; and CUDA's
//! error codes in `error`; its unit tests, which need no GPU, in `tests.rs`.

mod context;
mod copy;
mod dmabuf;
mod error;
mod ipc;
mod loading;
mod memory;
mod streams;
#[cfg(test)]
mod tests;
mod vmm;

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{
    CaptureMode, CaptureStatus, DevicePtr, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
};
use error::check;

/// The CUDA driver for every device of the machine.
pub struct CudaDriver {
    devices: Vec<sys::CUdevice>,
    /// Primary contexts (as integers: `CUcontext` is a raw pointer), retained on first use.
    contexts: Vec<OnceLock<Result<usize, DriverError>>>,
    /// The first of [`VMM_FUNCTIONS`](loading::VMM_FUNCTIONS) that the driver library lacks,
    /// looked up at start.
    vmm_missing: Option<&'static str>,
    /// Per device: the virtual memory granularity, `None` where the device cannot manage
    /// virtual memory; set on the first answer (a failed query is asked again next time).
    granularity: Vec<OnceLock<Option<usize>>>,
    /// Per device: whether its pages are made GPUDirect RDMA capable
    /// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`), set with the granularity.
    rdma_vmm: Vec<OnceLock<bool>>,
    /// Whether the driver library has every function of
    /// [`CAPTURE_FUNCTIONS`](loading::CAPTURE_FUNCTIONS).
    capture: bool,
    /// The first of [`IPC_FUNCTIONS`](ipc::IPC_FUNCTIONS) that the driver library lacks,
    /// looked up at start: memory cannot be shared then.
    ipc_missing: Option<&'static str>,
    /// `cuMemCreate` refused file-descriptor handles once: pages are made without, and cannot
    /// be exported.
    fd_handles_refused: std::sync::atomic::AtomicBool,
}
