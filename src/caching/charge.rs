//! A count of bytes charged against a limit before the driver is asked: the one mechanism
//! behind the device's memory fraction (`caching::limit`, PyTorch's
//! `set_per_process_memory_fraction`) and a pool's budget (`caching::budget`,
//! `gpupool_pool_set_limit`).
//!
//! PyTorch checks `total_allocated_memory + size > allowed_memory_maximum` in `alloc_block`
//! under its one device mutex. gpupool's shards grow without a device lock, so the bytes are
//! counted first ([`LimitedCount::try_charge`], one `fetch_add`) and then checked: two
//! growths cannot both pass the limit, each sees the other's charge. The charge is a guard
//! ([`Charge`]): committed when the memory exists, settled to what a growth really changed, and
//! given back when dropped otherwise (the driver failed, or its call unwound), so every exit
//! path leaves the count right.

use std::sync::atomic::{AtomicI64, Ordering};

/// Bytes counted, and the most that may be counted; `i64::MAX`: no limit.
#[derive(Debug)]
pub(crate) struct LimitedCount {
    counted: AtomicI64,
    limit: AtomicI64,
}

impl Default for LimitedCount {
    fn default() -> Self {
        LimitedCount { counted: AtomicI64::new(0), limit: AtomicI64::new(i64::MAX) }
    }
}

/// Bytes counted for memory the driver has not given yet. Dropped without [`Charge::commit`]
/// or [`Charge::settle`], it gives the bytes back.
#[must_use]
pub(crate) struct Charge<'a> {
    count: &'a LimitedCount,
    size: i64,
}

impl Charge<'_> {
    /// The memory exists: its bytes stay counted until [`LimitedCount::uncharge`].
    pub fn commit(self) {
        std::mem::forget(self);
    }

    /// Keeps `change` bytes of the charge (what the growth changed, at most the charge;
    /// negative when it also gave back bytes counted before) and gives the rest back.
    pub fn settle(self, change: isize) {
        debug_assert!(change as i64 <= self.size);
        self.count.counted.fetch_sub(self.size - change as i64, Ordering::Relaxed);
        std::mem::forget(self);
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        self.count.counted.fetch_sub(self.size, Ordering::Relaxed);
    }
}

impl LimitedCount {
    /// Counts `size` more bytes unless that takes the count past the limit: `None` then, and
    /// nothing stays counted. A `size` over `i64::MAX` (2^63 bytes or more, which no device
    /// holds) is refused, limit or not: cast, it would be a negative charge that let other
    /// growths past the limit while the driver was asked (the red team's
    /// `a_huge_growth_in_flight_lets_no_growth_past_the_memory_fraction`,
    /// tests/fallback/hostile_limits.rs).
    pub fn try_charge(&self, size: usize) -> Option<Charge<'_>> {
        let size = i64::try_from(size).ok()?;
        let limit = self.limit.load(Ordering::Relaxed);
        let before = self.counted.fetch_add(size, Ordering::Relaxed);
        let charge = Charge { count: self, size };
        if limit != i64::MAX && before.saturating_add(size) > limit {
            return None; // `charge` drops here and gives the bytes back.
        }
        Some(charge)
    }

    /// Counts `size` bytes no longer held (a segment or a page's handle went back to the
    /// driver).
    pub fn uncharge(&self, size: usize) {
        self.counted.fetch_sub(size as i64, Ordering::Relaxed);
    }

    /// Counts a change made without a charge (pages unmapped: negative).
    pub fn adjust(&self, change: isize) {
        self.counted.fetch_add(change as i64, Ordering::Relaxed);
    }

    /// Sets the limit in bytes; `None`: no limit.
    pub fn set_limit(&self, bytes: Option<i64>) {
        self.limit.store(bytes.unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    /// The limit in bytes, or `None` when none is set.
    pub fn limit(&self) -> Option<i64> {
        Some(self.limit.load(Ordering::Relaxed)).filter(|&l| l != i64::MAX)
    }

    /// The bytes counted, charges in flight included.
    pub fn counted(&self) -> i64 {
        self.counted.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_not_committed_is_given_back_even_when_unwinding() {
        let l = LimitedCount::default();
        l.set_limit(Some(100));
        let r = std::panic::catch_unwind(|| {
            let _c = l.try_charge(60).unwrap();
            panic!("the driver call panicked");
        });
        assert!(r.is_err());
        assert_eq!(l.counted(), 0);
        l.try_charge(60).unwrap().commit();
        assert!(l.try_charge(60).is_none(), "60 + 60 passes the limit of 100");
        assert_eq!(l.counted(), 60);
        l.try_charge(40).unwrap().settle(10);
        assert_eq!(l.counted(), 70, "a settled charge keeps what it changed");
    }

    #[test]
    fn a_charge_past_i64_max_is_refused_limit_or_not_and_counts_nothing() {
        let l = LimitedCount::default();
        assert!(l.try_charge(i64::MAX as usize + 1).is_none());
        assert!(l.try_charge(usize::MAX).is_none());
        l.set_limit(Some(10 << 20));
        assert!(l.try_charge(usize::MAX).is_none());
        assert_eq!(l.counted(), 0);
        assert!(l.try_charge(10 << 20).is_some(), "the limit itself passes");
    }

    #[test]
    fn no_limit_reads_back_as_none_and_i64_max_is_no_limit() {
        let l = LimitedCount::default();
        assert_eq!(l.limit(), None);
        l.set_limit(Some(5));
        assert_eq!(l.limit(), Some(5));
        l.set_limit(Some(i64::MAX));
        assert_eq!(l.limit(), None);
        l.adjust(-3);
        assert_eq!(l.counted(), -3);
    }
}
