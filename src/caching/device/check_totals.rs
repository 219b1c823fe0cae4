//! The consistency check of a device: every shard's own check, the physical bytes the memory
//! limit counts (reserved bytes and the page pool's), the device's totals against what the
//! settles saw, and the peak credit.

use std::sync::Arc;

use parking_lot::MutexGuard;

use super::DeviceAllocator;
use crate::caching::accounting::counters::{self, Metric, StatType, cell};
use crate::caching::accounting::peaks;
use crate::caching::shard::{Shard, ShardState};

impl DeviceAllocator {
    /// The consistency check of every shard, of the device's totals and of the peak credit.
    pub fn check(&self) -> Result<(), String> {
        let ps = self.peaks.lock();
        self.shards.check().map_err(|e| format!("device {}: {e}", self.device))?;
        let list = self.shards.all();
        // The front caches as they are: the check checks them too.
        let guards: Vec<MutexGuard<'_, ShardState>> = list.iter().map(|s| s.lock_hot()).collect();
        let fail = |what: String| Err(format!("device {}: {what}", self.device));
        for (shard, st) in list.iter().zip(&guards) {
            st.check(shard.stream, self.max_split_size).map_err(|e| format!("device {}: {e}", self.device))?;
            if let Some(align) = shard.source.as_ref().map(|s| s.split_alignment).filter(|&a| a > 0) {
                st.check_alignment(shard.stream, align).map_err(|e| format!("device {}: {e}", self.device))?;
            }
            // A pool's flags are fixed at its creation: its shards agree, and never split.
            if st.no_split != crate::caching::pools::flags::no_split(shard.pool) {
                return fail(format!(
                    "stream {:#x} of pool {:#x} disagrees on its no_split flag",
                    shard.stream, shard.pool
                ));
            }
            if st.no_split {
                st.check_unsplit(shard.stream).map_err(|e| format!("device {}: {e}", self.device))?;
            }
        }
        let states: Vec<&ShardState> = guards.iter().map(|g| &**g).collect();
        self.check_pools(&list, &states).map_err(|e| format!("device {}: {e}", self.device))?;
        self.check_budgets(&list, &states).map_err(|e| format!("device {}: {e}", self.device))?;
        let reserved_cell = cell(Metric::ReservedBytes, StatType::All);
        let reserved: i64 = guards.iter().map(|g| g.counters.cell(reserved_cell).current()).sum();
        // Reserved bytes count the pages sleeping pools gave back; the limit does not.
        let sleeping = self.check_sleepers(&list, &states).map_err(|e| format!("device {}: {e}", self.device))?;
        self.check_kept(&list, &states).map_err(|e| format!("device {}: {e}", self.device))?;
        let reserved = reserved - sleeping;
        // The limit counts physical memory: reserved bytes and the pages held unmapped, each
        // of which the driver (where it can tell) has alive and mapped nowhere.
        self.pages.check(&*self.driver).map_err(|e| format!("device {}: {e}", self.device))?;
        let held = self.pages.held() as i64;
        if reserved + held != self.limit.reserved() {
            return fail(format!(
                "reserved bytes {reserved} and held pages {held}, but the limit check counts {}",
                self.limit.reserved()
            ));
        }
        // The high-water rule and `reset_mark` rely on it: every committed byte raised the mark
        // (a page unmapped into the pool keeps its bytes counted, so none passes it either).
        if self.limit.over_mark(0) > 0 {
            return fail(format!(
                "reserved bytes {reserved} and held pages {held} are over the high-water mark by {}",
                self.limit.over_mark(0)
            ));
        }
        // Retired shards are out of the table: idle, with nothing unseen and no credit, they
        // add nothing below but their seen allocated/freed, which only the totals keep.
        let t = &ps.totals;
        for i in 0..t.peak.len() {
            let sum = |f: fn(&counters::Cell, &counters::Seen) -> i64| {
                guards.iter().map(|g| f(&g.counters.cell(i), &g.counters.seen[i])).sum::<i64>()
            };
            let (current, headroom) = (sum(|c, _| c.current()), sum(|c, _| c.headroom));
            let credit = headroom + peaks::spare_credit(&self.spare, i);
            if t.peak[i] != current + credit {
                return fail(format!("peak of cell {i} is {}, with current {current} and credit {credit}", t.peak[i]));
            }
            if t.current[i] != sum(|_, s| s.current) || t.held[i] != sum(|_, s| s.headroom) {
                return fail(format!("the totals of cell {i} differ from what the settles saw of the shards"));
            }
        }
        let on_list: Vec<*const Shard> = ps.holders.iter().map(Arc::as_ptr).collect();
        for (shard, g) in list.iter().zip(&guards) {
            let c = &g.counters;
            let unseen = (0..counters::CELLS)
                .map(|i| c.cell(i))
                .zip(&c.seen)
                .any(|(c, s)| c.current() != s.current || c.headroom != s.headroom);
            let credit = (0..counters::CELLS).any(|i| c.cell(i).headroom != 0);
            let dirty = g.dirty_epoch == self.shards.epoch();
            // What a shard changed since a settle saw it, and credit it holds, are found by the
            // next settle only through the dirty list or the holders.
            if (unseen || credit) && !dirty && !on_list.contains(&Arc::as_ptr(shard)) {
                return fail(format!(
                    "stream {:#x} changed or holds credit, but no settle would visit it",
                    shard.stream
                ));
            }
        }
        Ok(())
    }
}
