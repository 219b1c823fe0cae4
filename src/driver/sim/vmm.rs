//! Virtual memory (expandable segments): address ranges reserved as host address space without
//! access, physical handles created against the device's capacity (each an extent of the
//! device's file, `backing`), and the mapping, access and unmapping of handles in reserved
//! ranges, checked as CUDA checks them. A handle's bytes live in the file: they outlast an
//! unmap, as a real handle's do, and every process that maps it sees the same bytes.

use rustc_hash::FxHashMap;

use super::{DevicePtr, DriverError, PhysHandle, SimDriver, SimOp, State, invalid};
use crate::driver::ops::VirtualMemoryOps;
use crate::os::mapping;

// Rust API only: cbindgen run over the whole crate would otherwise put it into the C header.
/// The simulated device's virtual memory page size (the H100's minimum granularity).
///
/// cbindgen:ignore
pub const SIM_GRANULARITY: usize = 2 << 20;

/// A reserved address range: host address space without access (`PROT_NONE`), whose pages
/// become readable and writable while mapped.
pub(super) struct Range {
    pub(super) device: i32,
    pub(super) size: usize,
    /// Mapped pieces: start -> (size, handle).
    mapped: std::collections::BTreeMap<DevicePtr, (usize, u64)>,
    /// Pieces whose access was set (start -> size, the devices granted read and write, in
    /// order); a subset of `mapped`.
    accessible: FxHashMap<DevicePtr, (usize, Vec<i32>)>,
}

impl Range {
    /// The mapped pieces (start, size, handle) that make up `[ptr, ptr + size)` exactly, or
    /// `None` when some byte of it is not mapped or a piece sticks out of it.
    fn pieces(&self, ptr: DevicePtr, size: usize) -> Option<Vec<(DevicePtr, usize, u64)>> {
        let end = ptr + size as u64;
        let pieces: Vec<_> = self.mapped.range(ptr..end).map(|(&a, &(s, h))| (a, s, h)).collect();
        let covered = pieces.iter().try_fold(ptr, |at, &(a, s, _)| (a == at).then_some(a + s as u64));
        (covered == Some(end)).then_some(pieces)
    }
}

impl Range {
    /// Whether every byte of `[ptr, ptr + size)` is mapped with access set (what a copy or a
    /// kernel may touch).
    pub(super) fn accessible_over(&self, ptr: DevicePtr, size: usize) -> bool {
        let end = ptr + size as u64;
        // The piece holding `ptr`, then each piece after it, until `end` is covered.
        let Some((&first, _)) = self.mapped.range(..=ptr).next_back() else { return false };
        let mut at = first;
        for (&a, &(s, _)) in self.mapped.range(first..) {
            if a != at || !self.accessible.contains_key(&a) {
                return false;
            }
            at = a + s as u64;
            if at >= end {
                return true;
            }
        }
        false
    }
}

impl Range {
    /// The handles mapped over every byte of `[ptr, ptr + size)`, in address order (the first
    /// and last may stick out of it), or `None` when some byte of it is not mapped: what
    /// `cuMemGetHandleForAddressRange` asks of a reserved range.
    pub(super) fn handles_over(&self, ptr: DevicePtr, size: usize) -> Option<Vec<u64>> {
        let end = ptr + size as u64;
        let (&first, _) = self.mapped.range(..=ptr).next_back()?;
        let mut at = first;
        let mut handles = Vec::new();
        for (&a, &(s, h)) in self.mapped.range(first..) {
            if a != at {
                return None;
            }
            handles.push(h);
            at = a + s as u64;
            if at >= end {
                return (first + self.mapped[&first].0 as u64 > ptr).then_some(handles);
            }
        }
        None
    }
}

/// What a physical handle's bytes are.
#[derive(Clone, Copy)]
pub(super) enum Backing {
    /// An extent of this driver's file of the handle's device, at this offset.
    Device { offset: u64 },
    /// Another process's memory (`mem_import`): a shared mapping of it, without access, at
    /// `hold`, which keeps it alive with no descriptor (a real importer keeps none); mapping the
    /// handle maps those pages again. Counts against the other process's device, not this one's.
    Imported { hold: u64 },
}

/// A physical allocation: its device, size and bytes, and where it is mapped, if anywhere.
pub(super) struct Handle {
    pub(super) device: i32,
    pub(super) size: usize,
    pub(super) mapped_at: Option<DevicePtr>,
    pub(super) backing: Backing,
}

impl State {
    /// The reserved range that contains `[ptr, ptr + size)`, by its base.
    pub(super) fn range_of(&mut self, ptr: DevicePtr, size: usize) -> Option<(DevicePtr, &mut Range)> {
        let (&base, r) = self.ranges.range_mut(..=ptr).next_back()?;
        (ptr - base + size as u64 <= r.size as u64).then_some((base, r))
    }
}

