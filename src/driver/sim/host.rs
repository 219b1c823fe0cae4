//! Pinned host memory (`cuMemHostAlloc`, `cuMemHostRegister` and their inverses): the ranges
//! pinned now, within what the host can pin, and the simulated host-to-device copy that counts
//! a copy from memory that is not pinned. And pageable host memory of gpupool's own
//! (`host_map`, `host_unmap`: the system's `mmap` and `munmap`, see `driver::pageable`): real
//! mappings, counted, with faults injected first, and the ranges mapped now, so that a test
//! sees a sleeping pool's host copy come and go.
//!
//! Pinned memory is physical memory the kernel may not page out: a real host refuses to pin
//! more than it has (`cuMemHostAlloc` fails with `CUDA_ERROR_OUT_OF_MEMORY`). The simulated
//! host pins at most its physical memory by default ([`SimDriver::set_host_capacity`] sets
//! another limit), counting allocated and registered ranges alike; without the limit a 32 TiB
//! request succeeded (its mapping reserves no memory), where a real host fails.

use super::{DevicePtr, DriverError, HostPtr, SimDriver, SimOp, StreamHandle, invalid};
use crate::driver::ops::HostMemoryOps;
use crate::os::mapping;

/// How a range of host memory is pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HostKind {
    /// Allocated and pinned by `host_alloc` (an anonymous mapping of the driver's).
    Allocated,
    /// The caller's memory, pinned by `host_register`.
    Registered,
}

/// The host's physical memory in bytes (`sysconf`), the most the simulated host pins by default.
pub(super) fn physical_memory() -> usize {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages <= 0 || page <= 0 { usize::MAX } else { (pages as usize).saturating_mul(page as usize) }
}

impl SimDriver {
    /// Sets the most host memory that may be pinned at once, in bytes (allocated by
    /// `host_alloc` and registered by `host_register` together); by default the host's
    /// physical memory. A request past it fails with [`DriverError::OutOfMemory`]
    /// (`host_alloc`) or `CUDA_ERROR_OUT_OF_MEMORY` (`host_register`), as on a real host that
    /// cannot pin more. Ranges pinned already stay. Thread-safe.
    pub fn set_host_capacity(&self, bytes: usize) {
        self.state.lock().host_capacity = bytes;
    }

    /// Bytes of host memory pinned now (allocated and registered).
    pub fn pinned_bytes(&self) -> usize {
        self.state.lock().pinned
    }

    /// Whether `[ptr, ptr + len)` lies wholly inside one pinned host range (from `host_alloc`
    /// or `host_register`): what a copy must read from to be asynchronous on a GPU.
    pub fn is_pinned(&self, ptr: HostPtr, len: usize) -> bool {
        let st = self.state.lock();
        st.host.range(..=ptr).next_back().is_some_and(|(&start, &(size, _))| ptr + len <= start + size)
    }

    /// A host-to-device copy of `len` bytes from `src` to `dst` on `stream` (the simulated
    /// `cuMemcpyHtoDAsync`): the bytes are copied at once. Returns whether the source was
    /// wholly pinned; a copy from memory that is not is counted in
    /// [`SimCounts::unpinned_copies`](super::SimCounts::unpinned_copies), which is how a test
    /// sees a copy that on a GPU would not have been asynchronous.
    ///
    /// # Safety
    /// `src` must be readable and `dst` writable for `len` bytes, and not overlap.
    pub unsafe fn memcpy_htod_async(&self, dst: DevicePtr, src: HostPtr, len: usize, _stream: StreamHandle) -> bool {
        let pinned = self.is_pinned(src, len);
        if !pinned {
            self.state.lock().counts.unpinned_copies += 1;
        }
        // SAFETY: per this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
        pinned
    }

