//! The address range of an expandable segment and the pages mapped in it (PyTorch
//! `ExpandableSegment`), on the driver's virtual memory calls.
//!
//! A range of device address space is reserved once (`cuMemAddressReserve`), and physical
//! pages are mapped into it on demand (`cuMemMap`, `cuMemSetAccess`), one handle per page, so
//! that a segment grows instead of a new one being allocated, and pages that are wholly free
//! can be unmapped (`cuMemUnmap`) while the rest of the segment stays in use. Where PyTorch
//! creates a handle for each page it maps and releases it when it unmaps (`cuMemCreate`,
//! `cuMemRelease`), this type maps the handles its caller hands it first (the device's page
//! pool, [`super::page_pool`]) and hands back the handles it unmaps, creating only what it lacks. It
//! knows pages only; the blocks over them are the shard's (the rest of [`super`]).
//!
//! Failures leave the page table true to the driver: a page counts as mapped exactly when its
//! memory is mapped at its address with access set. [`Expandable::map`] is all or nothing: it
//! grants access to its pages only once all of them are mapped, and undoes them all when a
//! call fails, handing their handles back; a handle the driver will not unmap is kept as an
//! orphan, never counted, and unmapped and released at the next chance.

use crate::driver::{DevicePtr, Driver, DriverError, PhysHandle};

/// One expandable segment's address range and page table. Not thread-safe on its own: it
/// lives in its shard, behind the shard's lock.
#[derive(Debug)]
pub(crate) struct Expandable {
    /// Start of the reserved range.
    pub base: DevicePtr,
    /// Bytes of address space reserved (a multiple of `page`).
    pub size: usize,
    /// Bytes per page (a multiple of the driver's granularity).
    pub page: usize,
    /// The handle mapped at each page, grown as pages are mapped (host memory follows the
    /// highest page mapped, not the range).
    pages: Vec<Option<PhysHandle>>,
    /// Bytes mapped.
    pub mapped: usize,
    /// Handles that are not pages of the table and that the driver still holds: those of a
    /// map whose map or access grant failed or unwound, until they are unmapped and handed
    /// back, and those the driver would not unmap then. Each is unmapped (if mapped, at the
    /// address given) and released at the next chance, and before the range is given back;
    /// memory behind a page without access is never counted as mapped, so never put in a
    /// block.
    orphans: Vec<(PhysHandle, Option<DevicePtr>)>,
    /// The pages unmapped by [`Expandable::sleep`] and not yet mapped again by
    /// [`Expandable::wake`], by index (`gpupool_sleep`, see `caching::sleep`): their blocks
    /// keep their addresses with no memory behind them.
    slept: Vec<bool>,
    /// Bytes of those pages.
    pub slept_bytes: usize,
}

impl Expandable {
    /// Reserves `size` bytes of address space on `device` (PyTorch's `ExpandableSegment`
    /// constructor). `size` and `page` are multiples of the driver's granularity.
    ///
    /// Errors: the driver's, as `cuMemAddressReserve` fails (out of address space counts as
    /// out of memory).
    pub fn reserve(driver: &dyn Driver, device: i32, size: usize, page: usize) -> Result<Expandable, DriverError> {
        debug_assert!(size > 0 && size % page == 0);
        let base = driver.address_reserve(device, size)?;
        Ok(Expandable {
            base,
            size,
            page,
            pages: Vec::new(),
            mapped: 0,
            orphans: Vec::new(),
            slept: Vec::new(),
            slept_bytes: 0,
        })
    }

    /// Gives the address range back (`cuMemAddressFree`), after the handles still to be
    /// released; every page must be unmapped.
    ///
    /// Errors: the driver's (a handle it will not release yet counts as its error); the range
    /// stays reserved and `self` usable.
    pub fn free(&mut self, driver: &dyn Driver, device: i32) -> Result<(), DriverError> {
        debug_assert_eq!(self.mapped, 0);
        if let Some(e) = self.release_orphans(driver, device) {
            return Err(e);
        }
        driver.address_free(device, self.base, self.size)
    }

    /// Unmaps and releases the orphaned handles; returns the first failure, if any (those
    /// handles stay listed).
    pub fn release_orphans(&mut self, driver: &dyn Driver, device: i32) -> Option<DriverError> {
        let mut failure = None;
        let mut i = 0;
        // One at a time, each step recorded as it succeeds: a call that unwinds leaves the
        // list true.
        while i < self.orphans.len() {
            let (handle, at) = self.orphans[i];
            if let Some(at) = at {
                if let Err(e) = driver.mem_unmap(device, at, self.page) {
                    failure.get_or_insert(e);
                    i += 1;
                    continue;
                }
                self.orphans[i].1 = None;
            }
            match driver.mem_release(device, handle) {
                Ok(()) => {
                    self.orphans.swap_remove(i);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                    i += 1;
                }
            }
        }
        failure
    }