/// `prot` on `[ptr, ptr + size)` of host address space the simulated driver reserved; with
/// `PROT_NONE` the pages are also dropped (their contents are lost, as an unmapped page's).
fn protect(ptr: DevicePtr, size: usize, prot: libc::c_int) -> bool {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
    // SAFETY: the range lies inside a reservation of this driver (checked by the callers), so
    // MAP_FIXED replaces only pages the driver owns.
    let p = unsafe { libc::mmap(ptr as *mut libc::c_void, size, prot, flags, -1, 0) };
    p != libc::MAP_FAILED
}

impl State {
    /// Maps handle `h`'s bytes at `at` (in a range of the driver's), readable and writable.
    fn place(&self, h: &Handle, at: DevicePtr) -> bool {
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        match h.backing {
            Backing::Device { offset } => {
                self.files.get(&h.device).and_then(|f| f.map(Some(at), offset, h.size, rw)).is_some()
            }
            Backing::Imported { hold } => super::backing::map_again(hold, at, h.size),
        }
    }
}

impl SimDriver {
    /// Reserved address ranges not yet freed, and physical handles not yet released, on every
    /// device.
    pub fn live_vmm(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.ranges.len(), st.handles.len())
    }

    /// Where `handle` is mapped: `Some(None)` for a live handle mapped nowhere, `None` for a
    /// handle that was released or never made.
    pub fn handle_mapped_at(&self, handle: PhysHandle) -> Option<Option<DevicePtr>> {
        self.state.lock().handles.get(&handle.0).map(|h| h.mapped_at)
    }

    /// Bytes mapped with access set on `device` (what a kernel could touch).
    pub fn accessible(&self, device: i32) -> usize {
        let st = self.state.lock();
        st.ranges.values().filter(|r| r.device == device).flat_map(|r| r.accessible.values()).map(|a| a.0).sum()
    }

    /// Every mapped piece of `device`'s memory with access set: (start, bytes, the devices
    /// granted read and write, in order), by address. What a test checks peer access against
    /// (`gpupool_enable_peer_access`).
    pub fn access_map(&self, device: i32) -> Vec<(DevicePtr, usize, Vec<i32>)> {
        let st = self.state.lock();
        let mut all: Vec<_> = st
            .ranges
            .values()
            .filter(|r| r.device == device)
            .flat_map(|r| r.accessible.iter().map(|(&a, (s, to))| (a, *s, to.clone())))
            .collect();
        all.sort_unstable_by_key(|p| p.0);
        all
    }
}

