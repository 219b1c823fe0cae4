//! One device: its shards (one per stream), PyTorch's malloc with free-and-retry on
//! out-of-memory, `empty_cache`, and the device-wide statistics.
//!
//! Lock order, which makes deadlock impossible: a thread holding a shard's lock takes no other
//! lock but the segment index's writer lock, the dirty list's (`shard_table`) and the
//! history's (a device's trace, the table of stacks), none of which is held while taking
//! another. The peak lock is taken with no shard lock held; under it a settle locks the shards
//! it visits (one settle at a time), the consistency check and a snapshot lock every shard,
//! and `empty_cache` takes the shard table's lock and only tries the shard locks. The private
//! pools' lock (`pools.rs`) and the capture probe's list of streams seen capturing
//! (`capture.rs`) are leaves: taken with or without shard locks held, never held while taking
//! another lock. Out-of-memory observers and route filters run with none of these held
//! (`out_of_memory.rs`, `pools.rs`). `check.rs`:
//! the consistency check; `history.rs`: the allocation history and snapshots.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::capture::{self, CaptureProbe};
use super::counters::{self, DeviceCounters, ShardCounters, bump};
use super::deferred::{DeferredFrees, DeferredStats};
use super::limit::MemoryLimit;
use super::observers::OomObservers;
use super::peaks::{self, SpareCredit, Totals};
use super::rules::{SMALL_BUFFER, SizeRules};
use super::segment_index::SegmentIndex;
use super::shard::{ExpandablePolicy, Growth, Reclaim, Request, Shard, ShardCtx, ShardState};
use super::shard_table::ShardTable;
use crate::config::Config;
use crate::driver::{CaptureMode, CaptureStatus, DevicePtr, Driver, DriverError, StreamHandle};
use crate::error::Error;
use crate::history::HistoryHook;
use crate::stats::DeviceStats;

mod check;
mod gc;
mod history;
mod out_of_memory;
mod pools;

pub use pools::PoolStats;
pub(crate) use pools::{RouteFilter, RouteTo};

/// What the peak lock guards: the device's totals and the shards that still hold credit.
#[derive(Default)]
struct PeakState {
    totals: Totals,
    holders: Vec<Arc<Shard>>,
    /// Reused by each settle for the shards it visits (no allocation once warm).
    visit: Vec<Arc<Shard>>,
    holds: Vec<bool>,
}

pub(crate) struct DeviceAllocator {
    pub device: i32,
    driver: Arc<dyn Driver>,
    index: Arc<SegmentIndex<Arc<Shard>>>,
    /// The size rules of `GPUPOOL_CONF`, fixed when the device started.
    rules: SizeRules,
    pub max_split_size: usize,
    shards: ShardTable,
    peaks: Mutex<PeakState>,
    /// Credit towards the peaks that no shard holds (see `peaks`).
    spare: SpareCredit,
    counters: DeviceCounters,
    limit: MemoryLimit,
    deferred: DeferredFrees,
    /// Expandable segments' layout; `None`: ordinary segments.
    expandable: Option<ExpandablePolicy>,
    /// Whether expandable segments keep to the device's high-water mark (see [`Reclaim`]).
    reclaim: Reclaim,
    /// PyTorch's `garbage_collection_threshold` (0: off; see `gc`).
    gc_threshold: f64,
    /// The allocator's out-of-memory observers, read only once a request has failed.
    observers: Arc<OomObservers>,
    /// The allocation history: malloc and free read its flag.
    history: HistoryHook,
    /// Whether a CUDA graph capture may be under way (see `capture`).
    capture: CaptureProbe,
    /// The private pools and the routes to them (see `pools`).
    pools: pools::Pools,
}

/// What [`DeviceAllocator::serve`] obtained.
enum Served {
    Block(DevicePtr),
    /// The device is out of memory for the request (after this stream's oversize segments
    /// were released).
    OutOfMemory,
    /// The stream captures a CUDA graph and the default pools cannot serve the request without
    /// the driver (see `capture`).
    Capturing(CaptureStatus),
    /// A private pool could not grow during capture: the device is out of memory, and
    /// releasing the cache would synchronise.
    CapturingOom,
    /// See [`Growth::PastMark`].
    PastMark(usize),
    /// No cached block fits and reserved bytes are over `garbage_collection_threshold`: the
    /// caller, holding no shard lock, collects first (see `gc`).
    Collect,
}

