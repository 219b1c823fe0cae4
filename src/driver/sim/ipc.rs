//! Memory shared between processes (`cuDeviceGetUuid`, `cuMemExportToShareableHandle`,
//! `cuMemImportFromShareableHandle`, `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`,
//! `cuIpcCloseMemHandle`), so that gpupool's IPC protocol, an importer's death included, runs
//! without a GPU.
//!
//! Simulated device memory is anonymous host memory of one process. Memory becomes shareable
//! when it is first exported: its bytes are copied into a `memfd` and the memfd is mapped
//! shared in their place, at the same address, so the exporter sees no change; memory never
//! exported stays anonymous (no descriptor per allocation: the suite makes many). A physical
//! handle's descriptor is what `mem_export` gives (a copy of it); an allocation's 64-byte
//! handle names the exporting process and the descriptor's number there, which the importer
//! takes with `pidfd_getfd`, as the CUDA driver does its own business behind
//! `cuIpcOpenMemHandle`.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use super::vmm::map_shared;
use super::{DevicePtr, DriverError, PhysHandle, SimDriver, SimOp, State, invalid};
use crate::ipc::proc;

/// The first bytes of a simulated `cuIpcGetMemHandle` handle.
const MAGIC: &[u8; 8] = b"GPSIMIPC";

/// Copies `size` bytes at `at` (readable host memory) into a new memfd, then maps the memfd
/// shared at `at`: the same bytes, now shareable.
fn make_shared(at: Option<DevicePtr>, size: usize) -> Result<OwnedFd, DriverError> {
    let fd = proc::memfd("gpupool-sim-shared", size).map_err(|_| DriverError::OutOfMemory)?;
    if let Some(at) = at {
        // SAFETY: `[at, at + size)` is readable memory of this driver; pwrite reads it.
        let n = unsafe { libc::pwrite(fd.as_raw_fd(), at as *const libc::c_void, size, 0) };
        if n != size as isize || !map_shared(at, size, &fd) {
            return Err(DriverError::OutOfMemory);
        }
    }
    Ok(fd)
}

fn cuda_error(call: &'static str, code: i32, name: &str) -> DriverError {
    DriverError::Cuda { call, code, name: name.into() }
}

impl State {
    /// Whether the handle's memory is mapped with access set (readable now).
    fn handle_readable(&mut self, handle: u64) -> Option<DevicePtr> {
        let h = self.handles.get(&handle)?;
        let (at, size) = (h.mapped_at?, h.size);
        let (_, r) = self.range_of(at, size)?;
        r.accessible_over(at, size).then_some(at)
    }
}

impl SimDriver {
    /// Bytes of simulated memory of other processes mapped here by `ipc_open_mem_handle` and
    /// not closed, for tests that check an importer gives back what it maps.
    pub fn opened_ipc_bytes(&self) -> usize {
        self.state.lock().opened.values().sum()
    }

    pub(super) fn sim_device_uuid(&self, device: i32) -> Result<[u8; 16], DriverError> {
        self.state.lock().fault(SimOp::DeviceUuid)?;
        let mut uuid = *b"gpupool-sim-gpu\0";
        uuid[15] = device as u8;
        Ok(uuid)
    }

    pub(super) fn sim_mem_export(&self, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::MemExport)?;
        let call = "cuMemExportToShareableHandle";
        let readable = st.handle_readable(handle.0);
        let h = st.handles.get_mut(&handle.0).ok_or_else(|| invalid(call))?;
        if h.fd.is_none() {
            h.fd = Some(make_shared(readable, h.size)?);
        }
        h.fd.as_ref().expect("set above").try_clone().map_err(|_| cuda_error(call, 2, "CUDA_ERROR_OUT_OF_MEMORY"))
    }

    pub(super) fn sim_mem_import(
        &self,
        device: i32,
        fd: BorrowedFd<'_>,
        size: usize,
    ) -> Result<PhysHandle, DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::MemImport)?;
        let call = "cuMemImportFromShareableHandle";
        let fd = fd.try_clone_to_owned().map_err(|_| invalid(call))?;
        if size == 0 || size % super::SIM_GRANULARITY != 0 || proc::file_size(&fd).map_err(|_| invalid(call))? != size {
            return Err(invalid(call));
        }
        st.next_handle += 1;
        let id = st.next_handle;
        st.handles.insert(id, super::vmm::Handle { device, size, mapped_at: None, fd: Some(fd), imported: true });
        Ok(PhysHandle(id))
    }

    pub(super) fn sim_ipc_get_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<[u8; 64], DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::IpcGetMemHandle)?;
        let call = "cuIpcGetMemHandle";
        let &(_, size) = st.allocations.get(&ptr).ok_or_else(|| invalid(call))?;
        let fd = match st.shared_allocations.entry(ptr) {
            std::collections::hash_map::Entry::Occupied(e) => e.get().as_raw_fd(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(make_shared(Some(ptr), size)?).as_raw_fd(),
        };
        let me = proc::me();
        let mut out = [0u8; 64];
        out[..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&me.pid.to_le_bytes());
        out[12..16].copy_from_slice(&fd.to_le_bytes());
        out[16..24].copy_from_slice(&(size as u64).to_le_bytes());
        out[24..32].copy_from_slice(&me.start.to_le_bytes());
        out[32..36].copy_from_slice(&device.to_le_bytes());
        Ok(out)
    }

    pub(super) fn sim_ipc_open_mem_handle(&self, handle: &[u8; 64]) -> Result<DevicePtr, DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::IpcOpenMemHandle)?;
        let call = "cuIpcOpenMemHandle_v2";
        let word = |a: usize, b: usize| handle[a..b].iter().rev().fold(0u64, |acc, &x| acc << 8 | x as u64);
        if &handle[..8] != MAGIC {
            return Err(invalid(call));
        }
        let who = proc::Identity { pid: word(8, 12) as u32, start: word(24, 32) };
        let size = word(16, 24) as usize;
        // What the CUDA driver answers for a handle whose exporter is gone or whose memory
        // was freed: CUDA_ERROR_INVALID_HANDLE (400) hides which.
        let fd = proc::fetch(who, word(12, 16) as u32 as i32)
            .map_err(|_| cuda_error(call, 400, "CUDA_ERROR_INVALID_HANDLE"))?;
        if proc::file_size(&fd).ok() != Some(size) {
            return Err(cuda_error(call, 400, "CUDA_ERROR_INVALID_HANDLE"));
        }
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a new shared mapping of our own descriptor, anywhere; the result is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), size, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(DriverError::OutOfMemory);
        }
        st.opened.insert(p as DevicePtr, size);
        Ok(p as DevicePtr)
    }

    pub(super) fn sim_ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut st = self.state.lock();
        st.fault(SimOp::IpcCloseMemHandle)?;
        let size = st.opened.remove(&ptr).ok_or_else(|| invalid("cuIpcCloseMemHandle"))?;
        // SAFETY: exactly a mapping made by `ipc_open_mem_handle`, not yet unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }
}
