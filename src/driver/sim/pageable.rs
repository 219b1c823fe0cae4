//! Pageable host memory of gpupool's own (`host_map`, `host_unmap`: the system's `mmap` and
//! `munmap`, see `driver::pageable`): real mappings, counted, with faults injected first, and
//! the ranges mapped now, so that a test sees a sleeping pool's host copy come and go.

use super::{DriverError, HostPtr, SimDriver, SimOp, invalid};

impl SimDriver {
    /// Pageable host memory mapped now through `host_map` and not unmapped: (ranges, bytes).
    pub fn live_pageable(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.pageable.len(), st.pageable.values().sum())
    }

    pub(super) fn sim_host_map(&self, size: usize, huge_pages: bool) -> Result<HostPtr, DriverError> {
        let mut st = self.state.lock();
        st.counts.host_map += 1;
        st.fault(SimOp::HostMap)?;
        let p = crate::driver::pageable::map(size, huge_pages)?;
        st.pageable.insert(p, size);
        Ok(p)
    }

    pub(super) fn sim_host_unmap(&self, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
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
