//! Memory shared between processes (`cuDeviceGetUuid`, `cuMemExportToShareableHandle`,
//! `cuMemImportFromShareableHandle`, `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`,
//! `cuIpcCloseMemHandle`), so that gpupool's IPC protocol, an importer's death included, runs
//! without a GPU.
//!
//! Simulated device memory is a device's file (`backing`), mapped shared from its creation: an
//! export hands out a descriptor of it and nothing of the memory moves (an export that copied
//! anonymous memory into a file and mapped the file over it lost what other threads wrote to
//! the page meanwhile). A physical handle's descriptor (`mem_export`) is a new open file
//! description of its device's file positioned at the handle's extent, so that the descriptor
//! alone names it; the importer maps the extent once, without access, and closes the
//! descriptor (`mem_import`): it keeps none, as with CUDA. An allocation's 64-byte handle names
//! the exporting process, its device file's descriptor there and the extent, which the
//! importer takes with `pidfd_getfd`, as the CUDA driver does its own business behind
//! `cuIpcOpenMemHandle`.

use std::os::fd::BorrowedFd;

use super::backing::{imported_extent, map_fd};
use super::vmm::Backing;
use super::{DevicePtr, DriverError, PhysHandle, SimDriver, SimOp, invalid};
use crate::driver::ops::IpcOps;
use crate::os::{memfd, process};

/// The first bytes of a simulated `cuIpcGetMemHandle` handle.
const MAGIC: &[u8; 8] = b"GPSIMIPC";

fn cuda_error(call: &'static str, code: i32, name: &str) -> DriverError {
    DriverError::Cuda { call, code, name: name.into() }
}

impl SimDriver {
    /// Bytes of simulated memory of other processes mapped here by `ipc_open_mem_handle` and
    /// not closed, for tests that check an importer gives back what it maps.
    pub fn opened_ipc_bytes(&self) -> usize {
        self.state.lock().opened.values().sum()
    }
}

impl IpcOps for SimDriver {
    fn device_uuid(&self, device: i32) -> Result<[u8; 16], DriverError> {
        self.run_hooks(SimOp::DeviceUuid);
        self.state.lock().fault(SimOp::DeviceUuid)?;
        let mut uuid = *b"gpupool-sim-gpu\0";
        uuid[15] = device as u8;
        Ok(uuid)
    }

    fn mem_export(&self, _device: i32, handle: PhysHandle) -> Result<std::os::fd::OwnedFd, DriverError> {
        self.run_hooks(SimOp::MemExport);
        let mut st = self.state.lock();
        st.fault(SimOp::MemExport)?;
        let call = "cuMemExportToShareableHandle";
        let h = st.handles.get(&handle.0).ok_or_else(|| invalid(call))?;
        // An imported handle keeps no descriptor to hand on (gpupool never exports one).
        let (Backing::Device { offset }, device) = (h.backing, h.device) else { return Err(invalid(call)) };
        let file = st.file(device)?;
        file.export(offset).map_err(|_| cuda_error(call, 2, "CUDA_ERROR_OUT_OF_MEMORY"))
    }

    fn mem_import(&self, device: i32, fd: BorrowedFd<'_>, size: usize) -> Result<PhysHandle, DriverError> {
        self.run_hooks(SimOp::MemImport);
        let mut st = self.state.lock();
        st.fault(SimOp::MemImport)?;
        let call = "cuMemImportFromShareableHandle";
        let fd = fd.try_clone_to_owned().map_err(|_| invalid(call))?;
        let granularity = super::SIM_GRANULARITY;
        if size == 0 || size % granularity != 0 {
            return Err(invalid(call));
        }
        let offset = imported_extent(&fd, size, granularity as u64).ok_or_else(|| invalid(call))?;
        // The memory held by a mapping without access; the descriptor is closed on return.
        let hold = map_fd(&fd, None, offset, size, libc::PROT_NONE).ok_or(DriverError::OutOfMemory)?;
        st.next_handle += 1;
        let id = st.next_handle;
        let backing = Backing::Imported { hold };
        st.handles.insert(id, super::vmm::Handle { device, size, mapped_at: None, backing });
        Ok(PhysHandle(id))
    }

    fn ipc_get_mem_handle(&self, device: i32, ptr: DevicePtr) -> Result<[u8; 64], DriverError> {
        self.run_hooks(SimOp::IpcGetMemHandle);
        let mut st = self.state.lock();
        st.fault(SimOp::IpcGetMemHandle)?;
        let call = "cuIpcGetMemHandle";
        let &(owner, size, offset) = st.allocations.get(&ptr).ok_or_else(|| invalid(call))?;
        let fd = st.file(owner)?.raw_fd();
        let me = process::me();
        let mut out = [0u8; 64];
        out[..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&me.pid.to_le_bytes());
        out[12..16].copy_from_slice(&fd.to_le_bytes());
        out[16..24].copy_from_slice(&(size as u64).to_le_bytes());
        out[24..32].copy_from_slice(&me.start.to_le_bytes());
        out[32..36].copy_from_slice(&device.to_le_bytes());
        out[40..48].copy_from_slice(&offset.to_le_bytes());
        Ok(out)
    }

    fn ipc_open_mem_handle(&self, _device: i32, handle: &[u8; 64]) -> Result<DevicePtr, DriverError> {
        self.run_hooks(SimOp::IpcOpenMemHandle);
        let mut st = self.state.lock();
        st.fault(SimOp::IpcOpenMemHandle)?;
        let call = "cuIpcOpenMemHandle_v2";
        let word = |a: usize, b: usize| handle[a..b].iter().rev().fold(0u64, |acc, &x| acc << 8 | x as u64);
        if &handle[..8] != MAGIC {
            return Err(invalid(call));
        }
        let who = process::Identity { pid: word(8, 12) as u32, start: word(24, 32) };
        let (size, offset) = (word(16, 24) as usize, word(40, 48));
        // What the CUDA driver answers for a handle whose exporter is gone or whose memory
        // was freed: CUDA_ERROR_INVALID_HANDLE (400) hides which.
        let bad = || cuda_error(call, 400, "CUDA_ERROR_INVALID_HANDLE");
        let fd = process::fetch(who, word(12, 16) as u32 as i32).map_err(|_| bad())?;
        let len = memfd::file_size(&fd).map_err(|_| bad())? as u64;
        let page = super::backing::host_page();
        if size == 0 || offset % page != 0 || offset.checked_add(size as u64).is_none_or(|end| end > len) {
            return Err(bad());
        }
        let p = map_fd(&fd, None, offset, size, libc::PROT_READ | libc::PROT_WRITE).ok_or(DriverError::OutOfMemory)?;
        st.opened.insert(p, size);
        Ok(p)
    }

    fn ipc_close_mem_handle(&self, _device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        self.run_hooks(SimOp::IpcCloseMemHandle);
        let mut st = self.state.lock();
        st.fault(SimOp::IpcCloseMemHandle)?;
        let size = st.opened.remove(&ptr).ok_or_else(|| invalid("cuIpcCloseMemHandle"))?;
        // SAFETY: exactly a mapping made by `ipc_open_mem_handle`, not yet unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }
}