    /// Bytes of the orphaned handles, which the driver holds and no page counts: the next
    /// release frees them (`gpupool_largest_allocatable` counts them so).
    pub fn orphan_bytes(&self) -> usize {
        self.orphans.len() * self.page
    }

    /// Whether the page at `offset` bytes into the range is mapped.
    pub fn is_mapped(&self, offset: usize) -> bool {
        self.pages.get(offset / self.page).is_some_and(Option::is_some)
    }

    /// The page table, a slot per page up to the highest mapped (those past it are unmapped).
    pub fn page_table(&self) -> &[Option<PhysHandle>] {
        &self.pages
    }

    /// Maps `len` bytes at `offset` (both whole pages, all unmapped): per page a handle of
    /// `spare` (taken from its end) or, once `spare` is empty, a new one (`cuMemCreate`),
    /// mapped (`cuMemMap`); then access to the whole run in one `cuMemSetAccess`, as PyTorch
    /// `ExpandableSegment::map` does through `mapAndSetAccess`: access is the costly call (it
    /// updates the page tables of the device and of its peers), and a growth of many pages
    /// pays for it once. All or nothing: when a call fails, the pages of this call are unmapped
    /// again and their handles, from `spare` or new, go to `spare`.
    ///
    /// `access`: the devices granted read and write, `device` first, then the peers enabled
    /// (`caching::peers`; PyTorch's `setAccess` for the device and its `peers_`).
    ///
    /// Errors: the first failure ([`DriverError::OutOfMemory`] when the device has no memory
    /// for a new handle). A page is counted in [`Expandable::mapped`] only once access to it
    /// was granted, so none of a failed call's pages is; a handle the driver would not unmap
    /// stays an orphan (see the module docs), neither mapped nor in `spare`.
    pub fn map(
        &mut self,
        driver: &dyn Driver,
        device: i32,
        offset: usize,
        len: usize,
        spare: &mut Vec<PhysHandle>,
        access: &[i32],
    ) -> Result<(), DriverError> {
        debug_assert!(offset % self.page == 0 && len % self.page == 0 && offset + len <= self.size);
        let first = offset / self.page;
        let count = len / self.page;
        let start = self.base + offset as u64;
        let end = start + len as u64;
        if self.orphans.iter().any(|o| o.1.is_some_and(|at| at >= start && at < end))
            && let Some(e) = self.release_orphans(driver, device)
        {
            return Err(e);
        }
        if self.pages.len() < first + count {
            self.pages.resize(first + count, None);
        }
        // Until access is granted, this call's handles are orphans: a failure at any step
        // leaves the table true and the handles to [`Expandable::unwind`], and a call that
        // unwinds leaves them to [`Expandable::release_orphans`].
        let new = self.orphans.len();
        let mut made = Ok(());
        for i in first..first + count {
            debug_assert!(self.pages[i].is_none(), "page {i} mapped twice");
            let at = self.base + (i * self.page) as u64;
            let handle = match spare.pop() {
                Some(h) => Ok(h),
                None => driver.mem_create(device, self.page),
            };
            made = handle.and_then(|handle| {
                self.orphans.push((handle, None));
                driver.mem_map(device, at, self.page, handle)
            });
            if made.is_err() {
                break;
            }
            let last = self.orphans.len() - 1;
            self.orphans[last].1 = Some(at);
        }
        if let Err(e) = made.and_then(|()| driver.mem_set_access(device, start, len, access, true)) {
            self.unwind(driver, device, new, spare);
            self.trim();
            return Err(e);
        }
        for (k, (handle, _)) in self.orphans.drain(new..).enumerate() {
            self.pages[first + k] = Some(handle);
        }
        self.mapped += len;
        Ok(())
    }

    /// Undoes the orphans from index `new` on (a failed map's handles): each is unmapped if
    /// mapped and goes to `spare`; one the driver will not unmap stays an orphan.
    fn unwind(&mut self, driver: &dyn Driver, device: i32, new: usize, spare: &mut Vec<PhysHandle>) {
        let mut i = new;
        while i < self.orphans.len() {
            let (handle, at) = self.orphans[i];
            if let Some(at) = at
                && driver.mem_unmap(device, at, self.page).is_err()
            {
                i += 1;
                continue;
            }
            self.orphans.remove(i);
            spare.push(handle);
        }
    }