/// Page size of the large pool's expandable segments, in bytes, rounded up to the driver's
/// granularity. PyTorch maps 20 MiB pages (`kLargeBuffer`) there; replaying the traces of
/// `../shared/traces` on the simulated device, 2 MiB pages reserved less on every one (peak
/// reserved over peak live: llama_decode 1.054 with 20 MiB, 1.027 with 2 MiB;
/// pipeline_streams 1.386 and 1.180; vit_train 1.037 and 1.038) for more driver calls when a
/// segment grows, which the cold pass of `bench` measures on the GPU.
const LARGE_PAGE: usize = 2 << 20;

impl DeviceAllocator {
    /// The allocator of `device` with `config`'s rules (PyTorch's size rules,
    /// `garbage_collection_threshold`), calling `observers` when a request fails. With
    /// `expandable_segments`, its segments are expandable if the driver can map memory on it;
    /// otherwise, or when asking the driver fails, they are ordinary segments, as PyTorch falls
    /// back; with `expandable_reclaim` they keep to the high-water mark (see [`Reclaim`]). Its events go to
    /// `history`.
    pub fn new(
        device: i32,
        driver: Arc<dyn Driver>,
        index: Arc<SegmentIndex<Arc<Shard>>>,
        config: &Config,
        observers: Arc<OomObservers>,
        history: HistoryHook,
    ) -> Self {
        let rules = SizeRules::from_config(config);
        let (expandable, reclaim, gc_threshold) =
            (config.expandable_segments, config.expandable_reclaim, config.garbage_collection_threshold);
        let expandable = expandable.then(|| expandable_policy(&*driver, device)).flatten();
        DeviceAllocator {
            gc_threshold,
            reclaim: if expandable.is_some() && reclaim { Reclaim::Device } else { Reclaim::Off },
            expandable,
            device,
            driver: driver.clone(),
            index,
            rules,
            max_split_size: rules.max_split_size,
            shards: ShardTable::default(),
            peaks: Mutex::default(),
            spare: std::array::from_fn(|_| AtomicI64::new(0)),
            counters: DeviceCounters::default(),
            limit: MemoryLimit::default(),
            deferred: DeferredFrees::default(),
            observers,
            history,
            capture: CaptureProbe::new(driver.clone(), device),
            pools: pools::Pools::default(),
        }
    }

    /// What a call on `shard` needs. A private pool's segments are ordinary ones: a graph
    /// replays at fixed addresses, which an expandable segment unmapping its free pages would
    /// take away.
    fn ctx<'a>(&'a self, shard: &'a Arc<Shard>) -> ShardCtx<'a> {
        let private = shard.pool != 0;
        ShardCtx {
            driver: &*self.driver,
            device: self.device,
            max_split_size: self.max_split_size,
            index: &self.index,
            shard,
            limit: &self.limit,
            counters: &self.counters,
            deferred: &self.deferred,
            expandable: if private { None } else { self.expandable.as_ref() },
            reclaim: if private { Reclaim::Off } else { self.reclaim },
            history: &self.history,
            capture: &self.capture,
        }
    }

    /// The shard of `stream` in the default pools, created on first use.
    pub fn shard_or_create(&self, stream: StreamHandle) -> Arc<Shard> {
        self.shards.get_or_create(0, stream)
    }

    /// Whether a route to a private pool is active on the device (one relaxed load).
    #[inline(always)]
    pub fn routes_active(&self) -> bool {
        self.capture.routes() != 0
    }

    /// Size bins in the pools of every shard (host memory, for tests).
    pub fn pool_bins(&self) -> usize {
        self.shards.all().iter().map(|s| s.lock().bin_count()).sum()
    }

