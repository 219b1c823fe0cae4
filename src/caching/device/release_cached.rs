//! Giving memory back to the driver: the device synchronisation that blocks freed with
//! `free_after_device_sync` await, and PyTorch `release_cached_blocks` (`empty_cache`), which
//! also takes the shards that hold nothing out of the table.

use std::sync::atomic::Ordering;

use super::{DeviceAllocator, PeakState};
use crate::caching::accounting::counters::bump;
use crate::caching::accounting::peaks;
use crate::caching::capture;
use crate::caching::deferred::DeferredStats;
use crate::error::Error;

impl DeviceAllocator {
    /// Synchronises the device (`cuCtxSynchronize`) if any block awaits it, then returns every
    /// block freed before the synchronisation began to its pool. Returns how many.
    ///
    /// Errors: [`Error::Cuda`] when the synchronisation fails; the blocks stay deferred.
    pub fn release_deferred(&self) -> Result<usize, Error> {
        // A device synchronisation would break a capture under way: the blocks wait for the
        // next synchronisation after it.
        if self.deferred.stats().blocks == 0 || self.capture.any_underway() {
            return Ok(0);
        }
        let Some(epoch) = self.deferred.begin_sync() else {
            return Ok(0);
        };
        self.driver
            .device_synchronize(self.device)
            .map_err(|e| Error::driver(e, "synchronising the device for blocks freed with free_after_device_sync"))?;
        let mut released = 0;
        for shard in self.shards.all() {
            let ctx = self.ctx(&shard);
            let mut st = self.shards.lock_for_change(&shard);
            let (blocks, bytes) = st.release_synced(&ctx, epoch);
            self.deferred.release(blocks, bytes);
            released += blocks;
            self.finish(st, ());
        }
        self.deferred.finish_sync(released);
        Ok(released)
    }

    /// What awaits a device synchronisation. Counters only: no driver call.
    pub fn deferred(&self) -> DeferredStats {
        self.deferred.stats()
    }

    /// PyTorch `release_cached_blocks` (`empty_cache`, and the OOM path): waits for every
    /// outstanding event of the device (`num_sync_all_streams`), and for the device if blocks
    /// await its synchronisation (gpupool's addition, see `release_deferred`), then returns
    /// every wholly free cached segment of every stream to the driver, and the physical pages
    /// the device holds for expandable segments (`page_pool`).
    ///
    /// Errors: [`Error::Cuda`] when waiting or freeing fails; what was done up to then stays
    /// done, and the rest stays cached (a page the driver will not release stays held and
    /// counted, for the next release).
    ///
    /// Errors: [`Error::Capture`], nothing done, while a capture may be under way on the device
    /// (see `capture`).
    pub fn release_cached_blocks(&self) -> Result<(), Error> {
        if self.capture.any_underway() {
            return Err(capture::refused_during_capture(self.device, "releasing the cache"));
        }
        bump(&self.counters.num_sync_all_streams);
        self.release_deferred()?;
        for shard in self.shards.all() {
            let ctx = self.ctx(&shard);
            // A shard with nothing to release (most, when many streams hold memory) is
            // tidied without being marked changed, which would make the settle below visit it.
            let mut st = shard.lock();
            if !st.has_cache_to_release() {
                st.release_cached(&ctx)?;
                continue;
            }
            drop(st);
            let mut st = self.shards.lock_for_change(&shard);
            if st.has_capture_deferred() && !self.capture.capture_routed() {
                st.insert_deferred_events(&ctx);
            }
            st.synchronize_events(&ctx)?;
            st.release_cached(&ctx)?;
            self.finish(st, ());
        }
        // The handles the shards unmapped, and any held before, go back to the driver.
        let (_, failure) = self.pages.release(&*self.driver, self.device, &self.limit, 0, None);
        self.retire_idle_shards();
        self.prune_released();
        self.limit.reset_mark();
        // The staging ring of sleep and wake, unless one uses it now.
        self.staging.release(&*self.driver, self.device);
        match failure {
            Some(e) => Err(Error::driver(e, "releasing the physical pages held for expandable segments")),
            None => Ok(()),
        }
    }

    /// Takes the shards that hold nothing out of the table (see `shard_table`), after a
    /// settle has counted what they did; credit one still holds goes to the spare credit.
    pub(super) fn retire_idle_shards(&self) {
        let mut ps = self.peaks.lock();
        self.settle_locked(&mut ps);
        let PeakState { totals, holders, .. } = &mut *ps;
        self.shards.retire_idle(|st, _| {
            if !st.is_idle() {
                return false;
            }
            // What it changed since the settle above saw it (it may have joined the dirty
            // list since), counted first, so that the totals stay what the shards hold.
            peaks::absorb(totals, &mut [&mut st.counters]);
            let (cells, seen) = st.counters.cells_and_seen();
            for (i, (c, seen)) in cells.iter_mut().zip(seen.iter_mut()).enumerate() {
                seen.allocated = c.allocated;
                seen.freed = c.freed;
                self.spare[i].fetch_add(c.headroom, Ordering::Relaxed);
                totals.held[i] -= c.headroom;
                c.headroom = 0;
                seen.headroom = 0;
                c.low = 0;
            }
            true
        });
        holders.retain(|s| !s.is_retired());
        // Buffers sized for the busiest settle so far; empty_cache gives them back.
        ps.holders.shrink_to_fit();
        ps.visit = Vec::new();
        ps.holds = Vec::new();
    }
}
