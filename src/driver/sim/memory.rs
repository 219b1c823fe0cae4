//! Device memory (`cuMemAlloc`, `cuMemFree`, `cuMemGetInfo`): each allocation an extent of its
//! device's file (`backing`) mapped shared, counted against the device's fixed capacity.

use super::{DevicePtr, DriverError, MemInfo, SimDriver, SimOp, State, invalid};
use crate::driver::ops::MemoryOps;

impl State {
    /// Device `device`'s file, made at its first use.
    ///
    /// Errors: [`DriverError::OutOfMemory`] when the system cannot make it.
    pub(super) fn file(&mut self, device: i32) -> Result<&mut super::backing::DeviceFile, DriverError> {
        match self.files.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                Ok(e.insert(super::backing::DeviceFile::new().map_err(|_| DriverError::OutOfMemory)?))
            }
        }
    }
}

impl SimDriver {
    /// Bytes currently allocated on `device` through this driver.
    pub fn used(&self, device: i32) -> usize {
        self.state.lock().used[device as usize]
    }

    /// Allocations made by `mem_alloc` and not yet freed, on every device.
    pub fn live_allocations(&self) -> usize {
        self.state.lock().allocations.len()
    }
}

impl MemoryOps for SimDriver {
    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.run_hooks(SimOp::MemAlloc);
        let mut st = self.state.lock();
        st.counts.mem_alloc += 1;
        st.fault(SimOp::MemAlloc)?;
        st.unsafe_call("cuMemAlloc")?;
        if size == 0 {
            return Err(invalid("cuMemAlloc"));
        }
        let d = device as usize;
        if size > self.capacity - st.used[d] {
            return Err(DriverError::OutOfMemory);
        }
        let file = st.file(device)?;
        let offset = file.take(size as u64).map_err(|_| DriverError::OutOfMemory)?;
        let page = super::backing::host_page();
        let align = if size >= super::SIM_GRANULARITY { super::SIM_GRANULARITY as u64 } else { page };
        let Some(p) = file.map_aligned(offset, size, align) else {
            file.give_back(offset, size as u64);
            return Err(DriverError::OutOfMemory);
        };
        st.used[d] += size;
        st.allocations.insert(p, (device, size, offset));
        Ok(p)
    }

    fn mem_free(&self, _device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemFree);
        let mut st = self.state.lock();
        st.counts.mem_free += 1;
        st.fault(SimOp::MemFree)?;
        st.unsafe_call("cuMemFree")?;
        let (device, size, offset) = st.allocations.remove(&ptr).ok_or_else(|| invalid("cuMemFree"))?;
        st.used[device as usize] -= size;
        // SAFETY: `ptr` and `size` are exactly a mapping made by `mem_alloc` and not yet unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        // An importer's mapping (cuIpcOpenMemHandle) keeps the pages it maps until it closes;
        // the extent is given back here all the same, as CUDA lets the owner free its memory.
        st.file(device)?.give_back(offset, size as u64);
        Ok(())
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        self.run_hooks(SimOp::MemInfo);
        let mut st = self.state.lock();
        st.fault(SimOp::MemInfo)?;
        Ok(MemInfo { free: self.capacity - st.used[device as usize], total: self.capacity })
    }
}