    /// Shards in the device's table: streams that hold memory or were used since the last
    /// `empty_cache` (a diagnostic).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// PyTorch `DeviceCachingAllocator::malloc` up to its first failure: events first
    /// (`process_events`), then the best cached fit, then a new segment, then (the device full)
    /// the oversize segments of this stream (`release_available_cached_blocks`) and a new
    /// segment again; if the device is out of memory for it, the rest of PyTorch's `malloc`:
    /// [`DeviceAllocator::malloc_after_oom`] (`out_of_memory.rs`), with the shard unlocked.
    ///
    /// The hit path takes the shard's lock once and makes no driver call when no event is
    /// pending. Unlike PyTorch, the lock is held across the driver call, which blocks only this
    /// stream's callers.
    ///
    /// `hot`: the calling thread used this shard lately (see `peaks`: a stream that is not hot
    /// keeps no credit past the call).
    pub fn malloc(&self, shard: &Arc<Shard>, size: usize, hot: bool) -> Result<DevicePtr, Error> {
        let req = Request::new(size, &self.rules)?;
        self.malloc_req(shard, &req, hot, false)
    }

    /// [`DeviceAllocator::malloc`] of a rounded request. `graph`: the stream captures into a
    /// private pool, whose segment the block is from is then kept for the graph. Inlined into
    /// both callers: called out of line, the hit path paid about 35 instructions a malloc
    /// (callgrind, `examples/hit_loop`).
    #[inline(always)]
    fn malloc_req(&self, shard: &Arc<Shard>, req: &Request, hot: bool, graph: bool) -> Result<DevicePtr, Error> {
        let mut st = self.shards.lock_for_change(shard);
        let detour = if !shard.is_retired() {
            let ctx = self.ctx(shard);
            self.process_events(&mut st, &ctx)?;
            match self.serve(&mut st, &ctx, req, true)? {
                Served::Block(ptr) => {
                    if graph {
                        st.mark_graph(ptr);
                    }
                    if self.history.on_or_tagged() {
                        st.record_alloc_at(&self.history, shard.stream, ptr, req.size);
                    }
                    return Ok(self.finish_call(st, ptr, hot));
                }
                other => Some(other),
            }
        } else {
            None
        };
        drop(st);
        match detour {
            Some(Served::PastMark(short)) => self.unmap_other_streams(shard, short),
            Some(Served::Collect) => {
                self.collect_garbage();
            }
            Some(Served::Capturing(status)) => {
                return Err(capture::needs_private_pool(self.device, shard.stream, req.size, status));
            }
            Some(Served::CapturingOom) => return Err(self.out_of_memory_capturing(shard, req)),
            _ => {}
        }
        match self.serve_stream(shard.pool, shard.stream, req)? {
            Some(ptr) => Ok(ptr),
            None => self.malloc_after_oom(shard.pool, shard.stream, req),
        }
    }

    /// PyTorch `process_events`, skipped while a capture may be under way (PyTorch skips it
    /// while `captures_underway` is not empty: an event query is illegal during capture): a
    /// route by stream or filter is active, or the stream captures.
    /// Inlined: the hit path tests one length.
    #[inline(always)]
    fn process_events(&self, st: &mut ShardState, ctx: &ShardCtx) -> Result<(), Error> {
        if st.events_pending() { self.process_events_slow(st, ctx) } else { Ok(()) }
    }

    #[cold]
    #[inline(never)]
    fn process_events_slow(&self, st: &mut ShardState, ctx: &ShardCtx) -> Result<(), Error> {
        if self.capture.capture_routed() || self.capture.status(ctx.shard.stream)?.is_capturing() {
            return Ok(());
        }
        st.process_events(ctx)
    }

    /// [`Reclaim::Device`]'s second step: the free pages of the device's other streams'
    /// expandable segments are unmapped, `want` bytes of them if they have that many, each
    /// shard locked in turn (the caller holds none). A failure leaves those pages cached.
    fn unmap_other_streams(&self, shard: &Arc<Shard>, want: usize) {
        let mut left = want;
        for other in self.shards.all() {
            if left == 0 {
                break;
            }
            if Arc::ptr_eq(&other, shard) {
                continue;
            }
            let ctx = self.ctx(&other);
            let mut st = self.shards.lock_for_change(&other);
            if other.is_retired() {
                continue;
            }
            left = left.saturating_sub(st.unmap_free_pages(&ctx, left, None).unwrap_or(0));
            self.finish(st, ());
        }
    }

