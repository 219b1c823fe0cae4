//! The importer's side: what this process mapped of other processes' exports, by the pointer
//! it handed out, and the steps of an import and of its close. An import takes the owner's
//! record (`pidfd_getfd`), adds its use there, then maps: pages of an expandable segment are
//! taken one descriptor each, imported (`cuMemImportFromShareableHandle`) and mapped in an
//! address range reserved for exactly those pages (`cuMemAddressReserve`), so that address
//! space grows by what is imported and nothing more; an ordinary segment is opened once per
//! process (`cuIpcOpenMemHandle`), its opens counted here. A close undoes it in reverse and
//! drops the use; a close the driver refuses halfway keeps its progress and may be repeated.

use std::os::fd::AsFd;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::handle::{IpcHandle, Kind};
use super::record::{AcquireError, Record};
use crate::caching::peers::Peers;
use crate::driver::{DevicePtr, Driver, DriverError, PhysHandle};
use crate::error::Error;
use crate::os::process::{self, FetchError};

type SegmentKey = (u32, u64, [u8; 64]);

enum How {
    /// Pages mapped at `base`: each handle, and whether it is still mapped.
    Pages { base: DevicePtr, page: usize, len: usize, handles: Vec<(PhysHandle, bool)>, reserved: bool },
    /// An ordinary segment opened at `base`.
    Segment { key: SegmentKey },
}

struct Import {
    device: i32,
    record: Record,
    slot: usize,
    how: How,
}

#[derive(Default)]
struct State {
    /// Imports by the pointer handed out (a segment imported twice gives one pointer twice).
    imports: FxHashMap<DevicePtr, Vec<Import>>,
    /// Ordinary segments open: where, and how many imports use each.
    segments: FxHashMap<SegmentKey, (DevicePtr, usize)>,
}

/// One allocator's imports. Thread-safe: one lock, held across the driver calls of an import
/// or close (never on the allocator's other paths).
#[derive(Default)]
pub(crate) struct Imports {
    state: Mutex<State>,
}

fn gone(h: &IpcHandle, why: &str) -> Error {
    Error::InvalidValue(format!("export {} of process {} no longer exists: {why}", h.export_id, h.owner.pid))
}

fn fetch_error(h: &IpcHandle, e: FetchError) -> Error {
    match e {
        FetchError::Exited => Error::InvalidValue(format!(
            "the IPC handle's owner process {} has exited: the memory it exported is gone",
            h.owner.pid
        )),
        FetchError::NoSuchFd => gone(h, "the owner freed the block, or the handle is stale"),
        FetchError::Refused(e) => Error::DriverUnavailable(format!(
            "process {}'s descriptors cannot be taken (pidfd_getfd: {e}): importing needs Linux 5.6 or later and \
             ptrace permission over the owner (the same user; Yama's /proc/sys/kernel/yama/ptrace_scope at 0, or \
             the owner a descendant of the importer; no seccomp filter refusing pidfd_getfd)",
            h.owner.pid
        )),
    }
}

impl Imports {
    /// Imports `h` on `device` (its UUID checked by the caller); returns the block's address here.
    /// Pages are mapped for `device` and the peers enabled on it (`peers`, read under the
    /// imports' lock: see `caching::peers`).
    pub fn import(&self, driver: &dyn Driver, device: i32, peers: &Peers, h: &IpcHandle) -> Result<DevicePtr, Error> {
        let me = process::me();
        if h.owner == me {
            return Err(Error::InvalidValue(
                "the IPC handle is this process's own export: use the pointer that was exported".into(),
            ));
        }
        let pidfd = process::open(h.owner).map_err(|e| fetch_error(h, e))?;
        let fd = process::getfd(&pidfd, h.record_fd).map_err(|e| fetch_error(h, e))?;
        let record = Record::open(fd).map_err(|why| gone(h, &why))?;
        let r = record.header();
        let same = r.export_id == h.export_id
            && r.owner_pid == h.owner.pid
            && r.owner_start == h.owner.start
            && r.kind == h.kind as u32
            && r.size == h.size
            && r.offset == h.offset;
        if !same {
            return Err(gone(h, "the descriptor the handle names now holds another export"));
        }
        let slot = record.acquire(me).map_err(|e| match e {
            AcquireError::Freed => gone(h, "its owner freed the block"),
            AcquireError::Full => Error::InvalidValue(format!(
                "export {} of process {} is imported by {} processes already, the most one export allows",
                h.export_id,
                h.owner.pid,
                super::record::MAX_IMPORTERS
            )),
        })?;
        let mut st = self.state.lock();
        let mapped = match h.kind {
            Kind::Pages => map_pages(driver, device, &peers.access(device), &record, &pidfd, h),
            Kind::Segment => open_segment(driver, device, &mut st, h),
        };
        let (ptr, how) = match mapped {
            Ok(m) => m,
            Err(e) => {
                record.release(slot);
                return Err(e);
            }
        };
        st.imports.entry(ptr).or_default().push(Import { device, record, slot, how });
        Ok(ptr)
    }

    /// Ends the import at `ptr`: unmaps it and drops its use at the owner.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer that is not an open import;
    /// [`Error::Cuda`] when the driver refuses a step (the import stays, its steps so far
    /// done: call again).
    pub fn close(&self, driver: &dyn Driver, ptr: DevicePtr) -> Result<(), Error> {
        let mut st = self.state.lock();
        let State { imports, segments } = &mut *st;
        let Some(list) = imports.get_mut(&ptr) else {
            return Err(Error::InvalidPointer(format!(
                "pointer {ptr:#x} is not an open import of gpupool_ipc_import (never imported, or closed already)"
            )));
        };
        let import = list.last_mut().expect("lists are never empty");
        undo(driver, import.device, &mut import.how, segments)?;
        let import = list.pop().expect("checked above");
        if list.is_empty() {
            imports.remove(&ptr);
        }
        import.record.release(import.slot);
        Ok(())
    }

