//! Device memory (`cuMemAlloc`, `cuMemFree`, `cuMemGetInfo`): each allocation is its own
//! anonymous `mmap`, counted against its device's fixed capacity.

use super::{DevicePtr, DriverError, MemInfo, SimDriver, SimOp, invalid};

impl SimDriver {
    /// Bytes currently allocated on `device` through this driver.
    pub fn used(&self, device: i32) -> usize {
        self.state.lock().used[device as usize]
    }

    /// Allocations made by `mem_alloc` and not yet freed, on every device.
    pub fn live_allocations(&self) -> usize {
        self.state.lock().allocations.len()
    }

    pub(super) fn sim_mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
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
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(DriverError::OutOfMemory);
        }
        st.used[d] += size;
        st.allocations.insert(p as DevicePtr, (device, size));
        Ok(p as DevicePtr)
    }

    pub(super) fn sim_mem_free(&self, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.counts.mem_free += 1;
        st.fault(SimOp::MemFree)?;
        st.unsafe_call("cuMemFree")?;
        let (device, size) = st.allocations.remove(&ptr).ok_or_else(|| invalid("cuMemFree"))?;
        st.used[device as usize] -= size;
        st.shared_allocations.remove(&ptr);
        // SAFETY: `ptr` and `size` are exactly a mapping made by `mem_alloc` and not yet unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }

    pub(super) fn sim_mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::MemInfo)?;
        Ok(MemInfo { free: self.capacity - st.used[device as usize], total: self.capacity })
    }
}