impl VirtualMemoryOps for SimDriver {
    fn vmm_granularity(&self, _device: i32) -> Result<Option<usize>, DriverError> {
        self.run_hooks(SimOp::VmmGranularity);
        self.state.lock().fault(SimOp::VmmGranularity)?;
        Ok(Some(SIM_GRANULARITY))
    }

    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.run_hooks(SimOp::AddressReserve);
        let mut st = self.state.lock();
        st.counts.address_reserve += 1;
        st.fault(SimOp::AddressReserve)?;
        st.unsafe_call("cuMemAddressReserve")?;
        if size == 0 || size % SIM_GRANULARITY != 0 {
            return Err(invalid("cuMemAddressReserve"));
        }
        // Host address space without access, aligned to the granularity.
        let base = mapping::reserve_aligned(size, SIM_GRANULARITY).ok_or(DriverError::OutOfMemory)?;
        let range = Range { device, size, mapped: Default::default(), accessible: Default::default() };
        st.ranges.insert(base as DevicePtr, range);
        Ok(base as DevicePtr)
    }

    fn address_free(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::AddressFree);
        let mut st = self.state.lock();
        st.fault(SimOp::AddressFree)?;
        st.unsafe_call("cuMemAddressFree")?;
        match st.ranges.get(&ptr) {
            Some(r) if r.size == size && r.mapped.is_empty() => {}
            _ => return Err(invalid("cuMemAddressFree")),
        }
        st.ranges.remove(&ptr);
        st.forget_maps(ptr, size);
        // SAFETY: exactly a reservation made by `address_reserve`, wholly unmapped.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }

    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError> {
        self.run_hooks(SimOp::MemCreate);
        let mut st = self.state.lock();
        st.counts.mem_create += 1;
        st.fault(SimOp::MemCreate)?;
        st.unsafe_call("cuMemCreate")?;
        if size == 0 || size % SIM_GRANULARITY != 0 {
            return Err(invalid("cuMemCreate"));
        }
        let d = device as usize;
        if size > self.capacity - st.used[d] {
            return Err(DriverError::OutOfMemory);
        }
        let offset = st.file(device)?.take(size as u64).map_err(|_| DriverError::OutOfMemory)?;
        st.used[d] += size;
        st.next_handle += 1;
        let id = st.next_handle;
        st.handles.insert(id, Handle { device, size, mapped_at: None, backing: Backing::Device { offset } });
        Ok(PhysHandle(id))
    }

    fn mem_release(&self, _device: i32, handle: PhysHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemRelease);
        let mut st = self.state.lock();
        st.counts.mem_release += 1;
        st.fault(SimOp::MemRelease)?;
        st.unsafe_call("cuMemRelease")?;
        match st.handles.get(&handle.0) {
            Some(h) if h.mapped_at.is_none() => {}
            _ => return Err(invalid("cuMemRelease")),
        }
        let h = st.handles.remove(&handle.0).expect("checked above");
        match h.backing {
            Backing::Device { offset } => {
                st.used[h.device as usize] -= h.size;
                st.file(h.device)?.give_back(offset, h.size as u64);
            }
            // SAFETY: exactly the hold `mem_import` made, not yet unmapped.
            Backing::Imported { hold } => unsafe {
                libc::munmap(hold as *mut libc::c_void, h.size);
            },
        }
        Ok(())
    }

    fn mem_map(&self, _device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemMap);
        let mut st = self.state.lock();
        st.counts.mem_map += 1;
        st.fault(SimOp::MemMap)?;
        st.unsafe_call("cuMemMap")?;
        let fits = st.handles.get(&handle.0).is_some_and(|h| h.size == size && h.mapped_at.is_none());
        let Some((_, r)) = st.range_of(ptr, size).filter(|_| fits && ptr % SIM_GRANULARITY as u64 == 0) else {
            return Err(invalid("cuMemMap"));
        };
        let overlaps = r.mapped.range(..ptr + size as u64).next_back().is_some_and(|(&a, &(s, _))| a + s as u64 > ptr);
        if overlaps {
            return Err(invalid("cuMemMap"));
        }
        r.mapped.insert(ptr, (size, handle.0));
        st.handles.get_mut(&handle.0).expect("checked above").mapped_at = Some(ptr);
        st.classify_map(ptr, size, handle.0);
        Ok(())
    }

    /// `cuMemSetAccess` for the devices of `to`, each a device of the driver named once:
    /// granted read and write (`read_write`) or none. A piece's bytes are placed at its address
    /// at its first grant (what a copy or the host may touch from then on); a grant records the
    /// devices, a revocation removes them (the bytes stay placed).
    fn mem_set_access(
        &self,
        _device: i32,
        ptr: DevicePtr,
        size: usize,
        to: &[i32],
        read_write: bool,
    ) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemSetAccess);
        let mut st = self.state.lock();
        st.counts.mem_set_access += 1;
        st.counts.mem_access_descs += to.len() as u64;
        st.fault(SimOp::MemSetAccess)?;
        st.unsafe_call("cuMemSetAccess")?;
        let named_once = to.iter().enumerate().all(|(i, d)| !to[..i].contains(d));
        if to.is_empty() || !named_once || to.iter().any(|&d| d < 0 || d >= self.devices) {
            return Err(invalid("cuMemSetAccess"));
        }
        let Some((_, r)) = st.range_of(ptr, size) else {
            return Err(invalid("cuMemSetAccess"));
        };
        let Some(pieces) = r.pieces(ptr, size) else {
            return Err(invalid("cuMemSetAccess"));
        };
        let new: Vec<_> = pieces.iter().filter(|p| !r.accessible.contains_key(&p.0)).copied().collect();
        // Each piece is its handle's bytes mapped where the handle is mapped (pieces cover the
        // range exactly, so nothing else of it needs access).
        if read_write && !new.iter().all(|&(a, _, h)| st.handles.get(&h).is_some_and(|h| st.place(h, a))) {
            return Err(DriverError::OutOfMemory);
        }
        let Some((_, r)) = st.range_of(ptr, size) else { unreachable!("found above") };
        for (a, s, _) in pieces {
            match r.accessible.get_mut(&a) {
                Some((_, granted)) if read_write => {
                    granted.extend(to.iter().filter(|d| !granted.contains(d)).collect::<Vec<_>>())
                }
                Some((_, granted)) => granted.retain(|d| !to.contains(d)),
                None if read_write => {
                    r.accessible.insert(a, (s, to.to_vec()));
                }
                None => {}
            }
        }
        if read_write {
            st.close_map_run();
        }
        Ok(())
    }

    fn mem_unmap(&self, _device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.run_hooks(SimOp::MemUnmap);
        let mut st = self.state.lock();
        st.counts.mem_unmap += 1;
        st.fault(SimOp::MemUnmap)?;
        st.unsafe_call("cuMemUnmap")?;
        let Some((_, r)) = st.range_of(ptr, size) else {
            return Err(invalid("cuMemUnmap"));
        };
        // CUDA unmaps whole mappings only.
        let Some(pieces) = r.pieces(ptr, size) else {
            return Err(invalid("cuMemUnmap"));
        };
        if !protect(ptr, size, libc::PROT_NONE) {
            return Err(DriverError::OutOfMemory);
        }
        for &(a, _, _) in &pieces {
            r.mapped.remove(&a);
            r.accessible.remove(&a);
        }
        for (_, _, h) in pieces {
            st.handles.get_mut(&h).expect("a mapped handle exists").mapped_at = None;
        }
        Ok(())
    }

    fn handle_is_free(&self, handle: PhysHandle) -> Option<bool> {
        Some(self.handle_mapped_at(handle) == Some(None))
    }
}
