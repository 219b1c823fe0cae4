//! dma-buf descriptors of device memory (`cuMemGetHandleForAddressRange` with
//! `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`), checked as CUDA checks them, so that what gpupool
//! hands a transport (`caching::registration`) is tested without a GPU.
//!
//! CUDA's rules (CUDA Driver API, `cuMemGetHandleForAddressRange`): `dptr` and `size` aligned
//! to the host page size; the range obtained from `cuMemAlloc`, or from `cuMemAddressReserve`
//! and then wholly mapped, by physical allocations of one device with identical properties
//! (several handles side by side are allowed); flags 0. The descriptor is a real one: an
//! anonymous sparse file of the range's size (`memfd`), so that `lseek(fd, 0, SEEK_END)`
//! reads the range's bytes, as a dma-buf of the NVIDIA driver does; like that dma-buf, it is
//! not the way to the memory's bytes from the CPU.

use std::os::fd::OwnedFd;

use super::vmm::Backing;
use super::{DevicePtr, DriverError, SimDriver, SimOp, State, invalid};
use crate::driver::ops::DmabufOps;
use crate::os::memfd;

const CALL: &str = "cuMemGetHandleForAddressRange";

impl State {
    /// Whether `[ptr, ptr + size)` lies in one allocation of `mem_alloc` on `device`.
    fn in_allocation(&self, device: i32, ptr: DevicePtr, size: usize) -> bool {
        let end = ptr + size as u64;
        self.allocations.iter().any(|(&a, &(d, s, _))| d == device && a <= ptr && end <= a + s as u64)
    }

    /// Whether `[ptr, ptr + size)` lies in one reserved range of `device` and every byte of it
    /// is mapped, by handles of one kind (the device's own memory, or all imported).
    fn wholly_mapped(&mut self, device: i32, ptr: DevicePtr, size: usize) -> bool {
        let Some((_, r)) = self.range_of(ptr, size) else { return false };
        if r.device != device {
            return false;
        }
        let Some(handles) = r.handles_over(ptr, size) else { return false };
        let imported: Vec<bool> = handles
            .iter()
            .filter_map(|h| self.handles.get(h))
            .map(|h| matches!(h.backing, Backing::Imported { .. }))
            .collect();
        imported.len() == handles.len() && imported.windows(2).all(|w| w[0] == w[1])
    }
}

impl DmabufOps for SimDriver {
    fn mem_range_dmabuf(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<OwnedFd, DriverError> {
        self.run_hooks(SimOp::MemGetHandleForAddressRange);
        let mut st = self.state.lock();
        st.counts.dmabufs += 1;
        st.fault(SimOp::MemGetHandleForAddressRange)?;
        let page = super::backing::host_page();
        let aligned = size > 0 && ptr % page == 0 && size as u64 % page == 0;
        if !aligned || ptr.checked_add(size as u64).is_none() {
            return Err(invalid(CALL));
        }
        if !st.in_allocation(device, ptr, size) && !st.wholly_mapped(device, ptr, size) {
            return Err(invalid(CALL));
        }
        memfd::create("gpupool-sim-dmabuf", size).map_err(|_| DriverError::OutOfMemory)
    }
}
