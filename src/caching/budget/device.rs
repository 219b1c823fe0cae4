//! A device's pool budgets (`caching::budget`): their limits set and read, the out-of-memory
//! path of a request its pool's budget refused, and the consistency check of their counts.

use crate::caching::accounting::counters::{Metric, StatType, bump, cell};
use crate::caching::budget;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::{Request, Shard, ShardState};
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;

impl DeviceAllocator {
    /// Sets the most bytes `pool` (0: the default pools, every stream's) may reserve on this
    /// device; `None` removes the limit. Nothing is released now: a pool over its new limit
    /// keeps what it holds, and its next growth releases its free cache first (see
    /// [`DeviceAllocator::malloc_over_budget`]). Takes effect for the growths that start after
    /// it; one under way on another thread was checked against the old limit.
    ///
    /// Errors: [`Error::InvalidValue`] when the private pool was released on this device (it
    /// allocates nothing again); nothing changed.
    pub fn set_pool_limit(&self, pool: u64, limit: Option<i64>) -> Result<(), Error> {
        // Checked and set in one step under the pools' lock: checked first and set after, a
        // release in between forgot the budget and the set made it again, limit and all.
        let set = || self.shards.budgets.get_or_create(pool).set_limit(limit);
        if pool == 0 {
            set();
            return Ok(());
        }
        self.unless_released(pool, set).ok_or_else(|| {
            Error::InvalidValue(format!(
                "pool {pool:#x} was released on device {}: it allocates nothing again, so it takes no limit",
                self.device
            ))
        })
    }

    /// The limit of `pool` (0: the default pools) on this device in bytes; `None`: none set.
    pub fn pool_limit(&self, pool: u64) -> Option<i64> {
        self.shards.budgets.get(pool).and_then(|b| b.limit())
    }

    /// The out-of-memory path of a request of `pool` on `stream` whose growth the pool's budget
    /// refused: the pool's own free cache goes back to the driver (every stream's shard of the
    /// pool, one at a time, after waiting for its blocks' events, and for the device where
    /// blocks await its synchronisation, as release-and-retry does) and the request is tried
    /// again; if the budget still refuses, the request counts in `num_ooms`, the out-of-memory
    /// observers are called, one more attempt (the pool's cache released again) is made if one
    /// of them asked, and the error names the pool, its limit and its use. Other pools' caches
    /// are not released. `Ok(None)`: the retry's refusal was the device's (the driver or the
    /// memory fraction), whose path the caller takes.
    ///
    /// Errors: [`Error::OutOfMemory`] as above; [`Error::Cuda`] when a driver call fails.
    ///
    /// Cold and out of line: the out-of-memory path, whose inlining moved the hit pairs by an
    /// instruction each (callgrind, `tests/c/hit_budget.sh`: 395 and 145 with its waits
    /// inlined, 394 and 144 without).
    #[cold]
    #[inline(never)]
    pub(in crate::caching) fn malloc_over_budget(
        &self,
        pool: u64,
        stream: StreamHandle,
        req: &Request,
    ) -> Result<Option<DevicePtr>, Error> {
        if let Some(ptr) = self.retry_within_budget(pool, stream, req)? {
            return Ok(Some(ptr));
        }
        if !budget::take_refusal() {
            return Ok(None);
        }
        if self.history.on() {
            self.record_oom(stream, req);
        }
        bump(&self.counters.num_ooms);
        // An observer may have freed blocks of the pool (cached now), or raised its limit.
        if self.observers.notify(self.device, req.size, || self.stats()) && !crate::callout::exiting() {
            if let Some(ptr) = self.retry_within_budget(pool, stream, req)? {
                return Ok(Some(ptr));
            }
            if !budget::take_refusal() {
                // The device refused the last attempt: its message (the observers ran once).
                return Err(self.out_of_memory(req));
            }
        }
        Err(self.over_budget(pool, req))
    }

    /// The pool's own free cache released ([`DeviceAllocator::release_pool_cache`]), then the
    /// request tried again on `stream`'s current shard of the pool: a flush and a retry, which
    /// `num_alloc_retries` counts (PyTorch counts there the failures that flushed the cache).
    /// Blocks freed with `free_after_device_sync` are returned first (a device
    /// synchronisation, where any await it): they are the pool's cache too.
    fn retry_within_budget(&self, pool: u64, stream: StreamHandle, req: &Request) -> Result<Option<DevicePtr>, Error> {
        self.release_deferred()?;
        self.release_pool_cache(pool);
        bump(&self.counters.num_alloc_retries);
        self.serve_stream(pool, stream, req)
    }

    /// The error of a request of `pool` its budget refused, with the pool's limit and use now.
    pub(in crate::caching) fn over_budget(&self, pool: u64, req: &Request) -> Error {
        let b = self.shards.budgets.get_or_create(pool);
        budget::over_budget(self.device, pool, b.limit().unwrap_or(i64::MAX), b.reserved(), req)
    }

    /// PyTorch's `release_cached_blocks` over `pool`'s shards only: their blocks' events are
    /// waited for (`synchronize_and_free_events`: a block freed behind another stream's event
    /// that fits the request serves it then, PyTorch #189504, as on the device's path), wholly
    /// free segments and pages go back to the driver. Nothing while a capture may be under way
    /// (that would synchronise). Best effort: what fails stays cached.
    fn release_pool_cache(&self, pool: u64) {
        if self.capture.any_underway() {
            return;
        }
        for shard in self.shards.of_pool(pool) {
            let ctx = self.ctx(&shard);
            let mut st = self.shards.lock_for_change(&shard);
            let _ = st.synchronize_events(&ctx);
            let _ = st.release_cached(&ctx);
            self.finish(st, ());
        }
    }

    /// The budgets' rule: each pool's count is the reserved bytes of its shards (`list`, locked
    /// as `states`; a retired shard holds nothing).
    pub(in crate::caching) fn check_budgets(
        &self,
        list: &[std::sync::Arc<Shard>],
        states: &[&ShardState],
    ) -> Result<(), String> {
        let reserved = cell(Metric::ReservedBytes, StatType::All);
        for b in self.shards.budgets.all() {
            let sum: i64 = list
                .iter()
                .zip(states)
                .filter(|(s, _)| s.pool == b.pool)
                .map(|(_, st)| st.counters.cell(reserved).current())
                .sum();
            if sum != b.reserved() {
                return Err(format!(
                    "{} reserves {sum} bytes, but its budget counts {}",
                    budget::pool_name(b.pool),
                    b.reserved()
                ));
            }
        }
        Ok(())
    }
}
