//! Device memory (`cuMemAlloc`, `cuMemFree`, `cuMemGetInfo`) and pinned host memory
//! (`cuMemHostAlloc`, `cuMemHostRegister` and their inverses), each in the device's primary
//! context.

use cudarc::driver::sys;

use super::{CudaDriver, DevicePtr, DriverError, HostPtr, MemInfo, check};
use crate::driver::ops::{HostMemoryOps, MemoryOps};

impl MemoryOps for CudaDriver {
    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.in_context(device, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer.
            check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, size) })?;
            Ok(ptr)
        })
    }

    fn mem_free(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        // SAFETY: `ptr` came from mem_alloc on this device and is not in use by gpupool.
        self.in_context(device, || check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) }))
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        self.in_context(device, || {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: writes two sizes.
            check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
            Ok(MemInfo { free, total })
        })
    }
}

impl HostMemoryOps for CudaDriver {
    fn host_alloc(&self, device: i32, size: usize) -> Result<HostPtr, DriverError> {
        self.in_context(device, || {
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: writes one pointer; PORTABLE makes the memory usable from every context.
            check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE) })?;
            Ok(p as HostPtr)
        })
    }

    fn host_free(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        // SAFETY: `ptr` came from host_alloc and no work uses it (the caller's duty).
        self.in_context(device, || check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr as *mut _) }))
    }

    fn host_register(&self, device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `ptr` points to `size` bytes the caller owns, allocated and not registered yet.
        self.in_context(device, || {
            check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(ptr as *mut _, size, flags) })
        })
    }

    fn host_unregister(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        // SAFETY: `ptr` is the start of a range registered by host_register.
        self.in_context(device, || check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(ptr as *mut _) }))
    }
}
