//! dma-buf descriptors of device memory for transports (`cuMemGetHandleForAddressRange` with
//! `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`), and whether the device can export them
//! (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`). Optional: looked up at each call (a cold call,
//! made once per registration), and a driver without it starts, refusing only the export.
//!
//! The descriptor is what `ibv_reg_dmabuf_mr` registers with an RDMA NIC (GPUDirect RDMA
//! without `nvidia-peermem`); CUDA 11.7 and later, with the open kernel modules or a driver
//! and kernel that support dma-buf (Linux 5.12 and later).

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::loading::exported;
use super::{CudaDriver, DevicePtr, DriverError, check};
use crate::driver::ops::DmabufOps;

/// The driver functions of the dma-buf export, checked before each call (cudarc panics at
/// the first call of a missing one).
pub(super) const DMABUF_FUNCTIONS: [&str; 2] = ["cuDeviceGetAttribute", "cuMemGetHandleForAddressRange"];

impl DmabufOps for CudaDriver {
    fn mem_range_dmabuf(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<OwnedFd, DriverError> {
        if let Some(name) = super::loading::first_missing(&DMABUF_FUNCTIONS, exported) {
            return Err(DriverError::Unavailable(format!(
                "the CUDA driver library (libcuda.so.1) lacks {name}, which a dma-buf export of device memory needs \
                 (CUDA 11.7 and later)"
            )));
        }
        let dev = self.devices[device as usize];
        let mut supported = 0;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED;
        // SAFETY: writes one int; the device is from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut supported, attr, dev) })?;
        if supported == 0 {
            return Err(DriverError::Unavailable(format!(
                "device {device} cannot export its memory as a dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: \
                 it takes the NVIDIA open kernel modules, or a driver and Linux kernel with dma-buf support)"
            )));
        }
        self.in_context(device, || {
            let mut fd: libc::c_int = -1;
            let kind = sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
            // SAFETY: for a dma-buf the handle is one int, written by the call; flags 0 (the
            // default mapping type).
            check("cuMemGetHandleForAddressRange", unsafe {
                sys::cuMemGetHandleForAddressRange((&mut fd as *mut libc::c_int).cast(), ptr, size, kind, 0)
            })?;
            // SAFETY: a descriptor the driver just opened for us.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })
    }
}
