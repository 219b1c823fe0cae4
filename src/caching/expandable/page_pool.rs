//! The device's physical pages held for expandable segments (not in PyTorch, whose
//! `ExpandableSegment::unmap` releases every handle it unmaps, and whose `map` creates every
//! handle it maps).
//!
//! A page unmapped from an expandable segment keeps its physical handle (`cuMemUnmap`
//! without `cuMemRelease`), and the handle waits here; a growth of any stream's segment maps a
//! held handle before it creates one (`cuMemMap` without `cuMemCreate`). On an H100 a page
//! created, mapped, granted access, unmapped and released costs 108-135 us, a held one mapped,
//! granted access and unmapped 69-84 us (2026-11-25). One pool per device, under its own
//! small lock, a leaf of the lock order (taken with or without a shard's lock, never held while
//! taking another); the hit path never touches it.
//!
//! A held handle is device memory: the memory limit counts it ([`MemoryLimit`]: mapped plus
//! held), reserved bytes do not (they count mapped pages, as PyTorch's). Handles go back to the
//! driver only when the cache is released (`empty_cache`, the out-of-memory path), under
//! `garbage_collection_threshold`, and past [`PagePool::trim`]'s bound after a growth.

use parking_lot::Mutex;

use crate::caching::limit::MemoryLimit;
use crate::driver::{Driver, DriverError, PhysHandle};
use crate::stats::Stat;

/// A growth leaves the pool at most this share of the device's other reserved bytes
/// (`1/TRIM_SHARE`, see [`PagePool::trim`]).
const TRIM_SHARE: usize = 8;

/// One device's held physical handles, by page size, and their statistic.
#[derive(Debug, Default)]
pub(crate) struct PagePool {
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    /// (page bytes, handles of that size mapped nowhere), one entry per page size seen (2 MiB;
    /// and 20 MiB with `GPUPOOL_EXPANDABLE_LARGE_PAGES`).
    free: Vec<(usize, Vec<PhysHandle>)>,
    /// Bytes held: `allocated` counts handles put in, `freed` those taken out or released.
    held: Stat,
}

impl PoolState {
    fn list(&mut self, page: usize) -> &mut Vec<PhysHandle> {
        let i = match self.free.iter().position(|l| l.0 == page) {
            Some(i) => i,
            None => {
                self.free.push((page, Vec::new()));
                self.free.len() - 1
            }
        };
        &mut self.free[i].1
    }

    fn add(&mut self, bytes: i64) {
        let h = &mut self.held;
        h.current += bytes;
        if bytes >= 0 {
            h.allocated += bytes;
            h.peak = h.peak.max(h.current);
        } else {
            h.freed -= bytes;
        }
    }
}

impl PagePool {
    /// Moves up to `n` held handles of `page` bytes into `out`. Returns how many.
    pub fn take(&self, page: usize, n: usize, out: &mut Vec<PhysHandle>) -> usize {
        let mut st = self.state.lock();
        let list = st.list(page);
        let k = n.min(list.len());
        out.extend(list.drain(list.len() - k..));
        st.add(-((k * page) as i64));
        k
    }

    /// Holds the handles of `handles` (each of `page` bytes, mapped nowhere), leaving it empty.
    pub fn put(&self, page: usize, handles: &mut Vec<PhysHandle>) {
        if handles.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        let bytes = (handles.len() * page) as i64;
        st.list(page).append(handles);
        st.add(bytes);
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.state.lock().held.current as usize
    }

    /// Bytes held now of each page size: (page bytes, bytes held).
    pub fn held_by_page(&self) -> Vec<(usize, usize)> {
        self.state.lock().free.iter().map(|(page, l)| (*page, page * l.len())).collect()
    }

    /// The statistic of held bytes (current, peak, bytes put in, bytes taken or released).
    pub fn stat(&self) -> Stat {
        self.state.lock().held
    }

    /// The peak starts again from what is held now (PyTorch `resetPeakStats`).
    pub fn reset_peak(&self) {
        let mut st = self.state.lock();
        st.held.peak = st.held.current;
    }