    /// [`DeviceAllocator::serve`] on the current shard of `stream` (its shard may have been
    /// retired by `empty_cache` meanwhile), growing past the high-water mark once this
    /// shard's free pages are unmapped ([`Reclaim::Shard`]): the other streams' were, or
    /// the device is out of memory.
    fn serve_stream(&self, pool: u64, stream: StreamHandle, req: &Request) -> Result<Option<DevicePtr>, Error> {
        loop {
            let shard = self.shards.get_or_create(pool, stream);
            let mut st = self.shards.lock_for_change(&shard);
            if shard.is_retired() {
                continue;
            }
            let mut ctx = self.ctx(&shard);
            ctx.reclaim = ctx.reclaim.min(Reclaim::Shard);
            self.process_events(&mut st, &ctx)?;
            return Ok(match self.serve(&mut st, &ctx, req, false)? {
                Served::Block(ptr) => {
                    if self.history.on_or_tagged() {
                        st.record_alloc_at(&self.history, stream, ptr, req.size);
                    }
                    Some(self.finish(st, ptr))
                }
                Served::OutOfMemory => None,
                Served::Capturing(status) => {
                    drop(st);
                    return Err(capture::needs_private_pool(self.device, stream, req.size, status));
                }
                Served::CapturingOom => {
                    drop(st);
                    return Err(self.out_of_memory_capturing(&shard, req));
                }
                Served::PastMark(_) | Served::Collect => unreachable!("only with Reclaim::Device, or collect"),
            });
        }
    }

    /// A block for `req` from the cache or from the driver. `collect`: answer
    /// [`Served::Collect`] rather than growing when `garbage_collection_threshold` is due. Its
    /// `alloc` event is the caller's to record (see [`ShardState::record_alloc_at`]).
    #[inline]
    fn serve(&self, st: &mut ShardState, ctx: &ShardCtx, req: &Request, collect: bool) -> Result<Served, Error> {
        let id = match st.take_cached(req, &self.rules) {
            Some(id) => id,
            None => match self.serve_miss(st, ctx, req, collect)? {
                Ok(id) => id,
                Err(served) => return Ok(served),
            },
        };
        Ok(Served::Block(st.hand_out(id, req, self.max_split_size)))
    }

    /// The rest of [`DeviceAllocator::serve`] when no cached block fits: a new segment, unless
    /// the stream captures a CUDA graph. Then the default pools refuse ([`Served::Capturing`]:
    /// the driver may not be called, nor the cache released, which synchronises), and a
    /// private pool takes a new segment with the thread's capture mode relaxed for the call
    /// (PyTorch `cudaMallocMaybeCapturing`: a `cuMemAlloc` made so is not captured, and the
    /// graph keeps the address). Blocks freed during a capture that awaited its end get their
    /// events here once it has ended.
    #[cold]
    #[inline(never)]
    fn serve_miss(
        &self,
        st: &mut ShardState,
        ctx: &ShardCtx,
        req: &Request,
        collect: bool,
    ) -> Result<Result<super::block::BlockId, Served>, Error> {
        let status = self.capture.status(ctx.shard.stream)?;
        if status.is_capturing() {
            if ctx.shard.pool == 0 || st.released {
                return Ok(Err(Served::Capturing(status)));
            }
            return match self.new_segment_relaxed(st, ctx, req) {
                Ok(id) => Ok(Ok(id)),
                Err(DriverError::OutOfMemory) => Ok(Err(Served::CapturingOom)),
                Err(e) => Err(Error::driver(e, "allocating a segment for a private pool during capture")),
            };
        }
        if st.has_capture_deferred() && !self.capture.capture_routed() {
            st.insert_deferred_events(ctx);
        }
        let underway = self.capture.any_underway();
        if collect && !underway && self.gc_due() {
            return Ok(Err(Served::Collect));
        }
        Ok(match self.grow(st, ctx, req, underway)? {
            Some(Growth::Block(id)) => Ok(id),
            Some(Growth::PastMark(short)) => Err(Served::PastMark(short)),
            None => Err(Served::OutOfMemory),
        })
    }

    /// A new ordinary segment made with the calling thread's capture mode relaxed, and the mode
    /// set back after (PyTorch's `CUDAStreamCaptureModeGuard` in `cudaMallocMaybeCapturing`).
    fn new_segment_relaxed(
        &self,
        st: &mut ShardState,
        ctx: &ShardCtx,
        req: &Request,
    ) -> Result<super::block::BlockId, DriverError> {
        let old = self.driver.exchange_capture_mode(CaptureMode::Relaxed)?;
        let _restore = scopeguard::guard((), |()| {
            let _ = self.driver.exchange_capture_mode(old);
        });
        st.new_segment(ctx, req)
    }

