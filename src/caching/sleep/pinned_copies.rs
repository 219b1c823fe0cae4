//! Pinned host copies that a pool keeps between its sleeps (`gpupool_sleep` with
//! `GPUPOOL_SLEEP_OFFLOAD_PINNED`): the host copy of each stream of the pool is ordinary
//! memory of gpupool's own (`driver::pageable`, transparent huge pages asked for), faulted in
//! by the sleep's CPU threads and page-locked with `cuMemHostRegister`, so that the copy
//! engines write and read it directly (`copy_direct`) at the bus's speed; at wake it is not
//! given back but kept here, by pool, for the pool's next sleep, which then copies with no
//! host memory to prepare.
//!
//! Why registered and not `cuMemHostAlloc`: on the H100 machine's host (2026-11-27,
//! `.device` experiment, 8 GiB) `cudaHostAlloc` pinned 3.1-3.3 GB/s, while faulting in an
//! anonymous mapping of huge pages from 16 threads ran at 35 GB/s and `cudaHostRegister` of
//! the faulted memory at 36-55 GB/s: the first sleep of a pool is several times faster.
//!
//! What it costs: the pool's live bytes (as of its last sleep) stay pinned in host memory
//! while it is awake, counted by [`Kept::bytes`] (`gpupool_sleep_kept_bytes`), until
//! `gpupool_sleep_release_kept`, `gpupool_release_pool`, or a sleep of the pool in another
//! mode gives them back. `gpupool_empty_cache` does not: engines call it around every sleep
//! (vLLM does), which would make the mode pointless. Not in PyTorch; vLLM's sleep mode gets the
//! same effect from PyTorch's caching host allocator, which keeps the pinned CPU backup of the
//! first sleep cached for the next.

use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};

use super::copy_threads::Crew;
use super::staging::quietly;
use crate::driver::{Driver, DriverError, HostPtr};

/// One pinned host copy: `size` bytes at `ptr`, mapped by `host_map` and registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pinned {
    pub ptr: HostPtr,
    pub size: usize,
}

/// How many times a stream's live bytes a kept copy may be to serve it: the pinned bytes a
/// pool keeps stay within this many times its live bytes as of its last sleep.
pub(crate) const SLACK: usize = 2;

/// A device's kept copies, by pool (0: the default pools). A leaf of the lock order: its lock
/// is never held across a driver call or another lock.
#[derive(Default)]
pub(crate) struct Kept {
    pools: Mutex<Store>,
}

#[derive(Default)]
struct Store {
    copies: FxHashMap<u64, Vec<Pinned>>,
    /// Released pools ([`Kept::close`]): a copy given to one afterwards (the wake or failed
    /// sleep of a pool released meanwhile) is handed back to be unpinned, not kept forever.
    closed: FxHashSet<u64>,
}

impl Kept {
    /// The smallest copy `pool` keeps of at least `need` bytes and at most [`SLACK`] times
    /// `need`, taken out of the store. A larger one is left for a stream that needs it (the
    /// sleep gives back those it did not use): taken by a small stream, it would make a
    /// large stream pin anew, and the kept bytes grow with the streams, not the live bytes.
    pub fn take(&self, pool: u64, need: usize) -> Option<Pinned> {
        let mut pools = self.pools.lock();
        let list = pools.copies.get_mut(&pool)?;
        let fits = |c: &Pinned| c.size >= need && c.size / SLACK <= need;
        let (i, _) = list.iter().enumerate().filter(|(_, c)| fits(c)).min_by_key(|(_, c)| c.size)?;
        Some(list.swap_remove(i))
    }

    /// Gives `copy` to `pool` to keep; returns it when `pool` was released ([`Kept::close`]),
    /// for the caller to [`unpin`].
    #[must_use]
    pub fn put(&self, pool: u64, copy: Pinned) -> Option<Pinned> {
        let mut pools = self.pools.lock();
        if pools.closed.contains(&pool) {
            return Some(copy);
        }
        pools.copies.entry(pool).or_default().push(copy);
        None
    }

    /// Every copy `pool` keeps, taken out of the store (for the caller to [`unpin`]).
    pub fn drain(&self, pool: u64) -> Vec<Pinned> {
        self.pools.lock().copies.remove(&pool).unwrap_or_default()
    }

    /// As [`Kept::drain`], and `pool` (a private pool, released) keeps nothing from now on.
    pub fn close(&self, pool: u64) -> Vec<Pinned> {
        let mut pools = self.pools.lock();
        pools.closed.insert(pool);
        pools.copies.remove(&pool).unwrap_or_default()
    }

    /// Every kept copy with its pool, for the consistency check.
    pub fn all(&self) -> Vec<(u64, Pinned)> {
        let pools = self.pools.lock();
        pools.copies.iter().flat_map(|(&p, l)| l.iter().map(move |&c| (p, c))).collect()
    }

