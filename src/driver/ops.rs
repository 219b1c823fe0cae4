//! What a driver does, one sub-trait of [`Driver`](super::Driver) per topic: the manual for
//! driver authors, each method's documentation naming the CUDA call it mirrors.
//!
//! A driver implements each sub-trait in the file of its mechanism (`cuda/vmm.rs` implements
//! [`VirtualMemoryOps`] for the CUDA driver, `sim/vmm.rs` for the simulated one), with each
//! operation's body inside the impl; a type that implements them all is a
//! [`Driver`](super::Driver). Through `dyn Driver` the methods need no import; code that calls
//! them on a driver type itself (a test's `SimDriver`) brings them into scope with one import:
//! `use crate::driver::ops::*;` (`gpupool::driver::ops::*` outside the crate).

use super::{
    CaptureMode, CaptureStatus, DevicePtr, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
    pageable,
};

/// The devices and their contexts: how many there are, which one is current on the calling
/// thread, and which one a stream belongs to.
pub trait DeviceOps {
    /// A short name for messages ("cuda", "sim").
    fn name(&self) -> &'static str;

    /// Number of devices.
    fn device_count(&self) -> i32;

    /// The calling thread's current device (the runtime API's `cudaGetDevice`).
    fn current_device(&self) -> Result<i32, DriverError>;

    /// The device whose primary context is current on the calling thread; `None` when no
    /// context, or a context the program created itself (`cuCtxCreate`), is current. Memory
    /// from gpupool is valid only in primary contexts.
    fn current_primary_device(&self) -> Result<Option<i32>, DriverError>;

    /// The device whose context `stream` belongs to (`cuStreamGetCtx`, then that context's
    /// device), so that an event recorded on it is created in the right context. The legacy
    /// default stream (0), `CU_STREAM_LEGACY` (1) and `CU_STREAM_PER_THREAD` (2) belong to the
    /// calling thread's current context: [`Self::current_device`].
    fn stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError>;
}

/// Device memory of `cuMemAlloc`: the segments of a pool without expandable segments, and the
/// memory a legacy IPC handle names.
pub trait MemoryOps {
    /// Allocates `size` bytes of device memory (`cuMemAlloc`).
    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError>;

    /// Frees memory from [`Self::mem_alloc`] (`cuMemFree`).
    fn mem_free(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError>;

    /// Free and total memory of the device (`cuMemGetInfo`).
    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError>;
}

/// Events, synchronisation and stream capture on the program's streams: how the allocator
/// learns that the work before a block's free is done (PyTorch's events of `record_stream`),
/// and whether a stream captures into a CUDA graph. The allocator asks the capture status before
/// a call that CUDA forbids while a stream captures, never on the cache-hit path.
pub trait StreamOps {
    /// Creates an event without timing (`cuEventCreate(CU_EVENT_DISABLE_TIMING)`).
    fn event_create(&self, device: i32) -> Result<EventHandle, DriverError>;

