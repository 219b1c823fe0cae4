//! The device's part of the largest single request a stream would be served now
//! (`gpupool_largest_allocatable`): what the search (`largest/mod.rs`) needs, read from the
//! shards one at a time, the driver and the memory fraction, with nothing changed.

use super::{ShardModel, Situation};
use crate::caching::device::DeviceAllocator;
use crate::driver::StreamHandle;
use crate::error::Error;

impl DeviceAllocator {
    /// The largest request in bytes that [`DeviceAllocator::malloc`] on `stream` (the
    /// device's default pools) would serve now, release-and-retry included (see
    /// `caching::largest`); 0 when none would. Reads each shard under its lock, one at a
    /// time, and asks the driver for its free memory (`cuMemGetInfo`), whether `stream`
    /// captures (`cuStreamGetCaptureInfo`) and whether the events of the stream's freed
    /// blocks have completed (`cuEventQuery`), as malloc does; allocates, releases and
    /// synchronises nothing, and counts in no statistic. While the default pools sleep (or a
    /// sleep or wake of them is under way) every such malloc is refused: 0.
    ///
    /// Errors: [`Error::Cuda`] when one of those calls fails.
    pub fn largest_allocatable(&self, stream: StreamHandle) -> Result<usize, Error> {
        if self.sleep_begun(0) {
            return Ok(0);
        }
        let underway = self.capture.any_underway();
        let capturing = self.capture.status(stream)?.is_capturing();
        // No allocation: the driver out of memory here is a CUDA error, not the answer.
        let info =
            self.driver.mem_info(self.device).map_err(|e| Error::driver_call(e, "reading the device's free memory"))?;
        let headroom = self.limit.get().map_or(usize::MAX, |l| (l - self.limit.reserved()).max(0) as usize);
        // `process_events` is skipped while a capture may be under way (see `serve`).
        let query = (!underway && !capturing).then_some(&*self.driver);
        let (mut now, mut others_release, mut others_release_default) = (ShardModel::default(), 0usize, 0usize);
        let mut orphans = 0usize;
        for shard in self.shards.all() {
            let st = shard.lock();
            let mine = shard.pool == 0 && shard.stream == stream;
            let copy = st.model(if mine { query } else { None })?;
            orphans += st.orphan_bytes();
            drop(st);
            if mine {
                now = copy.settled();
            } else {
                let bytes = copy.settled().release_bytes();
                others_release += bytes;
                if shard.pool == 0 {
                    others_release_default += bytes;
                }
            }
        }
        Ok(super::largest(&Situation {
            rules: self.rules,
            pages: self.expandable,
            now,
            room: info.free.min(headroom),
            // The memory fraction never counted them: freed, they add room only up to it.
            orphans: info.free.saturating_add(orphans).min(headroom) - info.free.min(headroom),
            held: self.pages.held_by_page(),
            others_release,
            budget: self.default_pools_budget(),
            others_release_default,
            grow: !capturing,
            release: !underway,
            deferred: self.deferred.stats().blocks > 0,
        }))
    }

    /// Bytes the default pools' limit (`gpupool_pool_set_limit` with pool 0) lets them reserve
    /// more now, charges in flight counted; `usize::MAX` without a limit.
    fn default_pools_budget(&self) -> usize {
        let left = |b: &crate::caching::budget::PoolBudget| Some((b.limit()? - b.reserved()).max(0) as usize);
        self.shards.budgets.get(0).and_then(|b| left(&b)).unwrap_or(usize::MAX)
    }
}
