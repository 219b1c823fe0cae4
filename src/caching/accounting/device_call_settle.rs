//! The settle at the end of a call that ran past its peak credit and could not borrow (see
//! `accounting::peaks`): the steps of `peaks::settle_steps` run one shard at a time, each
//! shard locked alone for the few hundred instructions its visit takes, so that no stream
//! waits for every other, as streams did while a settle held every shard's lock at once.
//! `stats()`, `reset_peak_stats()` and `empty_cache` still settle over every shard locked at
//! once (`device.rs`): they read one consistent snapshot, as PyTorch does under its device
//! lock.

use std::sync::Arc;

use parking_lot::Mutex;

use super::counters::bump;
use super::peaks::Settle;
use crate::caching::device::{DeviceAllocator, PeakState};
use crate::caching::shard::ShardState;

impl DeviceAllocator {
    /// Settles the peaks for a call on the shard `own` (its lock dropped) whose credit and the
    /// spare credit could not cover it, before the call returns. Holds the device's peak lock
    /// throughout, and each shard's lock only while it visits it.
    ///
    /// A settle that ran while this one waited for the peak lock and visited `own` after its
    /// call ran short (or a borrow by another call on the same stream) covered it already:
    /// then nothing is settled (under contention, settles queued behind one another mostly
    /// are).
    pub(super) fn settle_for(&self, own: &Mutex<ShardState>) {
        let mut ps = self.peaks.lock();
        if !own.lock().counters.needs_settle {
            return;
        }
        bump(&self.counters.num_peak_settles);
        let PeakState { totals, holders, visit, holds } = &mut *ps;
        self.shards.take_dirty(visit);
        visit.append(holders);
        visit.sort_unstable_by_key(|s| Arc::as_ptr(s) as usize);
        visit.dedup_by(|a, b| Arc::ptr_eq(a, b));
        holds.clear();
        let mut settle = Settle::new(totals);
        // The front caches stay as they are (`lock_hot`): no statistic counts them apart from
        // the merged pools, and merging them would cost every visited stream its next hits.
        for shard in visit.iter() {
            holds.push(settle.visit(totals, &mut shard.lock_hot().counters));
        }
        settle.raise(totals);
        if settle.pay_from_spare(&self.spare) {
            for (shard, h) in visit.iter().zip(holds.iter_mut()).rev() {
                if *h {
                    *h = settle.cover(totals, &mut shard.lock_hot().counters);
                    if !settle.owes() {
                        break;
                    }
                }
            }
        }
        settle.end(&self.spare);
        for (shard, &h) in visit.drain(..).zip(holds.iter()) {
            if h {
                holders.push(shard);
            }
        }
    }
}
