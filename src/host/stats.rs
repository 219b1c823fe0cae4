//! The counters of PyTorch 2.11's `HostStats` (`torch.cuda.host_memory_stats()`), as the
//! caching host allocator reports them, and their reading and peak reset (PyTorch `getStats`,
//! `resetPeakStats`).

use super::HostAllocator;
use crate::stats::Stat;

/// A duration statistic in microseconds (PyTorch `DurationStat`): how many times, their sum,
/// the longest and the shortest (0 until the first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DurationStat {
    pub count: i64,
    pub total: i64,
    pub max: i64,
    pub min: i64,
}

impl DurationStat {
    /// One more duration of `us` microseconds (PyTorch `DurationStat::increase`).
    pub(crate) fn add(&mut self, us: i64) {
        self.count += 1;
        self.total += us;
        self.max = self.max.max(us);
        self.min = if self.count == 1 { us } else { self.min.min(us) };
    }
}

/// The pinned host memory statistics (PyTorch 2.11 `at::HostStats`, the keys of
/// `torch.cuda.host_memory_stats()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Blocks handed out, or freed and waiting for their events or for a device
    /// synchronisation (PyTorch `active_requests`).
    pub active_requests: Stat,
    /// Bytes of those blocks (rounded sizes; PyTorch `active_bytes`).
    pub active_bytes: Stat,
    /// Blocks gpupool holds, in use or cached (PyTorch `allocations`).
    pub allocations: Stat,
    /// Bytes of those blocks (PyTorch `allocated_bytes`): what gpupool holds pinned, the
    /// reserve segment's blocks included.
    pub allocated_bytes: Stat,
    /// Time in `cuMemHostAlloc`, or in touching the pages and `cuMemHostRegister`, per call,
    /// in microseconds (PyTorch `host_alloc_time`).
    pub host_alloc_time: DurationStat,
    /// Time in `cuMemFreeHost`, or `cuMemHostUnregister` and `free`, per call, in microseconds
    /// (PyTorch `host_free_time`).
    pub host_free_time: DurationStat,
    /// `cuMemHostAlloc`/`cuMemHostRegister` calls made because no cached block fitted (PyTorch
    /// `num_host_alloc`), the reserve segment's own included.
    pub num_host_alloc: i64,
    /// `cuMemFreeHost`/`cuMemHostUnregister` calls (PyTorch `num_host_free`).
    pub num_host_free: i64,
}

/// `Stat` with PyTorch's updates (`Stat::increase`, `decrease`, `reset_peak`).
pub(crate) trait StatExt {
    fn increase(&mut self, n: i64);
    fn decrease(&mut self, n: i64);
    fn reset_peak(&mut self);
    /// Adds `other` into `self`, peaks summed: an upper bound of the peak of the sum (PyTorch
    /// sums its per-bucket peaks the same way in `getStats`).
    fn merge(&mut self, other: &Stat);
}

impl StatExt for Stat {
    fn increase(&mut self, n: i64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    fn decrease(&mut self, n: i64) {
        self.current -= n;
        self.freed += n;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn merge(&mut self, other: &Stat) {
        self.current += other.current;
        self.peak += other.peak;
        self.allocated += other.allocated;
        self.freed += other.freed;
    }
}

/// A statistic of one stripe (`active_requests` or `active_bytes`), kept so that the hit path
/// updates it in a few instructions: what was added and taken away since the start, and how far
/// the peak is above the current value. PyTorch's `Stat` (current, peak, allocated, freed)
/// follows at reading ([`StripeStat::stat`]), exactly: its `increase` sets
/// `peak = max(peak, current + n)`, so the distance becomes `max(distance - n, 0)`; its
/// `decrease` leaves the peak, so the distance grows by `n`; `reset_peak` makes it 0. Kept as
/// PyTorch's four fields, a malloc and a free cost 26 instructions; this way about 15
/// (callgrind, `tests/c/hit_loop.c host`, 2026-11-27).
///
/// Laid out so that no two fields that a free adds to are side by side, in one statistic or
/// between two: the compiler joined such adds into vector operations of more instructions
/// (9 instead of 5 for the free's two statistics).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub(super) struct StripeStat {
    freed: i64,
    allocated: i64,
    /// The peak less the current value.
    below_peak: u64,
}

impl StripeStat {
    /// PyTorch `Stat::increase`.
    #[inline(always)]
    pub(super) fn increase(&mut self, n: i64) {
        debug_assert!(n >= 0);
        self.allocated += n;
        self.below_peak = self.below_peak.saturating_sub(n as u64);
    }