    /// Unmaps `len` bytes at `offset` (whole pages, all mapped; PyTorch
    /// `ExpandableSegment::unmap`) and appends their handles, mapped nowhere now, to `spare`
    /// (PyTorch releases them). The caller has made sure that no work on the device still uses
    /// them: `cuMemUnmap` does not wait. Orphans left by earlier failures are retried.
    ///
    /// Errors: the first failure; the pages before it are unmapped, that page and the ones
    /// after it stay mapped.
    pub fn unmap(
        &mut self,
        driver: &dyn Driver,
        device: i32,
        offset: usize,
        len: usize,
        spare: &mut Vec<PhysHandle>,
    ) -> Result<(), DriverError> {
        debug_assert!(offset % self.page == 0 && len % self.page == 0 && offset + len <= self.size);
        let first = offset / self.page;
        let r = (first..first + len / self.page).try_for_each(|i| {
            let at = self.base + (i * self.page) as u64;
            let handle = self.pages[i].expect("only mapped pages are unmapped");
            driver.mem_unmap(device, at, self.page)?;
            self.pages[i] = None;
            self.mapped -= self.page;
            spare.push(handle);
            Ok(())
        });
        self.trim();
        if !self.orphans.is_empty() {
            self.release_orphans(driver, device);
        }
        r
    }

    /// The handle mapped at page `index`, if that page is mapped (`gpupool_ipc_export`).
    pub fn handle(&self, index: usize) -> Option<PhysHandle> {
        self.pages.get(index).copied().flatten()
    }

    /// Whether the page at `offset` bytes into the range is mapped, or was when the segment
    /// was put to sleep and is to be mapped again at wake: whether blocks may lie on it.
    pub fn is_held(&self, offset: usize) -> bool {
        self.is_mapped(offset) || self.slept.get(offset / self.page).is_some_and(|&s| s)
    }

    /// Unmaps every mapped page for `gpupool_sleep`, one page at a time (`cuMemUnmap`), each
    /// marked slept, their handles appended to `out` (mapped nowhere, for the caller to
    /// release). The caller has made sure that no work on the device still uses them.
    ///
    /// Errors: the first failure; the pages before it are unmapped and slept, that page and
    /// the ones after it stay mapped.
    pub fn sleep(&mut self, driver: &dyn Driver, device: i32, out: &mut Vec<PhysHandle>) -> Result<(), DriverError> {
        let mapped: Vec<usize> = (0..self.pages.len()).filter(|&i| self.pages[i].is_some()).collect();
        for i in mapped {
            self.unmap_slept(driver, device, i, out)?;
        }
        Ok(())
    }

    /// Unmaps page `i` for a sleep, its handle to `out`: slept if it is unmapped after the
    /// call, whatever happens (a driver call that unwinds after the page went included).
    fn unmap_slept(
        &mut self,
        driver: &dyn Driver,
        device: i32,
        i: usize,
        out: &mut Vec<PhysHandle>,
    ) -> Result<(), DriverError> {
        let mut e = scopeguard::guard(self, |e| {
            let slept = !e.is_mapped(i * e.page);
            if e.slept.len() <= i {
                e.slept.resize(i + 1, false);
            }
            if std::mem::replace(&mut e.slept[i], slept) != slept {
                if slept { e.slept_bytes += e.page } else { e.slept_bytes -= e.page }
            }
        });
        let page = e.page;
        e.unmap(driver, device, i * page, page, out)
    }

    /// Maps the slept pages again for `gpupool_wake`: each run of them with one
    /// [`Expandable::map`] granting `access`, handles of `spare` first, then new ones (`cuMemCreate`). All or
    /// nothing: when a run fails, the runs this call mapped are unmapped again, their handles
    /// to `spare`, and every page stays slept (but one the driver would not unmap again, which
    /// stays mapped and is no longer slept).
    ///
    /// Errors: the first failure ([`DriverError::OutOfMemory`] when the device has no memory
    /// for a page).
    pub fn wake(
        &mut self,
        driver: &dyn Driver,
        device: i32,
        spare: &mut Vec<PhysHandle>,
        access: &[i32],
    ) -> Result<(), DriverError> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, _) in self.slept.iter().enumerate().filter(|(_, s)| **s) {
            match runs.last_mut() {
                Some((first, count)) if *first + *count == i => *count += 1,
                _ => runs.push((i, 1)),
            }
        }
        for (k, &(first, count)) in runs.iter().enumerate() {
            if let Err(e) = self.map(driver, device, first * self.page, count * self.page, spare, access) {
                for &(f, c) in runs[..k].iter().rev() {
                    for i in f..f + c {
                        let _ = self.unmap_slept(driver, device, i, spare);
                    }
                }
                return Err(e);
            }
        }
        self.slept = Vec::new();
        self.slept_bytes = 0;
        Ok(())
    }

    /// Drops unmapped pages at the end of the table.
    fn trim(&mut self) {
        while self.pages.last() == Some(&None) {
            self.pages.pop();
        }
        if self.pages.capacity() > 2 * self.pages.len() + 16 {
            self.pages.shrink_to_fit();
        }
    }
}

#[cfg(test)]
#[path = "segment_tests.rs"]
mod tests;