    /// Records `event` on `stream` (`cuEventRecord`).
    fn event_record(&self, device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError>;

    /// Whether the work before the event has completed (`cuEventQuery`), never blocking.
    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError>;

    /// Blocks until the event has completed (`cuEventSynchronize`).
    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError>;

    /// Destroys an event (`cuEventDestroy`).
    fn event_destroy(&self, device: i32, event: EventHandle);

    /// Blocks until all work queued on the device so far, on every stream, has completed
    /// (`cuCtxSynchronize` in its primary context; what `cudaFree` waits for).
    fn device_synchronize(&self, device: i32) -> Result<(), DriverError>;

    /// Whether `stream` (a stream of `device`; 0 is the legacy default stream in the device's
    /// primary context) is capturing, and the capture's id (`cuStreamGetCaptureInfo`). A
    /// driver without the capture calls answers [`CaptureStatus::None`]: nothing can capture.
    fn stream_capture_status(&self, device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError>;

    /// Sets the calling thread's capture mode to `mode` and returns the one it replaces
    /// (`cuThreadExchangeStreamCaptureMode`). [`CaptureMode::Relaxed`] lets the thread make
    /// calls such as `cuMemAlloc` while a stream captures (PyTorch's
    /// `cudaMallocMaybeCapturing`); the caller sets the old mode back after.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError>;
}

/// The virtual memory calls of expandable segments (PyTorch's `ExpandableSegment`): address
/// space reserved with nothing behind it, physical memory created and mapped into it, and the
/// devices granted access to what is mapped.
pub trait VirtualMemoryOps {
    /// The page size of the virtual memory calls on `device`, in bytes: the minimum
    /// granularity of pinned device memory (`cuMemGetAllocationGranularity`, 2 MiB on H100).
    /// `Ok(None)` when the device or the driver cannot manage virtual memory
    /// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` is 0, or the driver library
    /// lacks the calls): expandable segments are then unavailable.
    fn vmm_granularity(&self, device: i32) -> Result<Option<usize>, DriverError>;

    /// Reserves `size` bytes of device address space, aligned to the granularity, with no
    /// memory behind it (`cuMemAddressReserve`). `size` is a multiple of the granularity.
    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError>;

    /// Gives back a range from [`Self::address_reserve`], wholly unmapped (`cuMemAddressFree`).
    fn address_free(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError>;

    /// Creates `size` bytes of physical memory on `device` (`cuMemCreate`, pinned device
    /// memory); `size` is a multiple of the granularity. Counts against the device's memory
    /// until released ([`DriverError::OutOfMemory`] when there is none left).
    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError>;

    /// Releases a handle from [`Self::mem_create`] that is mapped nowhere (`cuMemRelease`).
    fn mem_release(&self, device: i32, handle: PhysHandle) -> Result<(), DriverError>;

    /// Maps all of `handle` (`size` bytes) at `ptr`, inside a reserved range (`cuMemMap`).
    /// The memory is not accessible until [`Self::mem_set_access`].
    fn mem_map(&self, device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError>;

    /// Sets the access of each device of `to` (ordinals, as `device`) to the mapped range of
    /// `device`'s memory, in one `cuMemSetAccess`: readable and writable with `read_write`,
    /// none without (`CU_MEM_ACCESS_FLAGS_PROT_READWRITE`, `_PROT_NONE`); the other devices'
    /// access is left as it was. A map grants `device` itself and the peers enabled
    /// (`caching::peers`, PyTorch `ExpandableSegment::setAccess` for the device and its
    /// `peers_`); enabling a peer later grants it alone over each mapped range (PyTorch
    /// `ExpandableSegment::addPeer`). Mapped memory is reachable from exactly the devices granted
    /// here: `cudaDeviceEnablePeerAccess` does not apply to it.
    fn mem_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: usize,
        to: &[i32],
        read_write: bool,
    ) -> Result<(), DriverError>;

    /// Whether kernels and copies on `accessor` can reach memory of `owner` directly
    /// (`cuDeviceCanAccessPeer(&can, accessor, owner)`; a device reaches its own): what
    /// `gpupool_enable_peer_access` asks before it grants a peer. The default: every device can.
    fn can_access_peer(&self, accessor: i32, owner: i32) -> Result<bool, DriverError> {
        let _ = (accessor, owner);
        Ok(true)
    }

    /// Unmaps `size` bytes at `ptr` (`cuMemUnmap`). Does not wait for work that may still
    /// use the memory: the caller has made sure none does.
    fn mem_unmap(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError>;

    /// For consistency checks only: whether `handle` is a live handle from
    /// [`Self::mem_create`] that is mapped nowhere (`Some(false)`: mapped somewhere, or
    /// released). `None` when the driver cannot tell: CUDA has no such query, so the CUDA
    /// driver answers `None`; the simulated device answers.
    fn handle_is_free(&self, handle: PhysHandle) -> Option<bool> {
        let _ = handle;
        None
    }
}

/// Host memory. Pinned memory is what the caching host allocator (`crate::host`) hands out:
/// host pointers are plain addresses ([`HostPtr`]); the calls run in `device`'s primary
/// context, and the memory is portable (usable from every context), so which device is named
/// matters only for where the driver books the call. Pageable memory of gpupool's own
/// ([`HostMemoryOps::host_map`]) is what a sleeping pool's host copy is made of.
pub trait HostMemoryOps {
    /// Allocates `size` bytes of page-locked host memory, portable to every context
    /// (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE`). [`DriverError::OutOfMemory`] when
    /// the host cannot pin that much.
    fn host_alloc(&self, device: i32, size: usize) -> Result<HostPtr, DriverError>;

    /// Frees memory from [`Self::host_alloc`] (`cuMemFreeHost`). Does not wait for work that
    /// may still use it: the caller has made sure none does.
    fn host_free(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError>;

    /// Page-locks `size` bytes of ordinary host memory at `ptr`, portable to every context
    /// (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`).
    fn host_register(&self, device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError>;

    /// Unlocks a range from [`Self::host_register`], given by its start (`cuMemHostUnregister`).
    fn host_unregister(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError>;

    /// Maps `size` bytes of ordinary pageable host memory of gpupool's own, zeroed
    /// (`pageable::map`: an anonymous `mmap`, transparent huge pages asked for with
    /// `huge_pages`): a sleeping pool's host copy. Not pinned, so never the host side of a
    /// copy queued on a stream. [`DriverError::OutOfMemory`] when the system refuses it.
    fn host_map(&self, size: usize, huge_pages: bool) -> Result<HostPtr, DriverError> {
        pageable::map(size, huge_pages)
    }

    /// Unmaps memory from [`Self::host_map`] (`pageable::unmap`, `munmap`): its pages go back
    /// to the system. The caller has made sure nothing uses it any more.
    fn host_unmap(&self, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        pageable::unmap(ptr, size)
    }
}

/// Copies between device memory and pinned host memory, on streams of gpupool's own: what
/// `gpupool_sleep` and `gpupool_wake` offload and restore with (`caching::sleep::copy`). Never
/// on the allocator's other paths.
pub trait CopyOps {
    /// Creates a stream on `device` that does not synchronise with the legacy default stream
    /// (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`).
    fn stream_create(&self, device: i32) -> Result<StreamHandle, DriverError>;

    /// Destroys a stream from [`Self::stream_create`] (`cuStreamDestroy`); work queued on it
    /// still completes.
    fn stream_destroy(&self, device: i32, stream: StreamHandle) -> Result<(), DriverError>;

    /// Blocks until the work queued on `stream` so far has completed (`cuStreamSynchronize`).
    fn stream_synchronize(&self, device: i32, stream: StreamHandle) -> Result<(), DriverError>;

    /// Queues a copy of `size` bytes from device memory at `src` to pinned host memory at
    /// `dst` on `stream` (`cuMemcpyDtoHAsync`); both ranges are valid until the stream has
    /// passed it.
    fn memcpy_dtoh_async(
        &self,
        device: i32,
        dst: HostPtr,
        src: DevicePtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// Queues a copy of `size` bytes from pinned host memory at `src` to device memory at
    /// `dst` on `stream` (`cuMemcpyHtoDAsync`); both ranges are valid until the stream has
    /// passed it.
    fn memcpy_htod_async(
        &self,
        device: i32,
        dst: DevicePtr,
        src: HostPtr,
        size: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
}

/// Memory shared with other processes (`gpupool_ipc_*`, `caching::ipc`): never on the
/// allocator's other paths. The defaults refuse, for a driver that cannot share.
pub trait IpcOps {
    /// The device's UUID (`cuDeviceGetUuid_v2`): 16 bytes that name the GPU in every process,
    /// whatever its ordinal there (`CUDA_VISIBLE_DEVICES`).
    fn device_uuid(&self, device: i32) -> Result<[u8; 16], DriverError> {
        let _ = device;
        Err(not_shareable("cuDeviceGetUuid_v2"))
    }

    /// Exports the physical allocation `handle` (from [`VirtualMemoryOps::mem_create`]) as a
    /// POSIX file descriptor that another process imports (`cuMemExportToShareableHandle`,
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). The caller owns the descriptor; the
    /// memory lives while the handle, any import of it, or any mapping of either does.
    fn mem_export(&self, device: i32, handle: PhysHandle) -> Result<std::os::fd::OwnedFd, DriverError> {
        let _ = (device, handle);
        Err(not_shareable("cuMemExportToShareableHandle"))
    }

    /// Imports a descriptor from [`Self::mem_export`], of any process, as a handle of
    /// `size` bytes on `device` that the caller maps and releases as one from
    /// [`VirtualMemoryOps::mem_create`] (`cuMemImportFromShareableHandle`). The descriptor
    /// stays the caller's. The memory counts against the exporter's device, not again here.
    fn mem_import(&self, device: i32, fd: std::os::fd::BorrowedFd<'_>, size: usize) -> Result<PhysHandle, DriverError> {
        let _ = (device, fd, size);
        Err(not_shareable("cuMemImportFromShareableHandle"))
    }

    /// The interprocess handle of the allocation at `ptr` (from [`MemoryOps::mem_alloc`], its
    /// start) (`cuIpcGetMemHandle`): 64 opaque bytes.
    fn ipc_get_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<[u8; 64], DriverError> {
        let _ = (device, ptr);
        Err(not_shareable("cuIpcGetMemHandle"))
    }

    /// Maps the allocation of another process's [`Self::ipc_get_mem_handle`] into this one
    /// and returns its start (`cuIpcOpenMemHandle` with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). One open per handle and process: the caller
    /// counts its own uses.
    fn ipc_open_mem_handle(&self, device: i32, handle: &[u8; 64]) -> Result<DevicePtr, DriverError> {
        let _ = (device, handle);
        Err(not_shareable("cuIpcOpenMemHandle_v2"))
    }

    /// Unmaps an allocation from [`Self::ipc_open_mem_handle`] (`cuIpcCloseMemHandle`).
    fn ipc_close_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        let _ = (device, ptr);
        Err(not_shareable("cuIpcCloseMemHandle"))
    }
}

/// Registration for transports (`gpupool_segment_mapped_range`, `caching::registration`):
/// never on the allocator's other paths. The default refuses, for a driver that cannot.
pub trait DmabufOps {
    /// A dma-buf file descriptor for `size` bytes of device memory at `ptr` on `device`
    /// (`cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`, flags 0),
    /// what an RDMA transport registers (`ibv_reg_dmabuf_mr`). The caller owns the descriptor;
    /// its size (`lseek(fd, 0, SEEK_END)`) is `size`.
    ///
    /// CUDA's rules, which the simulated device checks too: `ptr` and `size` are multiples of
    /// the host page size and `size` is not 0; the range lies in one allocation of
    /// [`MemoryOps::mem_alloc`], or in one range of [`VirtualMemoryOps::address_reserve`]
    /// whose every byte is mapped ([`VirtualMemoryOps::mem_map`]), by any number of physical
    /// allocations side by side, all of `device` and with identical properties (CUDA Driver
    /// API, `cuMemGetHandleForAddressRange`). A descriptor names the physical memory mapped when it
    /// was made: after a range is unmapped or remapped, CUDA asks for a new one.
    ///
    /// Errors: [`DriverError::Unavailable`] when the driver lacks the call or the device cannot
    /// export dma-bufs (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` is 0); [`DriverError::Cuda`]
    /// (`CUDA_ERROR_INVALID_VALUE`) for a range that breaks a rule above.
    fn mem_range_dmabuf(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<std::os::fd::OwnedFd, DriverError> {
        let _ = (device, ptr, size);
        Err(DriverError::Unavailable(
            "this driver cannot export device memory as a dma-buf (cuMemGetHandleForAddressRange)".into(),
        ))
    }
}

/// The error of a driver that cannot share memory between processes.
fn not_shareable(call: &'static str) -> DriverError {
    DriverError::Unavailable(format!("this driver cannot share memory between processes ({call})"))
}