    /// Whether `pool` was closed ([`Kept::close`]).
    pub fn closed(&self, pool: u64) -> bool {
        self.pools.lock().closed.contains(&pool)
    }

    /// Bytes kept for `pool`, or for every pool of the device with `None`; a copy in use by
    /// a sleeping pool is not in the store, and not counted.
    pub fn bytes(&self, pool: Option<u64>) -> usize {
        let pools = self.pools.lock();
        let sum = |l: &Vec<Pinned>| l.iter().map(|c| c.size).sum::<usize>();
        match pool {
            Some(p) => pools.copies.get(&p).map_or(0, sum),
            None => pools.copies.values().map(sum).sum(),
        }
    }
}

/// Bytes of host memory between two writes that fault pages in: the smallest page.
const PAGE: usize = 4096;

/// A new pinned copy of `size` bytes (more than 0): mapped (huge pages asked for with
/// `huge_pages`), every page faulted in by `crew`'s threads (the kernel zeroes it: in
/// parallel here, not in the driver's one thread), then registered for `device`.
///
/// Errors: [`DriverError::OutOfMemory`] when the system will not map it, the driver's when it
/// will not register it; nothing is left mapped, a driver call that unwinds included.
pub(crate) fn pin(
    driver: &dyn Driver,
    device: i32,
    size: usize,
    huge_pages: bool,
    crew: &Crew,
) -> Result<Pinned, DriverError> {
    let ptr = driver.host_map(size, huge_pages)?;
    // Unmapped again if registering fails or unwinds.
    let mapped = scopeguard::guard(ptr, |ptr| {
        let _ = quietly(|| driver.host_unmap(ptr, size));
    });
    let touch: Vec<(usize, usize)> = {
        let threads = crew.threads().max(1);
        let each = size.div_ceil(threads).next_multiple_of(PAGE);
        (0..size).step_by(each.max(PAGE)).map(|at| (ptr + at, each.min(size - at))).collect()
    };
    // SAFETY: the ranges tile the mapping just made, which nothing else knows of yet.
    unsafe { crew.each(&touch, fault_in) };
    driver.host_register(device, ptr, size)?;
    Ok(Pinned { ptr: scopeguard::ScopeGuard::into_inner(mapped), size })
}

/// Writes a zero to every page of `[at, at + len)` of fresh anonymous memory (which reads as
/// zero), so that the kernel faults it in now.
fn fault_in(at: usize, len: usize) {
    for p in (at..at + len).step_by(PAGE) {
        // SAFETY: per `pin`, `p` is inside a writable mapping of ours; a volatile write so that
        // the store of a zero over a zero is not elided.
        unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
    }
}

/// Gives a copy from [`pin`] back: unregistered, then unmapped. The caller has made sure no
/// copy uses it. Returns whether the driver unregistered it: a failure, or a call that
/// unwinds, leaks it (still pinned, or mapped). Never panics.
pub(crate) fn unpin(driver: &dyn Driver, device: i32, copy: Pinned) -> bool {
    if quietly(|| driver.host_unregister(device, copy.ptr)).is_none() {
        return false;
    }
    let _ = quietly(|| driver.host_unmap(copy.ptr, copy.size));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_gives_the_smallest_copy_that_fits_and_counts_what_stays() {
        let k = Kept::default();
        assert!(k.put(7, Pinned { ptr: 0x1000, size: 100 }).is_none());
        assert!(k.put(7, Pinned { ptr: 0x2000, size: 50 }).is_none());
        assert!(k.put(8, Pinned { ptr: 0x3000, size: 10 }).is_none());
        assert_eq!(k.bytes(None), 160);
        assert_eq!(k.take(7, 40), Some(Pinned { ptr: 0x2000, size: 50 }));
        assert_eq!(k.take(7, 49), None, "100 bytes are more than twice 49");
        assert_eq!(k.take(7, 101), None);
        assert_eq!(k.bytes(Some(7)), 100);
        assert_eq!(k.drain(7), vec![Pinned { ptr: 0x1000, size: 100 }]);
        assert_eq!(k.bytes(Some(7)), 0);
        assert_eq!(k.take(9, 0), None);
        assert_eq!(k.put(7, Pinned { ptr: 0x4000, size: 8 }), None);
        assert_eq!(k.close(7), vec![Pinned { ptr: 0x4000, size: 8 }]);
        let late = Pinned { ptr: 0x5000, size: 8 };
        assert_eq!(k.put(7, late), Some(late), "a released pool keeps nothing");
        assert_eq!(k.all(), vec![(8, Pinned { ptr: 0x3000, size: 10 })]);
    }
}