    /// PyTorch `Stat::decrease`.
    #[inline(always)]
    pub(super) fn decrease(&mut self, n: i64) {
        debug_assert!(n >= 0);
        self.freed += n;
        self.below_peak += n as u64;
    }

    /// PyTorch `Stat::reset_peak`.
    pub(super) fn reset_peak(&mut self) {
        self.below_peak = 0;
    }

    /// The current value.
    pub(super) fn current(&self) -> i64 {
        self.allocated - self.freed
    }

    /// As PyTorch's `Stat`.
    pub(super) fn stat(&self) -> Stat {
        let current = self.current();
        Stat { current, peak: current + self.below_peak as i64, allocated: self.allocated, freed: self.freed }
    }
}

impl HostAllocator {
    /// The statistics (PyTorch `getStats`, `torch.cuda.host_memory_stats()`). The peaks of
    /// `active_requests` and `active_bytes` are the sums of the stripes' peaks: exact while one
    /// thread allocates, an upper bound of the true peak with several (PyTorch sums its
    /// per-size peaks the same way). Thread-safe: it holds every stripe's lock, then the slow
    /// path's, for the copy (the lock order of [`HostAllocator::check_invariants`]), so that
    /// the figures are of one moment, as PyTorch's one mutex gives them. Read one stripe at a
    /// time, a block freed on a stripe already read and taken by a stripe not yet read counted
    /// twice, and `active_requests` could pass `allocations` (seen in the threaded test under
    /// AddressSanitizer).
    pub fn stats(&self) -> HostStats {
        let inner = &*self.inner;
        let mut out = HostStats::default();
        let stripes: Vec<_> = inner.stripes.iter().map(|s| s.0.lock()).collect();
        for st in &stripes {
            out.active_requests.merge(&st.active_requests.stat());
            out.active_bytes.merge(&st.active_bytes.stat());
        }
        let slow = inner.slow.lock();
        out.allocations = slow.allocations;
        out.allocated_bytes = slow.allocated_bytes;
        out.host_alloc_time = slow.host_alloc_time;
        out.host_free_time = slow.host_free_time;
        out.num_host_alloc = slow.num_host_alloc;
        out.num_host_free = slow.num_host_free;
        out
    }

    /// Sets every peak to its current value (PyTorch `resetPeakStats` of the host allocator);
    /// the durations' longest and shortest are cleared, as PyTorch's `DurationStat::reset_peak`.
    pub fn reset_peak_stats(&self) {
        let inner = &*self.inner;
        for stripe in inner.stripes.iter() {
            let mut st = stripe.0.lock();
            st.active_requests.reset_peak();
            st.active_bytes.reset_peak();
        }
        let mut slow = inner.slow.lock();
        let slow = &mut *slow;
        slow.allocations.reset_peak();
        slow.allocated_bytes.reset_peak();
        for d in [&mut slow.host_alloc_time, &mut slow.host_free_time] {
            d.max = 0;
            d.min = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A stripe's statistic reads as PyTorch's `Stat` updated call by call: increases,
        /// decreases (never below zero, as a free follows its malloc) and peak resets in any
        /// order.
        #[test]
        fn stripe_stat_is_pytorch_stat(ops in proptest::collection::vec((0u8..3, 0i64..1 << 40), 0..200)) {
            let (mut lazy, mut eager) = (StripeStat::default(), Stat::default());
            for (op, n) in ops {
                match op {
                    0 => {
                        lazy.increase(n);
                        eager.increase(n);
                    }
                    1 => {
                        let n = n.min(eager.current);
                        lazy.decrease(n);
                        eager.decrease(n);
                    }
                    _ => {
                        lazy.reset_peak();
                        eager.reset_peak();
                    }
                }
                prop_assert_eq!(lazy.stat(), eager);
            }
        }
    }
}