    /// Host ranges pinned now: (allocated by `host_alloc`, registered by `host_register`).
    pub fn live_host(&self) -> (usize, usize) {
        let st = self.state.lock();
        let allocated = st.host.values().filter(|(_, k)| *k == HostKind::Allocated).count();
        (allocated, st.host.len() - allocated)
    }

    fn host_error(call: &'static str, code: i32, name: &str) -> DriverError {
        DriverError::Cuda { call, code, name: name.into() }
    }

    /// Pageable host memory mapped now through `host_map` and not unmapped: (ranges, bytes).
    pub fn live_pageable(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.pageable.len(), st.pageable.values().sum())
    }
}

impl HostMemoryOps for SimDriver {
    fn host_alloc(&self, _device: i32, size: usize) -> Result<HostPtr, DriverError> {
        self.run_hooks(SimOp::HostAlloc);
        let mut st = self.state.lock();
        st.counts.host_alloc += 1;
        st.fault(SimOp::HostAlloc)?;
        if size == 0 {
            return Err(invalid("cuMemHostAlloc"));
        }
        if size > st.host_capacity.saturating_sub(st.pinned) {
            return Err(DriverError::OutOfMemory);
        }
        let p = mapping::anonymous(size, libc::PROT_READ | libc::PROT_WRITE, true).ok_or(DriverError::OutOfMemory)?;
        st.host.insert(p as HostPtr, (size, HostKind::Allocated));
        st.pinned += size;
        Ok(p as HostPtr)
    }

    fn host_free(&self, _device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostFree);
        let mut st = self.state.lock();
        st.counts.host_free += 1;
        st.fault(SimOp::HostFree)?;
        match st.host.get(&ptr) {
            Some(&(size, HostKind::Allocated)) => {
                st.host.remove(&ptr);
                st.pinned -= size;
                // SAFETY: exactly a mapping made by host_alloc and not yet unmapped.
                unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
                Ok(())
            }
            _ => Err(invalid("cuMemFreeHost")),
        }
    }

    fn host_register(&self, _device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostRegister);
        let mut st = self.state.lock();
        st.counts.host_register += 1;
        st.fault(SimOp::HostRegister)?;
        if ptr == 0 || size == 0 {
            return Err(invalid("cuMemHostRegister"));
        }
        let end = ptr + size;
        let before = st.host.range(..end).next_back().is_some_and(|(&a, &(s, _))| a + s > ptr);
        if before {
            return Err(SimDriver::host_error("cuMemHostRegister", 712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"));
        }
        if size > st.host_capacity.saturating_sub(st.pinned) {
            return Err(SimDriver::host_error("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY"));
        }
        st.host.insert(ptr, (size, HostKind::Registered));
        st.pinned += size;
        Ok(())
    }

    fn host_unregister(&self, _device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostUnregister);
        let mut st = self.state.lock();
        st.counts.host_unregister += 1;
        st.fault(SimOp::HostUnregister)?;
        match st.host.get(&ptr) {
            Some(&(size, HostKind::Registered)) => {
                st.host.remove(&ptr);
                st.pinned -= size;
                Ok(())
            }
            _ => Err(SimDriver::host_error("cuMemHostUnregister", 713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")),
        }
    }

    fn host_map(&self, size: usize, huge_pages: bool) -> Result<HostPtr, DriverError> {
        self.run_hooks(SimOp::HostMap);
        let mut st = self.state.lock();
        st.counts.host_map += 1;
        st.fault(SimOp::HostMap)?;
        let p = crate::driver::pageable::map(size, huge_pages)?;
        st.pageable.insert(p, size);
        Ok(p)
    }

    fn host_unmap(&self, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::HostUnmap);
        let mut st = self.state.lock();
        st.counts.host_unmap += 1;
        st.fault(SimOp::HostUnmap)?;
        if st.pageable.get(&ptr) != Some(&size) {
            return Err(invalid("munmap"));
        }
        crate::driver::pageable::unmap(ptr, size)?;
        st.pageable.remove(&ptr);
        Ok(())
    }
}
