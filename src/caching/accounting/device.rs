//! The device's part of the statistics: the end of every call on a shard, which keeps the
//! peak credit (see `accounting::peaks`), the settles of reads, which visit the shards all
//! locked at once, PyTorch `getStats` and `resetPeakStats`, and gpupool's diagnostics. A
//! call's own settle, one shard locked at a time, is `device_call_settle.rs`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::MutexGuard;

use super::counters::{self, ShardCounters};
use super::peaks::{self, Totals};
use crate::caching::device::{DeviceAllocator, PeakState};
use crate::caching::shard::ShardState;
use crate::stats::DeviceStats;

impl DeviceAllocator {
    /// Size bins in the pools of every shard (host memory, for tests).
    pub fn pool_bins(&self) -> usize {
        self.shards.all().iter().map(|s| s.lock().bin_count()).sum()
    }

    /// Shards in the device's table: streams that hold memory or were used since the last
    /// `empty_cache` (a diagnostic).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Ends a call on a shard the calling thread uses repeatedly (or a slow path).
    #[inline(always)]
    pub(in crate::caching) fn finish<T>(&self, st: MutexGuard<'_, ShardState>, value: T) -> T {
        self.finish_call(st, value, true)
    }

    /// Ends a call on a shard: gives surplus credit back to the spare credit, covers a
    /// shortfall from it, unlocks, and settles the device peaks only if the spare credit could
    /// not cover. A shard that is not `hot` for the calling thread keeps no credit past the
    /// call (see `peaks`).
    ///
    /// Inlined, with its rare work out of line ([`DeviceAllocator::finish_slow`]): a call to
    /// it cost the hit path about 35 instructions a pair (callgrind, `tests/c/hit_loop.c`).
    /// The end of a call on a stream that is not hot is inlined too, into the malloc that
    /// missed the thread's cache (the only caller that passes `hot` false but the private
    /// pools' allocations): a call cost it about 20 instructions (callgrind,
    /// `examples/stream_rotation.rs`).
    #[inline(always)]
    pub(in crate::caching) fn finish_call<T>(&self, st: MutexGuard<'_, ShardState>, value: T, hot: bool) -> T {
        if !hot {
            self.finish_body(st, false);
        } else if st.counters.settle_or_surplus() {
            self.finish_slow(st);
        } else {
            drop(st);
        }
        value
    }

    /// The work of [`DeviceAllocator::finish_call`] that a hot stream's call within its credit
    /// does not need.
    #[cold]
    #[inline(never)]
    fn finish_slow(&self, st: MutexGuard<'_, ShardState>) {
        self.finish_body(st, true);
    }

    /// The work of [`DeviceAllocator::finish_call`] past its first test.
    #[inline(always)]
    fn finish_body(&self, mut st: MutexGuard<'_, ShardState>, hot: bool) {
        let grown = crate::callout::take_block();
        let c = &mut st.counters;
        if c.has_surplus && hot {
            peaks::give_back(c, &self.spare, false);
        }
        // Segment events queued under the lock flag a settle (`ShardState::observe_later`),
        // and are delivered with the lock dropped for it: the hit path, which makes no
        // segment, pays no look at the queue.
        let settle = if !hot && st.segment_events.is_empty() {
            // Before the settle, which this shard may not be visited by (another settle may
            // have taken the dirty list it is on, and visited it, while it waited): a change
            // after that would go unseen by the next settle.
            !peaks::return_all(&mut st.counters, &self.spare)
        } else {
            let settle = st.counters.needs_settle
                && (!st.segment_events.is_empty()
                    || !peaks::borrow(&mut st.counters, &self.spare, self.shards.count()));
            if !hot {
                peaks::give_back(&mut st.counters, &self.spare, true);
            }
            settle
        };
        if settle {
            // Unlocked first: the settle locks each shard it visits, this one included.
            let observed = std::mem::take(&mut st.segment_events);
            let own = MutexGuard::mutex(&st);
            drop(st);
            self.segment_observers.deliver(&observed);
            self.settle_for(own);
        } else {
            drop(st);
        }
        // The call is complete, its lock released: a thread an observer (or a callout before)
        // ended ends now.
        if crate::callout::exiting() {
            self.end_exiting_call(grown);
        }
    }

    /// Runs `f` with the peak lock held and the shards a settle must visit locked (those on
    /// the dirty list and those holding credit; see `peaks::settle`); `f` sets, per shard,
    /// whether it holds credit afterwards.
    fn visit<R>(&self, f: impl FnOnce(&mut Totals, &mut [&mut ShardCounters], &mut Vec<bool>) -> R) -> R {
        let mut ps = self.peaks.lock();
        self.visit_locked(&mut ps, f)
    }

    fn visit_locked<R>(
        &self,
        ps: &mut PeakState,
        f: impl FnOnce(&mut Totals, &mut [&mut ShardCounters], &mut Vec<bool>) -> R,
    ) -> R {
        let mut visit = std::mem::take(&mut ps.visit);
        self.shards.take_dirty(&mut visit);
        visit.append(&mut ps.holders);
        if ps.holders.capacity() == 0 {
            ps.holders.reserve(visit.len());
        }
        visit.sort_unstable_by_key(|s| Arc::as_ptr(s) as usize);
        visit.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let mut guards: Vec<MutexGuard<'_, ShardState>> = visit.iter().map(|s| s.lock()).collect();
        let mut counters: Vec<&mut ShardCounters> = guards.iter_mut().map(|g| &mut g.counters).collect();
        let mut holds = std::mem::take(&mut ps.holds);
        holds.clear();
        holds.resize(visit.len(), false);
        let r = f(&mut ps.totals, &mut counters, &mut holds);
        drop(counters);
        drop(guards);
        for (s, &h) in visit.drain(..).zip(&holds) {
            if h {
                ps.holders.push(s);
            }
        }
        ps.visit = visit;
        ps.holds = holds;
        r
    }

    pub(in crate::caching) fn settle_locked(&self, ps: &mut PeakState) {
        self.visit_locked(ps, |t, shards, holds| peaks::settle(t, shards, &self.spare, holds));
    }

    /// How many times a call settled the peaks (a diagnostic; reads of the statistics settle
    /// uncounted).
    pub fn peak_settles(&self) -> i64 {
        self.counters.num_peak_settles.load(Ordering::Relaxed)
    }

    /// PyTorch `getStats`: one consistent snapshot of the device's statistics.
    pub fn stats(&self) -> DeviceStats {
        self.visit(|t, shards, holds| {
            peaks::settle(t, shards, &self.spare, holds);
            let mut s = counters::collect(t, &self.counters, self.max_split_size);
            s.unmapped_held_bytes = self.pages.stat();
            s.sleeping_bytes = self.sleepers.stat();
            s.pool_limit = self.pool_limit(0);
            s
        })
    }

    /// PyTorch `resetPeakStats`.
    pub fn reset_peak_stats(&self) {
        self.visit(|t, shards, _| peaks::reset(t, shards, &self.spare));
        self.reset_pool_peaks();
        self.pages.reset_peak();
        self.sleepers.reset_peak();
        self.limit.reset_mark();
    }
}
