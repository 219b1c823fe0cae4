//! Exact device peaks without a shared write on the hot path.
//!
//! PyTorch keeps one `DeviceStats` per device under the device's one mutex, so every call of
//! every stream serialises on it. gpupool gives each stream a shard with its own lock and
//! keeps the device peak `P` of each statistic exact with *headroom*: each shard `j` holds
//! credit `h_j >= 0`, and the invariant is
//!
//! ```text
//!     P = G + sum(h_j)        (G: the device's current value, the sum over shards)
//! ```
//!
//! A free of `n` on shard `j` lowers `G` by `n` and raises `h_j` by `n`; an allocation spends
//! the shard's own credit. Only when a shard's credit runs out (`h_j < 0`, so `G` may be above
//! `P`) does the call that did it settle the device: with every shard of the device locked it
//! recounts `G`, sets `P` to the highest value `G` reached, and deals the remaining credit
//! `P - G` back out. In a steady state (each stream reusing what it freed) no call settles.
//!
//! A call may raise a value and lower it again before it settles (a malloc whose pending
//! events return a split block to the pool, `inactive_split` + 1, and which then takes that
//! block, - 1). PyTorch's peak counts that moment, so each cell also keeps `low`, the lowest
//! headroom since the last settle: the shard's value was then `h - low` above what it is now,
//! and the settle takes `G + max(h_j - low_j)` as the highest value reached.
//!
//! Exactness: every history of calls that do not overlap in time gets PyTorch's peak exactly,
//! because the settle runs before the call returns. When calls on different streams of one
//! device overlap, the linear order is not defined to begin with; the peak is then exact up to
//! the bytes that other streams moved while a settle was waiting for their locks.

use super::{CELLS, ShardCounters};

/// Settles every cell: raises each peak to the recounted current value where that is higher,
/// then deals the credit left back to the shards that held some. `shards` must be every shard
/// of the device, locked.
pub(crate) fn settle(peaks: &mut [i64; CELLS], shards: &mut [&mut ShardCounters]) {
    for (cell, peak) in peaks.iter_mut().enumerate() {
        let current: i64 = shards.iter().map(|s| s.cells[cell].current).sum();
        debug_assert_eq!(
            *peak,
            current + shards.iter().map(|s| s.cells[cell].headroom).sum::<i64>(),
            "peak credit invariant broken for cell {cell}"
        );
        // Only a shard that went past its credit can have taken G above P; calls settle before
        // they return, so while it did, no other shard moved.
        let excursion =
            shards.iter().map(|s| &s.cells[cell]).filter(|c| c.low < 0).map(|c| c.headroom - c.low).max().unwrap_or(0);
        *peak = (*peak).max(current + excursion);
        let mut credit = *peak - current;
        for s in shards.iter_mut() {
            let c = &mut s.cells[cell];
            let keep = c.headroom.clamp(0, credit);
            c.headroom = keep;
            credit -= keep;
        }
        // Credit the shards did not hold (the peak rose above the current value) goes to the
        // first shard, so that P = G + sum(h) holds again.
        if let Some(first) = shards.first_mut() {
            first.cells[cell].headroom += credit;
            credit = 0;
        }
        for s in shards.iter_mut() {
            s.cells[cell].low = s.cells[cell].headroom;
        }
        debug_assert_eq!(credit, 0, "credit left undealt for cell {cell}");
    }
    for s in shards.iter_mut() {
        s.needs_settle = false;
    }
}

/// PyTorch `reset_peak_stats`: every peak becomes the current value, and no shard holds credit.
pub(crate) fn reset(peaks: &mut [i64; CELLS], shards: &mut [&mut ShardCounters]) {
    for (cell, peak) in peaks.iter_mut().enumerate() {
        *peak = shards.iter().map(|s| s.cells[cell].current).sum();
        for s in shards.iter_mut() {
            s.cells[cell].headroom = 0;
            s.cells[cell].low = 0;
        }
    }
    for s in shards.iter_mut() {
        s.needs_settle = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::rules::PoolKind;
    use crate::stats::Metric;

    fn peak_of(peaks: &[i64; CELLS]) -> i64 {
        peaks[Metric::AllocatedBytes as usize * 3]
    }

    #[test]
    fn moving_bytes_between_shards_does_not_raise_the_peak() {
        let mut peaks = [0; CELLS];
        let (mut a, mut b) = (ShardCounters::default(), ShardCounters::default());
        a.increase(Metric::AllocatedBytes, PoolKind::Large, 100);
        assert!(a.needs_settle);
        settle(&mut peaks, &mut [&mut a, &mut b]);
        assert_eq!(peak_of(&peaks), 100);
        a.decrease(Metric::AllocatedBytes, PoolKind::Large, 100);
        b.increase(Metric::AllocatedBytes, PoolKind::Large, 100);
        assert!(b.needs_settle);
        settle(&mut peaks, &mut [&mut a, &mut b]);
        assert_eq!(peak_of(&peaks), 100);
        b.increase(Metric::AllocatedBytes, PoolKind::Large, 1);
        settle(&mut peaks, &mut [&mut a, &mut b]);
        assert_eq!(peak_of(&peaks), 101);
    }

    #[test]
    fn a_rise_and_fall_within_one_call_is_a_peak() {
        let mut peaks = [0; CELLS];
        let mut a = ShardCounters::default();
        a.increase(Metric::InactiveSplit, PoolKind::Small, 1);
        a.decrease(Metric::InactiveSplit, PoolKind::Small, 1);
        settle(&mut peaks, &mut [&mut a]);
        assert_eq!(peaks[Metric::InactiveSplit as usize * 3], 1);
        assert_eq!(peaks[Metric::InactiveSplit as usize * 3 + 1], 1);
    }

    #[test]
    fn reusing_own_credit_needs_no_settle() {
        let mut peaks = [0; CELLS];
        let mut a = ShardCounters::default();
        a.increase(Metric::AllocatedBytes, PoolKind::Small, 512);
        settle(&mut peaks, &mut [&mut a]);
        for _ in 0..10 {
            a.decrease(Metric::AllocatedBytes, PoolKind::Small, 512);
            a.increase(Metric::AllocatedBytes, PoolKind::Small, 512);
            assert!(!a.needs_settle);
        }
        reset(&mut peaks, &mut [&mut a]);
        assert_eq!(peak_of(&peaks), 512);
    }
}
