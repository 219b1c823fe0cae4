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

use super::charge::{self, LimitedCount};

/// Physical bytes of one device (reserved bytes and held pages) and the most it may hold.
#[derive(Debug, Default)]
pub(crate) struct MemoryLimit {
    /// Bytes of every segment of the device (PyTorch `total_allocated_memory`) and of the
    /// pages its pool holds, counted before the driver is asked, so that two streams cannot
    /// both pass the limit at once; its limit is PyTorch's `allowed_memory_maximum` (none
    /// when no fraction is set). The count and its charge are `caching::charge`'s, as a
    /// pool's budget's are.
    count: LimitedCount,
    /// The most bytes the device has held at once (reserved and held pages) since it started,
    /// its cache was last released or its peak statistics were last reset (its high-water
    /// mark). Physical memory, as the rest: unmapping a page into the pool does not lower
    /// what counts, and mapping a held handle does not raise it, so the high-water rule
    /// (`expandable::high_water`) keeps what the device holds from the driver under its mark, and
    /// a growth that maps the pages the rule unmapped passes no mark.
    mark: AtomicI64,
}

/// Bytes counted against the limit for a segment the driver has not yet given
/// (`charge::Charge`, which gives them back when dropped), and the device's high-water mark
/// raised when they are kept.
#[must_use]
pub(crate) struct Charge<'a> {
    limit: &'a MemoryLimit,
    bytes: charge::Charge<'a>,
}

impl Charge<'_> {
    /// The segment exists: its bytes stay counted until [`MemoryLimit::uncharge`].
    pub fn commit(self) {
        self.bytes.commit();
        self.limit.raise_mark();
    }

    /// Keeps `change` bytes of the charge counted and gives the rest back: what a growth
    /// changed of the device's physical bytes (pages it mapped from new handles, less held
    /// handles it took and did not give back, which were counted already), at most the
    /// charge; negative when held handles it took became orphans of its expandable segment,
    /// which are not counted.
    pub fn settle(self, change: isize) {
        self.bytes.settle(change);
        self.limit.raise_mark();
    }
}

impl MemoryLimit {
    /// Counts `size` more bytes reserved, unless that would pass the limit (PyTorch's check in
    /// `alloc_block`). `None` when it would: the caller treats that as out of memory. A `size`
    /// over `i64::MAX` is refused, limit or not (`LimitedCount::try_charge` says why).
    pub fn try_charge(&self, size: usize) -> Option<Charge<'_>> {
        self.count.try_charge(size).map(|bytes| Charge { limit: self, bytes })
    }

    /// Counts `size` bytes no longer held (a segment or a page's handle went back to the
    /// driver).
    pub fn uncharge(&self, size: usize) {
        self.count.uncharge(size);
    }

    /// Sets the most bytes the device may reserve; `i64::MAX`: no limit.
    pub fn set(&self, bytes: i64) {
        self.count.set_limit(Some(bytes));
    }

    /// The limit in bytes, or `None` when no fraction is set.
    pub fn get(&self) -> Option<i64> {
        self.count.limit()
    }

    fn raise_mark(&self) {
        self.mark.fetch_max(self.count.counted(), Ordering::Relaxed);
    }

    /// The high-water mark starts again from the bytes reserved now (the cache was released,
    /// or the peak statistics reset: the caller asks for a new peak).
    pub fn reset_mark(&self) {
        self.mark.store(self.count.counted(), Ordering::Relaxed);
    }

    /// By how many bytes `size` more would take the device's physical bytes past its
    /// high-water mark (0: they stay at or below it).
    pub fn over_mark(&self, size: usize) -> usize {
        let after = self.count.counted() + size as i64;
        (after - self.mark.load(Ordering::Relaxed)).max(0) as usize
    }

    /// The physical bytes counted: reserved bytes plus held pages.
    pub fn reserved(&self) -> i64 {
        self.count.counted()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
