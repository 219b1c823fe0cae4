//! One device: its shards (one per stream), PyTorch's malloc with free-and-retry on
//! out-of-memory, `empty_cache`, and the device-wide statistics.
//!
//! Lock order, which makes deadlock impossible: a thread holding a shard's lock takes no other
//! lock but the segment index's writer lock. The peak lock is taken with no shard lock held,
//! and then every shard lock in creation order.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::counters::{self, CELLS, DeviceCounters, Metric, ShardCounters, StatType, bump, cell};
use super::deferred::{DeferredFrees, DeferredStats};
use super::limit::MemoryLimit;
use super::oom;
use super::peaks::{self, SpareCredit};
use super::segment_index::SegmentIndex;
use super::shard::{Request, Shard, ShardCtx, ShardState};
use crate::driver::{DevicePtr, Driver, DriverError, StreamHandle};
use crate::error::Error;
use crate::stats::DeviceStats;

#[derive(Default)]
struct ShardTable {
    list: Vec<Arc<Shard>>,
    by_stream: FxHashMap<StreamHandle, Arc<Shard>>,
}

pub(crate) struct DeviceAllocator {
    pub device: i32,
    driver: Arc<dyn Driver>,
    index: Arc<SegmentIndex<Arc<Shard>>>,
    pub max_split_size: usize,
    shards: Mutex<ShardTable>,
    peaks: Mutex<[i64; CELLS]>,
    /// Credit towards the peaks that no shard holds (see `peaks`).
    spare: SpareCredit,
    counters: DeviceCounters,
    limit: MemoryLimit,
    deferred: DeferredFrees,
}

impl DeviceAllocator {
    pub fn new(
        device: i32,
        driver: Arc<dyn Driver>,
        index: Arc<SegmentIndex<Arc<Shard>>>,
        max_split_size: usize,
    ) -> Self {
        DeviceAllocator {
            device,
            driver,
            index,
            max_split_size,
            shards: Mutex::new(ShardTable::default()),
            peaks: Mutex::new([0; CELLS]),
            spare: std::array::from_fn(|_| AtomicI64::new(0)),
            counters: DeviceCounters::default(),
            limit: MemoryLimit::default(),
            deferred: DeferredFrees::default(),
        }
    }

    fn ctx<'a>(&'a self, shard: &'a Arc<Shard>) -> ShardCtx<'a> {
        ShardCtx {
            driver: &*self.driver,
            device: self.device,
            max_split_size: self.max_split_size,
            index: &self.index,
            shard,
            limit: &self.limit,
            counters: &self.counters,
        }
    }

    /// The shard of `stream`, created on first use.
    pub fn shard(&self, stream: StreamHandle) -> Arc<Shard> {
        let mut t = self.shards.lock();
        let ShardTable { list, by_stream } = &mut *t;
        by_stream
            .entry(stream)
            .or_insert_with(|| {
                let s = Arc::new(Shard::new(stream));
                list.push(s.clone());
                s
            })
            .clone()
    }

    fn shard_list(&self) -> Vec<Arc<Shard>> {
        self.shards.lock().list.clone()
    }

    /// PyTorch `DeviceCachingAllocator::malloc`: events first (`process_events`), then the best
    /// cached fit, then a new segment; on out-of-memory, oversize segments of this stream
    /// (`release_available_cached_blocks`), then (gpupool's addition) the blocks awaiting a
    /// device synchronisation and a retry from the cache, then every cached segment of the
    /// device after waiting for all events (`release_cached_blocks`) and one retry
    /// (`num_alloc_retries`).
    ///
    /// The hit path takes the shard's lock once and makes no driver call when no event is
    /// pending. Unlike PyTorch, the lock is held across the driver call, which blocks only this
    /// stream's callers.
    pub fn malloc(&self, shard: &Arc<Shard>, size: usize) -> Result<DevicePtr, Error> {
        let req = Request::new(size)?;
        let ctx = self.ctx(shard);
        let mut st = shard.lock();
        st.process_events(&ctx)?;
        if let Some(ptr) = self.serve(&mut st, &ctx, &req)? {
            return Ok(self.finish(st, ptr));
        }
        drop(st);
        // Blocks awaiting a device synchronisation are cache that a synchronisation frees:
        // try them before giving the whole cache back to the driver (not in PyTorch, which
        // has no such blocks).
        if self.release_deferred()? > 0 {
            let mut st = shard.lock();
            if let Some(ptr) = self.serve(&mut st, &ctx, &req)? {
                return Ok(self.finish(st, ptr));
            }
        }
        self.release_cached_blocks()?;
        bump(&self.counters.num_alloc_retries);
        let mut st = shard.lock();
        if let Some(ptr) = self.serve(&mut st, &ctx, &req)? {
            return Ok(self.finish(st, ptr));
        }
        drop(st);
        Err(self.out_of_memory(&req))
    }

