//! Memory shared with other processes: the device's UUID (`cuDeviceGetUuid_v2`), pages of
//! expandable segments as POSIX file descriptors (`cuMemExportToShareableHandle`,
//! `cuMemImportFromShareableHandle`), and ordinary segments through the legacy IPC handles
//! (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`). Optional: looked up
//! at start, and a driver without them starts, refusing only to share.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{CudaDriver, DevicePtr, DriverError, PhysHandle, check};
use crate::driver::ops::IpcOps;

/// The driver functions of sharing memory (CUDA 10.2 and later, `cuDeviceGetUuid_v2` 11.4).
/// Not required at start.
pub(super) const IPC_FUNCTIONS: [&str; 6] = [
    "cuDeviceGetUuid_v2",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
];

impl CudaDriver {
    /// `Ok` when the driver library has every function of [`IPC_FUNCTIONS`].
    fn ipc_functions(&self) -> Result<(), DriverError> {
        match self.ipc_missing {
            None => Ok(()),
            Some(name) => Err(DriverError::Unavailable(format!(
                "the CUDA driver library (libcuda.so.1) lacks {name}, which sharing memory between processes needs: \
                 the driver is too old"
            ))),
        }
    }
}

impl IpcOps for CudaDriver {
    fn device_uuid(&self, device: i32) -> Result<[u8; 16], DriverError> {
        self.ipc_functions()?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: writes one CUuuid; the device is from cuDeviceGet.
        check("cuDeviceGetUuid_v2", unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, self.devices[device as usize]) })?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    fn mem_export(&self, device: i32, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
        self.ipc_functions()?;
        if self.fd_handles_refused.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DriverError::Unavailable(
                "this driver refused file-descriptor handles in cuMemCreate (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), \
                 so expandable segments' pages cannot be exported here; use expandable_segments:False for memory \
                 to share"
                    .into(),
            ));
        }
        self.in_context(device, || {
            let mut fd: libc::c_int = -1;
            let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            // SAFETY: writes one int (the descriptor) for a live handle; flags 0 as required.
            check("cuMemExportToShareableHandle", unsafe {
                sys::cuMemExportToShareableHandle((&mut fd as *mut libc::c_int).cast(), handle.0, kind, 0)
            })?;
            // SAFETY: a descriptor the driver just opened for us.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })
    }

    fn mem_import(&self, device: i32, fd: BorrowedFd<'_>, _size: usize) -> Result<PhysHandle, DriverError> {
        self.ipc_functions()?;
        self.in_context(device, || {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            // For POSIX descriptors the "OS handle" is the descriptor's value cast to a pointer
            // (cuda.h, cuMemImportFromShareableHandle); the driver does not take it over.
            let os_handle = fd.as_raw_fd() as usize as *mut std::ffi::c_void;
            // SAFETY: writes one handle; the descriptor is open for the call.
            check("cuMemImportFromShareableHandle", unsafe {
                sys::cuMemImportFromShareableHandle(&mut handle, os_handle, kind)
            })?;
            Ok(PhysHandle(handle))
        })
    }

    fn ipc_get_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<[u8; 64], DriverError> {
        self.ipc_functions()?;
        self.in_context(device, || {
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: writes one CUipcMemHandle; `ptr` is an allocation of cuMemAlloc.
            check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) })?;
            Ok(h.reserved.map(|b| b as u8))
        })
    }

    fn ipc_open_mem_handle(&self, device: i32, handle: &[u8; 64]) -> Result<DevicePtr, DriverError> {
        self.ipc_functions()?;
        self.in_context(device, || {
            let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
            let mut ptr: sys::CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: writes one device pointer; the handle is passed by value.
            check("cuIpcOpenMemHandle_v2", unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) })?;
            Ok(ptr)
        })
    }

    fn ipc_close_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.ipc_functions()?;
        // SAFETY: a pointer from cuIpcOpenMemHandle, not used after.
        self.in_context(device, || check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(ptr) }))
    }
}
