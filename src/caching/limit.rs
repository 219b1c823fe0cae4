//! The device's byte limit: PyTorch's `set_per_process_memory_fraction`, checked against the
//! device memory gpupool holds from the driver.
//!
//! Each shard counts its own segments; this keeps their sum in one atomic as well, so that a
//! new segment can be checked against the limit without locking every shard (PyTorch checks
//! `total_allocated_memory + size > allowed_memory_maximum` in `alloc_block`, under its one
//! device mutex). What it counts is physical memory: ordinary segments, the pages mapped in
//! expandable segments, and the handles the device's page pool holds unmapped (`page_pool`;
//! device memory all the same). A growth that maps a held handle charges nothing new, and a
//! page unmapped into the pool uncharges nothing until its handle is released.

use std::sync::atomic::{AtomicI64, Ordering};

/// Physical bytes of one device (reserved bytes and held pages) and the most it may hold.
#[derive(Debug)]
pub(crate) struct MemoryLimit {
    /// Bytes of every segment of the device (PyTorch `total_allocated_memory`) and of the
    /// pages its pool holds, counted before the driver is asked, so that two streams cannot
    /// both pass the limit at once.
    reserved: AtomicI64,
    /// The most bytes the device may reserve (PyTorch `allowed_memory_maximum`); `i64::MAX`
    /// when no fraction is set.
    limit: AtomicI64,
    /// The most bytes the device has held at once (reserved and held pages) since it started,
    /// its cache was last released or its peak statistics were last reset (its high-water
    /// mark). Physical memory, as the rest: unmapping a page into the pool does not lower
    /// what counts, and mapping a held handle does not raise it, so the high-water rule
    /// (`expandable::high_water`) keeps what the device holds from the driver under its mark, and
    /// a growth that maps the pages the rule unmapped passes no mark.
    mark: AtomicI64,
}

impl Default for MemoryLimit {
    fn default() -> Self {
        MemoryLimit { reserved: AtomicI64::new(0), limit: AtomicI64::new(i64::MAX), mark: AtomicI64::new(0) }
    }
}

/// Bytes counted against the limit for a segment the driver has not yet given. Dropped
/// without [`Charge::commit`] (the driver failed, or its call unwound), it gives the bytes
/// back: every exit path leaves the count right.
#[must_use]
pub(crate) struct Charge<'a> {
    limit: &'a MemoryLimit,
    size: i64,
}

impl Charge<'_> {
    /// The segment exists: its bytes stay counted until [`MemoryLimit::uncharge`].
    pub fn commit(self) {
        self.limit.raise_mark();
        std::mem::forget(self);
    }

    /// Keeps `change` bytes of the charge counted and gives the rest back: what a growth
    /// changed of the device's physical bytes (pages it mapped from new handles, less held
    /// handles it took and did not give back, which were counted already), at most the
    /// charge; negative when held handles it took became orphans of its expandable segment,
    /// which are not counted.
    pub fn settle(self, change: isize) {
        debug_assert!(change as i64 <= self.size);
        self.limit.reserved.fetch_sub(self.size - change as i64, Ordering::Relaxed);
        self.limit.raise_mark();
        std::mem::forget(self);
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        self.limit.reserved.fetch_sub(self.size, Ordering::Relaxed);
    }
}

impl MemoryLimit {
    /// Counts `size` more bytes reserved, unless that would pass the limit (PyTorch's check in
    /// `alloc_block`). `None` when it would: the caller treats that as out of memory. A `size`
    /// over `i64::MAX` (a request of 2^63 bytes or more, which no device holds) is refused, limit
    /// or not: cast, it would be a negative charge that let other growths past the limit while
    /// the driver was asked (the red team's `a_huge_growth_in_flight_lets_no_growth_past_the_
    /// memory_fraction`, tests/fallback/hostile_limits.rs).
    pub fn try_charge(&self, size: usize) -> Option<Charge<'_>> {
        let size = i64::try_from(size).ok()?;
        let limit = self.limit.load(Ordering::Relaxed);
        let before = self.reserved.fetch_add(size, Ordering::Relaxed);
        let charge = Charge { limit: self, size };
        if limit != i64::MAX && before.saturating_add(size) > limit {
            return None; // `charge` drops here and gives the bytes back.
        }
        Some(charge)
    }

    /// Counts `size` bytes no longer held (a segment or a page's handle went back to the
    /// driver).
    pub fn uncharge(&self, size: usize) {
        self.reserved.fetch_sub(size as i64, Ordering::Relaxed);
    }

    /// Sets the most bytes the device may reserve.
    pub fn set(&self, bytes: i64) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    /// The limit in bytes, or `None` when no fraction is set.
    pub fn get(&self) -> Option<i64> {
        Some(self.limit.load(Ordering::Relaxed)).filter(|&l| l != i64::MAX)
    }

    fn raise_mark(&self) {
        self.mark.fetch_max(self.reserved.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// The high-water mark starts again from the bytes reserved now (the cache was released,
    /// or the peak statistics reset: the caller asks for a new peak).
    pub fn reset_mark(&self) {
        self.mark.store(self.reserved.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// By how many bytes `size` more would take the device's physical bytes past its
    /// high-water mark (0: they stay at or below it).
    pub fn over_mark(&self, size: usize) -> usize {
        let after = self.reserved.load(Ordering::Relaxed) + size as i64;
        (after - self.mark.load(Ordering::Relaxed)).max(0) as usize
    }

    /// The physical bytes counted: reserved bytes plus held pages.
    pub fn reserved(&self) -> i64 {
        self.reserved.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_not_committed_is_given_back_even_when_unwinding() {
        let l = MemoryLimit::default();
        l.set(100);
        let r = std::panic::catch_unwind(|| {
            let _c = l.try_charge(60).unwrap();
            panic!("the driver call panicked");
        });
        assert!(r.is_err());
        assert_eq!(l.reserved(), 0);
        assert!(l.try_charge(60).is_some_and(|c| {
            c.commit();
            true
        }));
        assert!(l.try_charge(60).is_none(), "60 + 60 passes the limit of 100");
        assert_eq!(l.reserved(), 60);
    }

    #[test]
    fn the_mark_follows_committed_bytes_and_starts_again_when_reset() {
        let l = MemoryLimit::default();
        l.try_charge(100).unwrap().commit();
        assert_eq!(l.over_mark(0), 0);
        assert_eq!(l.over_mark(10), 10);
        l.uncharge(60);
        assert_eq!(l.over_mark(60), 0, "40 reserved, 60 more stays at the mark of 100");
        drop(l.try_charge(500));
        assert_eq!(l.over_mark(61), 1, "a charge given back raises nothing");
        l.try_charge(100).unwrap().settle(30);
        assert_eq!(l.over_mark(30), 0, "the part kept counts: 70 reserved");
        l.reset_mark();
        assert_eq!(l.over_mark(1), 1, "the mark is what is reserved now");
        // A growth whose held handles became orphans gives back more than it charged.
        l.try_charge(20).unwrap().settle(-10);
        assert_eq!(l.reserved(), 60);
    }
}