    /// A block for `req` from the cache or a new segment; `Ok(None)` when the device is out of
    /// memory for it.
    #[inline]
    fn serve(&self, st: &mut ShardState, ctx: &ShardCtx, req: &Request) -> Result<Option<DevicePtr>, Error> {
        let id = match st.take_cached(req, self.max_split_size) {
            Some(id) => id,
            None => match st.new_segment(ctx, req) {
                Ok(id) => id,
                Err(DriverError::OutOfMemory) => {
                    if !st.release_available(ctx, req)? {
                        return Ok(None);
                    }
                    match st.new_segment(ctx, req) {
                        Ok(id) => id,
                        Err(DriverError::OutOfMemory) => return Ok(None),
                        Err(e) => return Err(Error::driver(e, "allocating a segment")),
                    }
                }
                Err(e) => return Err(Error::driver(e, "allocating a segment")),
            },
        };
        Ok(Some(st.hand_out(id, req, self.max_split_size)))
    }

    /// Ends a call on a shard: gives surplus credit back to the spare credit, covers a
    /// shortfall from it, unlocks, and settles the device peaks only if the spare credit could not cover.
    #[inline]
    fn finish<T>(&self, mut st: MutexGuard<'_, ShardState>, value: T) -> T {
        let c = &mut st.counters;
        if c.has_surplus {
            peaks::give_back(c, &self.spare);
        }
        let settle = c.needs_settle && !peaks::borrow(c, &self.spare);
        drop(st);
        if settle {
            bump(&self.counters.num_peak_settles);
            self.with_all_shards(|p, shards| peaks::settle(p, shards, &self.spare));
        }
        value
    }