    /// Releases held handles (`cuMemRelease`) until at most `keep` bytes are held, the newest
    /// of each size first, the handles of `first` bytes (if given) before the other sizes,
    /// each uncharged from `limit` once the driver has it back. Returns the
    /// bytes released and the first failure: a handle the driver refuses stays held and
    /// counted, to be released at the next chance; the ones after it are still tried.
    pub fn release(
        &self,
        driver: &dyn Driver,
        device: i32,
        limit: &MemoryLimit,
        keep: usize,
        first: Option<usize>,
    ) -> (usize, Option<DriverError>) {
        let mut st = self.state.lock();
        let (mut released, mut failure) = (0, None);
        let mut order: Vec<usize> = (0..st.free.len()).collect();
        order.sort_by_key(|&l| Some(st.free[l].0) != first);
        for l in order {
            let page = st.free[l].0;
            // From the end, each handle taken off the list only once the driver has it (a call
            // that unwinds leaves it held).
            let mut i = st.free[l].1.len();
            while i > 0 && st.held.current as usize > keep {
                i -= 1;
                let handle = st.free[l].1[i];
                match driver.mem_release(device, handle) {
                    Ok(()) => {
                        st.free[l].1.swap_remove(i);
                        st.add(-(page as i64));
                        limit.uncharge(page);
                        released += page;
                    }
                    Err(e) => {
                        failure.get_or_insert(e);
                    }
                }
            }
        }
        (released, failure)
    }

    /// Releases held handles of the page sizes below `page` (`cuMemRelease`), the newest of
    /// each size first, until at least `want` bytes are released or none of those is left,
    /// each uncharged from `limit` once the driver has it back: for a growth in `page`-byte
    /// pages, which cannot map them, the physical memory they hold (the high-water rule
    /// across page sizes, `expandable::cross`). Returns the bytes released and the first
    /// failure: a handle the driver refuses stays held and counted, the others are still tried.
    pub fn release_smaller(
        &self,
        driver: &dyn Driver,
        device: i32,
        limit: &MemoryLimit,
        page: usize,
        want: usize,
    ) -> (usize, Option<DriverError>) {
        let mut st = self.state.lock();
        let (mut released, mut failure) = (0, None);
        for l in 0..st.free.len() {
            let size = st.free[l].0;
            if size >= page {
                continue;
            }
            let mut i = st.free[l].1.len();
            while i > 0 && released < want {
                i -= 1;
                let handle = st.free[l].1[i];
                match driver.mem_release(device, handle) {
                    Ok(()) => {
                        st.free[l].1.swap_remove(i);
                        st.add(-(size as i64));
                        limit.uncharge(size);
                        released += size;
                    }
                    Err(e) => {
                        failure.get_or_insert(e);
                    }
                }
            }
        }
        (released, failure)
    }

    /// The bound after a growth: the pool exists to carry pages from an unmapping to the
    /// growth it serves (the high-water rule unmaps what the growth passes its mark by, and
    /// the growth maps those handles at once), so what a growth leaves held is a leftover (of
    /// a failed growth, or of another stream's unmapping meanwhile). It keeps at most an
    /// eighth of the device's other reserved bytes (`limit` counts mapped plus held) for the
    /// next growth, and releases the rest. Never called between an unmapping and the growth
    /// it is for.
    pub fn trim(&self, driver: &dyn Driver, device: i32, limit: &MemoryLimit) {
        let held = self.held();
        let keep = (limit.reserved().max(0) as usize).saturating_sub(held) / TRIM_SHARE;
        if held > keep {
            // A failure leaves the handle held, for the next trim or release.
            let _ = self.release(driver, device, limit, keep, None);
        }
    }

