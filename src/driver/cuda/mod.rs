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
//! missing, or the device cannot manage virtual memory, [`Driver::vmm_granularity`] says so
//! (`Ok(None)`) and the allocator keeps to `cuMemAlloc` segments, as PyTorch does when
//! `expandable_segments` cannot be honoured.
//!
//! This file holds the driver's state and the [`Driver`] impl, which forwards each call to the
//! file of its mechanism, as an inherent method named `cuda_<call>` (an inherent method of the
//! trait's name would shadow the trait's): loading the library and the devices in `loading`,
//! the primary contexts in `context`, device and pinned host memory in `memory`, virtual memory
//! in `vmm`, copies and copy streams in `copy`, events, synchronisation and stream capture in
//! `streams`, memory shared with other processes (the device's UUID, pages exported as file
//! descriptors, legacy IPC handles) in `ipc`, dma-buf descriptors for transports in `dmabuf`,
//! and CUDA's error codes in `error`; its unit tests, which need no GPU, in `tests.rs`.

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
    CaptureMode, CaptureStatus, DevicePtr, Driver, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
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

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> i32 {
        self.devices.len() as i32
    }

    fn current_device(&self) -> Result<i32, DriverError> {
        self.cuda_current_device()
    }

    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.cuda_mem_alloc(device, size)
    }

    fn mem_free(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.cuda_mem_free(device, ptr)
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        self.cuda_mem_info(device)
    }

    fn event_create(&self, device: i32) -> Result<EventHandle, DriverError> {
        self.cuda_event_create(device)
    }

    fn event_record(&self, device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        self.cuda_event_record(device, event, stream)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        self.cuda_event_query(event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        self.cuda_event_synchronize(event)
    }

    fn event_destroy(&self, device: i32, event: EventHandle) {
        self.cuda_event_destroy(device, event)
    }

    fn device_synchronize(&self, device: i32) -> Result<(), DriverError> {
        self.cuda_device_synchronize(device)
    }

    fn current_primary_device(&self) -> Result<Option<i32>, DriverError> {
        self.cuda_current_primary_device()
    }

    fn host_alloc(&self, device: i32, size: usize) -> Result<HostPtr, DriverError> {
        self.cuda_host_alloc(device, size)
    }

    fn host_free(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.cuda_host_free(device, ptr)
    }

    fn host_register(&self, device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        self.cuda_host_register(device, ptr, size)
    }

    fn host_unregister(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.cuda_host_unregister(device, ptr)
    }

    fn stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError> {
        self.cuda_stream_device(stream)
    }

    fn vmm_granularity(&self, device: i32) -> Result<Option<usize>, DriverError> {
        self.cuda_vmm_granularity(device)
    }

    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.cuda_address_reserve(device, size)
    }

    fn address_free(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.cuda_address_free(device, ptr, size)
    }

    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError> {
        self.cuda_mem_create(device, size)
    }

    fn mem_release(&self, device: i32, handle: PhysHandle) -> Result<(), DriverError> {
        self.cuda_mem_release(device, handle)
    }

    fn mem_map(&self, device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError> {
        self.cuda_mem_map(device, ptr, size, handle)
    }

    fn mem_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: usize,
        to: &[i32],
        read_write: bool,
    ) -> Result<(), DriverError> {
        self.cuda_mem_set_access(device, ptr, size, to, read_write)
    }

    fn can_access_peer(&self, accessor: i32, owner: i32) -> Result<bool, DriverError> {
        self.cuda_can_access_peer(accessor, owner)
    }

    fn mem_unmap(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.cuda_mem_unmap(device, ptr, size)
    }

    fn stream_capture_status(&self, device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        self.cuda_stream_capture_status(device, stream)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        self.cuda_exchange_capture_mode(mode)
    }

    fn stream_create(&self, device: i32) -> Result<StreamHandle, DriverError> {
        self.cuda_stream_create(device)
    }

    fn stream_destroy(&self, device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        self.cuda_stream_destroy(device, stream)
    }

    fn stream_synchronize(&self, device: i32, stream: StreamHandle) -> Result<(), DriverError> {
        self.cuda_stream_synchronize(device, stream)
    }

    fn memcpy_dtoh_async(
        &self,
        device: i32,
        dst: HostPtr,
        src: DevicePtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.cuda_memcpy_dtoh(device, dst, src, size, stream)
    }

    fn memcpy_htod_async(
        &self,
        device: i32,
        dst: DevicePtr,
        src: HostPtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.cuda_memcpy_htod(device, dst, src, size, stream)
    }

    fn device_uuid(&self, device: i32) -> Result<[u8; 16], DriverError> {
        self.cuda_device_uuid(device)
    }

    fn mem_export(&self, device: i32, handle: PhysHandle) -> Result<std::os::fd::OwnedFd, DriverError> {
        self.cuda_mem_export(device, handle)
    }

    fn mem_import(&self, device: i32, fd: std::os::fd::BorrowedFd<'_>, size: usize) -> Result<PhysHandle, DriverError> {
        self.cuda_mem_import(device, fd, size)
    }

    fn ipc_get_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<[u8; 64], DriverError> {
        self.cuda_ipc_get_mem_handle(device, ptr)
    }

    fn ipc_open_mem_handle(&self, device: i32, handle: &[u8; 64]) -> Result<DevicePtr, DriverError> {
        self.cuda_ipc_open_mem_handle(device, handle)
    }

    fn ipc_close_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.cuda_ipc_close_mem_handle(device, ptr)
    }

    fn mem_range_dmabuf(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<std::os::fd::OwnedFd, DriverError> {
        self.cuda_mem_range_dmabuf(device, ptr, size)
    }
}