    /// PyTorch `free` on the block at `ptr` of `shard`'s segment at `segment`.
    pub fn free(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<(), Error> {
        let ctx = self.ctx(shard);
        let mut st = shard.lock();
        st.free(&ctx, ptr, segment)?;
        self.finish(st, ());
        Ok(())
    }

    /// A free that waits for the next device synchronisation (see
    /// [`crate::Allocator::free_after_device_sync`]). Returns the device's deferred bytes.
    pub fn free_after_sync(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<usize, Error> {
        let ctx = self.ctx(shard);
        let mut st = shard.lock();
        let size = st.free_after_sync(&ctx, ptr, segment, self.deferred.epoch())?;
        let bytes = self.deferred.add(size);
        self.finish(st, ());
        Ok(bytes)
    }

    /// Synchronises the device (`cuCtxSynchronize`) if any block awaits it, then returns every
    /// block freed before the synchronisation began to its pool. Returns how many.
    ///
    /// Errors: [`Error::Cuda`] when the synchronisation fails; the blocks stay deferred.
    pub fn release_deferred(&self) -> Result<usize, Error> {
        let Some(epoch) = self.deferred.begin_sync() else {
            return Ok(0);
        };
        self.driver
            .device_synchronize(self.device)
            .map_err(|e| Error::driver(e, "synchronising the device for blocks freed with free_after_device_sync"))?;
        let mut released = 0;
        for shard in self.shard_list() {
            let mut st = shard.lock();
            let (blocks, bytes) = st.release_synced(epoch);
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

    /// PyTorch `recordStream` on the block at `ptr` of `shard`'s segment at `segment`.
    pub fn record_stream(
        &self,
        shard: &Arc<Shard>,
        ptr: DevicePtr,
        segment: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        shard.lock().record_stream(ptr, segment, shard.stream, stream)
    }

    /// PyTorch `release_cached_blocks` (`empty_cache`, and the OOM path): waits for every
    /// outstanding event of the device (`num_sync_all_streams`), and for the device if blocks
    /// await its synchronisation (gpupool's addition, see `release_deferred`), then returns
    /// every wholly free cached segment of every stream to the driver.
    ///
    /// Errors: [`Error::Cuda`] when waiting or freeing fails; what was done up to then stays
    /// done, and the rest stays cached.
    pub fn release_cached_blocks(&self) -> Result<(), Error> {
        bump(&self.counters.num_sync_all_streams);
        self.release_deferred()?;
        for shard in self.shard_list() {
            let ctx = self.ctx(&shard);
            let mut st = shard.lock();
            st.synchronize_events(&ctx)?;
            st.release_cached(&ctx)?;
            self.finish(st, ());
        }
        Ok(())
    }

    /// PyTorch `setMemoryFraction`: from now on the device reserves at most `fraction` of its
    /// total memory (`cuMemGetInfo`); a segment past that fails as out of memory, after the
    /// cache was released and the allocation retried. Segments already reserved stay.
    /// `fraction` is checked by the caller.
    ///
    /// Errors: [`Error::Cuda`] when the total cannot be read.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        let info =
            self.driver.mem_info(self.device).map_err(|e| Error::driver(e, "reading the device's total memory"))?;
        self.limit.set((fraction * info.total as f64) as i64);
        Ok(())
    }

    /// PyTorch's out-of-memory error, with the device's figures; counted in `num_ooms`.
    fn out_of_memory(&self, req: &Request) -> Error {
        bump(&self.counters.num_ooms);
        oom::message(self.device, &*self.driver, req, &self.stats(), self.limit.get())
    }

    /// Runs `f` with the peak lock and every shard of the device locked.
    fn with_all_shards<R>(&self, f: impl FnOnce(&mut [i64; CELLS], &mut [&mut ShardCounters]) -> R) -> R {
        let mut peaks = self.peaks.lock();
        let list = self.shard_list();
        let mut guards: Vec<MutexGuard<'_, ShardState>> = list.iter().map(|s| s.lock()).collect();
        let mut counters: Vec<&mut ShardCounters> = guards.iter_mut().map(|g| &mut g.counters).collect();
        f(&mut peaks, &mut counters)
    }

    /// How many times a call had to lock every shard to settle the peaks (a diagnostic).
    pub fn peak_settles(&self) -> i64 {
        self.counters.num_peak_settles.load(Ordering::Relaxed)
    }

    /// PyTorch `getStats`: one consistent snapshot of the device's statistics.
    pub fn stats(&self) -> DeviceStats {
        self.with_all_shards(|peaks, shards| {
            peaks::settle(peaks, shards, &self.spare);
            let view: Vec<&ShardCounters> = shards.iter().map(|s| &**s).collect();
            counters::collect(peaks, &view, &self.counters, self.max_split_size)
        })
    }

    /// PyTorch `resetPeakStats`.
    pub fn reset_peak_stats(&self) {
        self.with_all_shards(|p, shards| peaks::reset(p, shards, &self.spare));
    }

    /// The consistency check of every shard, and of the peak credit.
    pub fn check(&self) -> Result<(), String> {
        let peaks = self.peaks.lock();
        let list = self.shard_list();
        let guards: Vec<MutexGuard<'_, ShardState>> = list.iter().map(|s| s.lock()).collect();
        for (shard, st) in list.iter().zip(&guards) {
            st.check(shard.stream, self.max_split_size).map_err(|e| format!("device {}: {e}", self.device))?;
        }
        let reserved_cell = cell(Metric::ReservedBytes, StatType::All);
        let reserved: i64 = guards.iter().map(|g| g.counters.cells[reserved_cell].current).sum();
        if reserved != self.limit.reserved() {
            return Err(format!(
                "device {}: reserved bytes {reserved}, but the limit check counts {}",
                self.device,
                self.limit.reserved()
            ));
        }
        let settled = guards.iter().all(|g| !g.counters.needs_settle);
        for (i, &peak) in peaks.iter().enumerate() {
            let current: i64 = guards.iter().map(|g| g.counters.cells[i].current).sum();
            let credit: i64 =
                guards.iter().map(|g| g.counters.cells[i].headroom).sum::<i64>() + peaks::spare_credit(&self.spare, i);
            if peak != current + credit || (settled && peak < current) {
                return Err(format!(
                    "device {}: peak of statistic cell {i} is {peak} with current {current} and credit {credit}",
                    self.device
                ));
            }
        }
        Ok(())
    }
}