    /// Sets `peer`'s access (read and write, or none) over every import of pages mapped on
    /// `device` (PyTorch's `enablePeerAccess` grants the imported expandable segments of
    /// `ipcMemHandle_to_devptr` likewise). Every import is tried; returns the first failure.
    pub fn set_peer_access(
        &self,
        driver: &dyn Driver,
        device: i32,
        peer: i32,
        read_write: bool,
    ) -> Result<(), DriverError> {
        let st = self.state.lock();
        let mut first = Ok(());
        for import in st.imports.values().flatten().filter(|i| i.device == device) {
            if let How::Pages { base, len, handles, .. } = &import.how
                && handles.iter().all(|h| h.1)
            {
                first = first.and(driver.mem_set_access(device, *base, *len, &[peer], read_write));
            }
        }
        first
    }

    /// Imports open (a pointer imported twice counts twice).
    pub fn count(&self) -> usize {
        self.state.lock().imports.values().map(Vec::len).sum()
    }

    /// Closes every import, as far as the driver lets (the allocator is dropped).
    pub fn close_all(&self, driver: &dyn Driver) {
        let ptrs: Vec<_> = self.state.lock().imports.keys().copied().collect();
        for ptr in ptrs {
            while self.close(driver, ptr).is_ok() && self.state.lock().imports.contains_key(&ptr) {}
        }
    }
}

/// Reserves the pages' range, imports and maps each page, grants access to the devices of
/// `access` (`device` first): all or nothing.
fn map_pages(
    driver: &dyn Driver,
    device: i32,
    access: &[i32],
    record: &Record,
    pidfd: &std::os::fd::OwnedFd,
    h: &IpcHandle,
) -> Result<(DevicePtr, How), Error> {
    let r = record.header();
    let page = r.page_size as usize;
    let count = r.page_count as usize;
    let end = h.offset.checked_add(h.size);
    let len = page.checked_mul(count).filter(|&l| l > 0 && end.is_some_and(|e| e <= l as u64));
    let Some(len) = len else { return Err(gone(h, "its record's pages do not hold the block")) };
    let drv = |what: &'static str| move |e| Error::driver(e, what);
    let base = driver.address_reserve(device, len).map_err(drv("reserving address space for an import"))?;
    let mut how = How::Pages { base, page, len, handles: Vec::with_capacity(count), reserved: true };
    let mut step = || -> Result<(), Error> {
        let How::Pages { handles, .. } = &mut how else { unreachable!() };
        for (i, &fd) in record.page_fds().iter().enumerate() {
            let fd = process::getfd(pidfd, fd).map_err(|e| fetch_error(h, e))?;
            let handle = driver.mem_import(device, fd.as_fd(), page).map_err(drv("importing a page"))?;
            handles.push((handle, false));
            driver.mem_map(device, base + (i * page) as u64, page, handle).map_err(drv("mapping an imported page"))?;
            handles.last_mut().expect("pushed above").1 = true;
        }
        driver.mem_set_access(device, base, len, access, true).map_err(drv("granting access to an imported block"))
    };
    match step() {
        Ok(()) => Ok((base + h.offset, how)),
        Err(e) => {
            let _ = undo(driver, device, &mut how, &mut FxHashMap::default());
            Err(e)
        }
    }
}

fn open_segment(driver: &dyn Driver, device: i32, st: &mut State, h: &IpcHandle) -> Result<(DevicePtr, How), Error> {
    let key = (h.owner.pid, h.owner.start, h.segment);
    let base = match st.segments.get_mut(&key) {
        Some((base, uses)) => {
            *uses += 1;
            *base
        }
        None => {
            let base = driver
                .ipc_open_mem_handle(device, &h.segment)
                .map_err(|e| Error::driver(e, "opening an ordinary segment of another process"))?;
            st.segments.insert(key, (base, 1));
            base
        }
    };
    Ok((base.wrapping_add(h.offset), How::Segment { key }))
}

/// Undoes an import's mapping, each step recorded as it succeeds.
fn undo(
    driver: &dyn Driver,
    device: i32,
    how: &mut How,
    segments: &mut FxHashMap<SegmentKey, (DevicePtr, usize)>,
) -> Result<(), Error> {
    let drv = |what: &'static str| move |e| Error::driver_call(e, what);
    match how {
        How::Pages { base, page, len, handles, reserved } => {
            for (i, (_, mapped)) in handles.iter_mut().enumerate() {
                if *mapped {
                    driver.mem_unmap(device, *base + (i * *page) as u64, *page).map_err(drv("unmapping an import"))?;
                    *mapped = false;
                }
            }
            while let Some(&(handle, _)) = handles.last() {
                driver.mem_release(device, handle).map_err(drv("releasing an imported page"))?;
                handles.pop();
            }
            if *reserved {
                driver.address_free(device, *base, *len).map_err(drv("freeing an import's address range"))?;
                *reserved = false;
            }
            Ok(())
        }
        How::Segment { key } => {
            let Some((base, uses)) = segments.get_mut(key) else { return Ok(()) };
            if *uses == 1 {
                driver.ipc_close_mem_handle(device, *base).map_err(drv("closing an ordinary segment's import"))?;
                segments.remove(key);
            } else {
                *uses -= 1;
            }
            Ok(())
        }
    }
}