    /// For the consistency check: the held bytes equal the statistic, and the driver, where it
    /// can tell, has every held handle alive and mapped nowhere.
    pub fn check(&self, driver: &dyn Driver) -> Result<(), String> {
        let st = self.state.lock();
        let bytes: usize = st.free.iter().map(|(page, l)| page * l.len()).sum();
        if bytes as i64 != st.held.current || st.held.current > st.held.peak {
            return Err(format!("held pages are {bytes} bytes, but their statistic is {:?}", st.held));
        }
        for (_, l) in &st.free {
            for &h in l {
                if driver.handle_is_free(h) == Some(false) {
                    return Err(format!("held handle {h:?} is mapped or was released"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::ops::*;
    use crate::driver::sim::{SIM_GRANULARITY, SimDriver, SimFault, SimOp};

    const P: usize = SIM_GRANULARITY;

    #[test]
    fn handles_are_taken_newest_first_and_released_down_to_what_is_kept() {
        let sim = SimDriver::new(1, 64 << 20);
        let limit = MemoryLimit::default();
        let pool = PagePool::default();
        let mut made: Vec<PhysHandle> = (0..4).map(|_| sim.mem_create(0, P).unwrap()).collect();
        limit.try_charge(4 * P).unwrap().commit();
        let first = made[0];
        pool.put(P, &mut made);
        assert!(made.is_empty());
        assert_eq!((pool.held(), pool.stat().peak), (4 * P, 4 * P as i64));
        let mut out = Vec::new();
        assert_eq!(pool.take(P, 3, &mut out), 3);
        assert_eq!(pool.take(2 * P, 3, &mut out), 0, "another page size has its own list");
        assert_eq!((out.len(), pool.held()), (3, P));
        assert!(!out.contains(&first), "the oldest stays");
        pool.put(P, &mut out);
        pool.check(&sim).unwrap();
        // A release the driver refuses leaves that handle held and counted; the rest go.
        sim.inject(SimOp::MemRelease, 1, SimFault::Fail(DriverError::OutOfMemory));
        let (bytes, err) = pool.release(&sim, 0, &limit, 0, None);
        assert_eq!((bytes, err), (3 * P, Some(DriverError::OutOfMemory)));
        assert_eq!((pool.held(), limit.reserved(), sim.used(0)), (P, P as i64, P));
        pool.check(&sim).unwrap();
        assert_eq!(pool.release(&sim, 0, &limit, 0, None), (P, None), "tried again later");
        assert_eq!((pool.held(), limit.reserved(), sim.live_vmm()), (0, 0, (0, 0)));
        let s = pool.stat();
        assert_eq!((s.allocated, s.freed, s.peak), (7 * P as i64, 7 * P as i64, 4 * P as i64));
        pool.reset_peak();
        assert_eq!(pool.stat().peak, 0);
    }

    #[test]
    fn only_smaller_handles_are_released_for_a_growth_and_only_what_it_wants() {
        let sim = SimDriver::new(1, 256 << 20);
        let limit = MemoryLimit::default();
        let pool = PagePool::default();
        let mut small: Vec<PhysHandle> = (0..4).map(|_| sim.mem_create(0, P).unwrap()).collect();
        let mut large: Vec<PhysHandle> = (0..2).map(|_| sim.mem_create(0, 4 * P).unwrap()).collect();
        limit.try_charge(12 * P).unwrap().commit();
        pool.put(P, &mut small);
        pool.put(4 * P, &mut large);
        // A growth in pages of 4 P wanting 2 P: two small handles go, the large ones stay.
        assert_eq!(pool.release_smaller(&sim, 0, &limit, 4 * P, 2 * P), (2 * P, None));
        assert_eq!((pool.held(), limit.reserved(), sim.used(0)), (10 * P, 10 * P as i64, 10 * P));
        // A growth in pages of P releases nothing: no size is smaller.
        assert_eq!(pool.release_smaller(&sim, 0, &limit, P, 8 * P), (0, None));
        // A release the driver refuses leaves that handle held and counted; the next is tried.
        sim.inject(SimOp::MemRelease, 0, SimFault::Fail(DriverError::OutOfMemory));
        let (bytes, err) = pool.release_smaller(&sim, 0, &limit, 4 * P, 8 * P);
        assert_eq!((bytes, err), (P, Some(DriverError::OutOfMemory)));
        assert_eq!((pool.held(), limit.reserved()), (9 * P, 9 * P as i64));
        pool.check(&sim).unwrap();
        assert_eq!(pool.release(&sim, 0, &limit, 0, None).0, 9 * P);
        assert_eq!(sim.live_vmm(), (0, 0));
    }

    #[test]
    fn a_growth_leaves_at_most_an_eighth_of_the_other_reserved_bytes() {
        let sim = SimDriver::new(1, 256 << 20);
        let limit = MemoryLimit::default();
        let pool = PagePool::default();
        // 16 pages mapped elsewhere, 5 held: 2 are kept.
        let mut made: Vec<PhysHandle> = (0..5).map(|_| sim.mem_create(0, P).unwrap()).collect();
        limit.try_charge(21 * P).unwrap().commit();
        pool.put(P, &mut made);
        pool.trim(&sim, 0, &limit);
        assert_eq!((pool.held(), limit.reserved()), (2 * P, 18 * P as i64));
        pool.trim(&sim, 0, &limit);
        assert_eq!(pool.held(), 2 * P, "within the bound, nothing more goes");
    }
}