    /// [`ShardState::grow`], after releasing this stream's oversize segments if the device is
    /// out of memory (PyTorch `release_available_cached_blocks`); `None` when it still is.
    /// With [`Reclaim::Device`] and no other stream on the device, [`Reclaim::Shard`].
    ///
    /// `underway`: a capture may be under way on the device (see `capture`): the segment is
    /// made with the thread's capture mode relaxed, nothing is unmapped (which synchronises)
    /// and no cached segment is given back to make room.
    fn grow(
        &self,
        st: &mut ShardState,
        ctx: &ShardCtx,
        req: &Request,
        underway: bool,
    ) -> Result<Option<Growth>, Error> {
        // Without another stream there is nothing to unmap with this shard's lock dropped.
        let alone = ctx.reclaim == Reclaim::Device && self.shards.len() <= 1;
        let reclaim = if underway {
            Reclaim::Off
        } else if alone {
            Reclaim::Shard
        } else {
            ctx.reclaim
        };
        let grown = self.capture.relaxed_if_underway(underway, || st.grow(&ShardCtx { reclaim, ..*ctx }, req));
        match grown {
            Ok(g) => Ok(Some(g)),
            Err(DriverError::OutOfMemory) => {
                if underway || !st.release_available(ctx, req)? {
                    return Ok(None);
                }
                match st.grow(&ShardCtx { reclaim: Reclaim::Off, ..*ctx }, req) {
                    Ok(g) => Ok(Some(g)),
                    Err(DriverError::OutOfMemory) => Ok(None),
                    Err(e) => Err(Error::driver(e, "allocating a segment")),
                }
            }
            Err(e) => Err(Error::driver(e, "allocating a segment")),
        }
    }

    /// Ends a call on a shard the calling thread uses repeatedly (or a slow path).
    #[inline]
    fn finish<T>(&self, st: MutexGuard<'_, ShardState>, value: T) -> T {
        self.finish_call(st, value, true)
    }

    /// Ends a call on a shard: gives surplus credit back to the spare credit, covers a
    /// shortfall from it, unlocks, and settles the device peaks only if the spare credit could
    /// not cover. A shard that is not `hot` for the calling thread keeps no credit past the
    /// call (see `peaks`).
    #[inline]
    fn finish_call<T>(&self, mut st: MutexGuard<'_, ShardState>, value: T, hot: bool) -> T {
        let c = &mut st.counters;
        if c.has_surplus && hot {
            peaks::give_back(c, &self.spare, false);
        }
        let settle = c.needs_settle && !peaks::borrow(c, &self.spare);
        // Before the settle, which this shard may not be visited by (another settle may have
        // taken the dirty list it is on, and visited it, while it waited): a change after
        // that would go unseen by the next settle.
        if !hot {
            peaks::give_back(&mut st.counters, &self.spare, true);
        }
        if settle {
            // Unlocked meanwhile: the settle locks every shard it visits, this one included.
            MutexGuard::unlocked(&mut st, || {
                bump(&self.counters.num_peak_settles);
                self.visit(|t, shards, holds| peaks::settle(t, shards, &self.spare, holds));
            });
        }
        drop(st);
        value
    }

