//! The virtual memory calls of expandable segments (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess` and their inverses): optional, refused with the name of a
//! missing function before cudarc could panic on it; the granularity, found once per device,
//! and the access granted to the devices the allocator names.

use cudarc::driver::sys;

use super::{CudaDriver, DevicePtr, DriverError, PhysHandle, check};
use crate::driver::ops::VirtualMemoryOps;

/// What `cuMemCreate` is asked for, and what the granularity is queried for: pinned memory on
/// device `dev` (a `CUdevice`), as PyTorch's `ExpandableSegment::map` fills it. With
/// `shareable`, the handle type PyTorch requests, `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`,
/// so that a page can be exported to another process (`gpupool_ipc_export`, PyTorch's
/// `ExpandableSegment::share`); without, none, for where file-descriptor handles are refused
/// (see [`CudaDriver::mem_create`]). With `rdma`, marked GPUDirect RDMA capable
/// (`allocFlags.gpuDirectRDMACapable`), asked where the device says it may be
/// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`), as NCCL's `ncclCuMemAlloc`
/// does: so that a transport may register the pages with an RDMA NIC (a dma-buf of them,
/// `gpupool_segment_mapped_range`); some platforms (an ARM SMMU) refuse unmarked memory, and
/// devices without the attribute (integrated GPUs) refuse the flag.
pub(super) fn allocation_prop(dev: sys::CUdevice, shareable: bool, rdma: bool) -> sys::CUmemAllocationProp {
    use sys::CUmemAllocationHandleType as H;
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if shareable {
            H::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            H::CU_MEM_HANDLE_TYPE_NONE
        },
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
        win32HandleMetaData: std::ptr::null_mut(),
        // No compression, no special usage: what `prop = {}` leaves.
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: rdma as u8,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The access descriptors of one `cuMemSetAccess`: read and write (or none, without
/// `read_write`) from each device of `to` (`CUdevice`s), in order.
pub(super) fn access_descs(to: &[sys::CUdevice], read_write: bool) -> Vec<sys::CUmemAccessDesc> {
    use sys::CUmemAccess_flags as F;
    let flags = if read_write { F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE } else { F::CU_MEM_ACCESS_FLAGS_PROT_NONE };
    to.iter()
        .map(|&dev| sys::CUmemAccessDesc {
            location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
            flags,
        })
        .collect()
}

impl CudaDriver {
    /// `Ok` when the driver library has every virtual memory function; otherwise
    /// [`DriverError::Unavailable`] naming the missing one, before anything calls it (cudarc
    /// would panic).
    fn vmm_functions(&self) -> Result<(), DriverError> {
        match self.vmm_missing {
            None => Ok(()),
            Some(name) => Err(DriverError::Unavailable(format!(
                "the CUDA driver library (libcuda.so.1) lacks {name}, which the virtual memory calls of \
                 expandable segments need: the driver is too old or incomplete; expandable segments are unavailable"
            ))),
        }
    }

    /// The granularity of [`VirtualMemoryOps::vmm_granularity`], or [`DriverError::Unavailable`] where
    /// the device cannot manage virtual memory.
    fn granularity(&self, device: i32) -> Result<usize, DriverError> {
        self.vmm_granularity(device)?.ok_or_else(|| {
            DriverError::Unavailable(format!(
                "device {device} cannot manage virtual memory \
                 (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0): expandable segments are unavailable"
            ))
        })
    }
}

impl VirtualMemoryOps for CudaDriver {
    fn vmm_granularity(&self, device: i32) -> Result<Option<usize>, DriverError> {
        if self.vmm_missing.is_some() {
            return Ok(None);
        }
        let cached = &self.granularity[device as usize];
        if let Some(&g) = cached.get() {
            return Ok(g);
        }
        let dev = self.devices[device as usize];
        let g = self.in_context(device, || {
            let mut supported = 0;
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
            // SAFETY: writes one int; cuDeviceGetAttribute was found at start.
            check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut supported, attr, dev) })?;
            if supported == 0 {
                return Ok(None);
            }
            let mut rdma = 0;
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED;
            // SAFETY: writes one int. A failed query reads as no: the pages are then unmarked.
            let asked = unsafe { sys::cuDeviceGetAttribute(&mut rdma, attr, dev) };
            let rdma = asked == sys::CUresult::CUDA_SUCCESS && rdma != 0;
            let _ = self.rdma_vmm[device as usize].set(rdma);
            let prop = allocation_prop(dev, false, rdma);
            let mut granularity = 0usize;
            let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
            // SAFETY: writes one size; `prop` outlives the call.
            check("cuMemGetAllocationGranularity", unsafe {
                sys::cuMemGetAllocationGranularity(&mut granularity, &prop, minimum)
            })?;
            // A granularity of 0 cannot size pages: treated as no virtual memory management.
            Ok((granularity > 0).then_some(granularity))
        })?;
        Ok(*cached.get_or_init(|| g))
    }

    /// Asks for the granularity as the alignment: the trait promises it and `cuMemMap` needs
    /// addresses that are multiples of it. PyTorch passes 0 (the driver's default alignment)
    /// and relies on that default being enough; an explicit alignment must be a power of two,
    /// so any other granularity falls back to the default.
    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.vmm_functions()?;
        let granularity = self.granularity(device)?;
        let alignment = if granularity.is_power_of_two() { granularity } else { 0 };
        self.in_context(device, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer; no address hint (0), flags 0 as required.
            check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0) })?;
            Ok(ptr)
        })
    }

    fn address_free(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: `ptr` and `size` are a whole reservation from address_reserve, unmapped.
        self.in_context(device, || check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(ptr, size) }))
    }

    /// Asks for file-descriptor handles (exportable, `gpupool_ipc_export`) as PyTorch does for
    /// expandable segments; where the driver refuses them (`CUDA_ERROR_NOT_SUPPORTED` or
    /// `CUDA_ERROR_INVALID_VALUE`: some containers and virtual GPUs), asks again without and
    /// never asks for them again in this process, and an export then says why it cannot.
    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError> {
        use std::sync::atomic::Ordering;
        self.vmm_functions()?;
        let dev = self.devices[device as usize];
        // Known once the granularity was asked, which the allocator does before any page.
        let rdma = self.rdma_vmm[device as usize].get().copied().unwrap_or(false);
        self.in_context(device, || {
            let create = |shareable: bool| {
                let prop = allocation_prop(dev, shareable, rdma);
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: writes one handle; `prop` outlives the call; flags 0 as required. Any
                // failure (CUDA_ERROR_NOT_PERMITTED under cuda-gdb, for one) is returned.
                check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })
                    .map(|()| PhysHandle(handle))
            };
            if self.fd_handles_refused.load(Ordering::Relaxed) {
                return create(false);
            }
            match create(true) {
                Err(DriverError::Cuda { code, .. }) if code == 801 || code == 1 => {
                    let plain = create(false)?;
                    self.fd_handles_refused.store(true, Ordering::Relaxed);
                    Ok(plain)
                }
                r => r,
            }
        })
    }

    fn mem_release(&self, device: i32, handle: PhysHandle) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: a handle from mem_create, mapped nowhere and not used after.
        self.in_context(device, || check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) }))
    }

    fn mem_map(&self, device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: maps the whole handle (offset 0, `size` bytes) at `ptr`, inside a reservation
        // of this device; flags 0 as required.
        self.in_context(device, || check("cuMemMap", unsafe { sys::cuMemMap(ptr, size, 0, handle.0, 0) }))
    }

    /// One `cuMemSetAccess` of `ptr..ptr + size` (mapped on `device`) for the devices of `to`
    /// (ordinals, as gpupool numbers devices): read and write, or none.
    ///
    /// Memory from `cuMemAlloc` becomes reachable from another device once that device's
    /// context calls `cuCtxEnablePeerAccess`/`cudaDeviceEnablePeerAccess`; memory mapped with
    /// `cuMemMap` is instead reachable from exactly the devices named to `cuMemSetAccess`, and
    /// peer-access enabling does not apply to it (CUDA Programming Guide, "Virtual Memory
    /// Management"; PyTorch's Note [Expandable Segments]). The allocator names the owner and the
    /// peers the program enabled (`caching::peers`), as PyTorch's `ExpandableSegment::setAccess`.
    /// The cost of each call grows with the devices named: it updates each one's page tables.
    fn mem_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: usize,
        to: &[i32],
        read_write: bool,
    ) -> Result<(), DriverError> {
        self.vmm_functions()?;
        let devs: Option<Vec<sys::CUdevice>> = to.iter().map(|&d| self.devices.get(d as usize).copied()).collect();
        let Some(devs) = devs else {
            return Err(DriverError::Unavailable(format!("cuMemSetAccess: a device of {to:?} is out of range")));
        };
        let descs = access_descs(&devs, read_write);
        self.in_context(device, || {
            // SAFETY: `descs` holds descs.len() descriptors and outlives the call; the range is
            // wholly mapped (the caller mapped it).
            check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()) })
        })
    }

    /// Whether `accessor` can reach `owner`'s memory directly (`cuDeviceCanAccessPeer(&can,
    /// accessor, owner)`); a device reaches its own.
    fn can_access_peer(&self, accessor: i32, owner: i32) -> Result<bool, DriverError> {
        self.vmm_functions()?;
        if accessor == owner {
            return Ok(true);
        }
        let (Some(&a), Some(&o)) = (self.devices.get(accessor as usize), self.devices.get(owner as usize)) else {
            return Ok(false);
        };
        let mut can = 0;
        // SAFETY: writes one int; both are devices from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, o) })?;
        Ok(can == 1)
    }

    fn mem_unmap(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: whole mappings made by mem_map; no work uses them (the caller's duty).
        self.in_context(device, || check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) }))
    }
}