    /// PyTorch `free` on the block at `ptr` of `shard`'s segment at `segment`.
    ///
    /// A free keeps the credit it frees (as on a hot stream) whichever thread calls it: the
    /// next call on the shard, if the stream is not hot for its thread, gives it back, and a
    /// settle takes it back from a stream that went quiet.
    pub fn free(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<(), Error> {
        let ctx = self.ctx(shard);
        let mut st = self.shards.lock_for_change(shard);
        if self.history.on_or_tagged() {
            self.free_recorded(&mut st, shard, ptr, segment)?;
        } else {
            st.free(&ctx, ptr, segment)?;
        }
        if st.released {
            self.release_emptied(&mut st, &ctx);
        }
        self.finish(st, ());
        Ok(())
    }

    /// [`ShardState::free`] counted to the block's tag and with its events recorded while
    /// history is on, once it succeeded (a free that fails,
    /// or unwinds, leaves the block allocated and records nothing): `free_requested`, and
    /// `free_completed` when the block went back to its pool at once (no other stream used
    /// it); with the stack of the free if stacks are kept for frees, else the block's (PyTorch
    /// `free`).
    #[cold]
    #[inline(never)]
    fn free_recorded(
        &self,
        st: &mut ShardState,
        shard: &Arc<Shard>,
        ptr: DevicePtr,
        segment: DevicePtr,
    ) -> Result<(), Error> {
        let ctx = self.ctx(shard);
        let Some(freed) = st.about_to_free(&self.history, ptr) else { return st.free(&ctx, ptr, segment) };
        st.free(&ctx, ptr, segment)?;
        freed.record(&self.history, shard.stream);
        Ok(())
    }

    /// A free that waits for the next device synchronisation (see
    /// [`crate::Allocator::free_after_device_sync`]). Returns the device's deferred bytes.
    pub fn free_after_sync(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<usize, Error> {
        let ctx = self.ctx(shard);
        let mut st = self.shards.lock_for_change(shard);
        let freed = if self.history.on_or_tagged() { st.about_to_free(&self.history, ptr) } else { None };
        let bytes = st.free_after_sync(&ctx, ptr, segment)?;
        if let Some(mut freed) = freed {
            freed.at_once = false;
            freed.record(&self.history, shard.stream);
        }
        self.finish(st, ());
        Ok(bytes)
    }

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
            let mut st = self.shards.lock_for_change(&shard);
            if st.has_capture_deferred() && !self.capture.capture_routed() {
                st.insert_deferred_events(&ctx);
            }
            st.synchronize_events(&ctx)?;
            st.release_cached(&ctx)?;
            self.finish(st, ());
        }
        self.retire_idle_shards();
        self.prune_released();
        self.limit.reset_mark();
        Ok(())
    }

    /// Takes the shards that hold nothing out of the table (see `shard_table`), after a
    /// settle has counted what they did; credit one still holds goes to the spare credit.
    fn retire_idle_shards(&self) {
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
            let counters = &mut st.counters;
            for (i, (c, seen)) in counters.cells.iter_mut().zip(counters.seen.iter_mut()).enumerate() {
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

    fn settle_locked(&self, ps: &mut PeakState) {
        self.visit_locked(ps, |t, shards, holds| peaks::settle(t, shards, &self.spare, holds));
    }

    /// How many times a call had to lock every shard to settle the peaks (a diagnostic).
    pub fn peak_settles(&self) -> i64 {
        self.counters.num_peak_settles.load(Ordering::Relaxed)
    }

    /// PyTorch `getStats`: one consistent snapshot of the device's statistics.
    pub fn stats(&self) -> DeviceStats {
        self.visit(|t, shards, holds| {
            peaks::settle(t, shards, &self.spare, holds);
            counters::collect(t, &self.counters, self.max_split_size)
        })
    }

    /// PyTorch `resetPeakStats`.
    pub fn reset_peak_stats(&self) {
        self.visit(|t, shards, _| peaks::reset(t, shards, &self.spare));
        self.reset_pool_peaks();
        self.limit.reset_mark();
    }
}

/// The layout of `device`'s expandable segments, or `None` when the driver cannot map memory
/// there (or fails to say).
fn expandable_policy(driver: &dyn Driver, device: i32) -> Option<ExpandablePolicy> {
    let granularity = driver.vmm_granularity(device).ok()??;
    let total = driver.mem_info(device).ok()?.total;
    let small_page = SMALL_BUFFER.next_multiple_of(granularity);
    let large_page = LARGE_PAGE.next_multiple_of(granularity);
    Some(ExpandablePolicy { small_page, large_page, device_total: total })
}

impl Drop for DeviceAllocator {
    /// Gives back to the driver what is free: cached segments and idle events, after waiting
    /// for the pending events of freed blocks and for blocks awaiting a device synchronisation
    /// (as `empty_cache`). Live blocks, and the segments holding them, stay allocated until
    /// the process exits: gpupool cannot know whether the program still uses them.
    fn drop(&mut self) {
        if super::fork::check().is_ok() {
            let _ = self.release_cached_blocks();
        }
    }
}
