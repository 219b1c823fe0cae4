//! Serving a request from a shard: PyTorch's `DeviceCachingAllocator::malloc` up to its
//! first failure (`process_events`, the best cached fit, a new segment, the release of this
//! stream's oversize segments and a new segment again), with the detours of expandable
//! segments, `garbage_collection_threshold` and CUDA graph captures.

use std::sync::Arc;

use super::DeviceAllocator;
use crate::caching::block::BlockId;
use crate::caching::capture;
use crate::caching::shard::{
    Growth, PageWait, Reclaim, Request, Shard, ShardCtx, ShardState, release_smaller, smaller_pages,
};
use crate::driver::{CaptureMode, CaptureStatus, DevicePtr, DriverError, StreamHandle};
use crate::error::Error;
use crate::history::{HistoryContext, tags};

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
    /// No cached block fits, and growing would pass the device's high-water mark while other
    /// streams may hold cache they no longer use: the caller, holding no shard lock, releases
    /// it first (see `stranded`).
    Stranded,
}

impl DeviceAllocator {
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
    ///
    /// The error is boxed so that the answer fits two registers (see `free_if_listed`): a
    /// `Result<DevicePtr, Error>` went through the stack at the hit path's joins.
    #[inline(always)]
    pub fn malloc(&self, shard: &Arc<Shard>, size: usize, hot: bool) -> Result<DevicePtr, Box<Error>> {
        let Some(req) = Request::fits(size, &self.rules) else {
            return Err(Box::new(Request::overflow(size)));
        };
        self.malloc_req(shard, &req, hot, false)
    }

    /// [`DeviceAllocator::malloc`] of a rounded request. `graph`: the stream captures into a
    /// private pool, whose segment the block is from is then kept for the graph. Inlined into
    /// both callers: called out of line, the hit path paid about 35 instructions a malloc
    /// (callgrind, `examples/hit_loop`). While history is on, out of line
    /// ([`DeviceAllocator::malloc_recorded`]).
    #[inline(always)]
    pub(in crate::caching) fn malloc_req(
        &self,
        shard: &Arc<Shard>,
        req: &Request,
        hot: bool,
        graph: bool,
    ) -> Result<DevicePtr, Box<Error>> {
        if self.history.on() {
            return self.malloc_recorded(shard, req, hot, graph);
        }
        self.malloc_body(shard, req, hot, graph, true)
    }

    /// [`DeviceAllocator::malloc_req`] while history is on: the calling thread's Python frames
    /// are read first, before any lock (see `crate::history`'s `python`), for the stacks the
    /// call captures.
    #[cold]
    #[inline(never)]
    fn malloc_recorded(
        &self,
        shard: &Arc<Shard>,
        req: &Request,
        hot: bool,
        graph: bool,
    ) -> Result<DevicePtr, Box<Error>> {
        let _python = self.history.python_scope(HistoryContext::State);
        // The thread ended while it waited for the GIL (`crate::callout`): nothing allocated.
        crate::callout::raise_if_exiting();
        self.malloc_body(shard, req, hot, graph, false)
    }

    /// The body of [`DeviceAllocator::malloc_req`]; `off`: history was off at the call's start
    /// (only tags are then looked at: the flag was read already).
    #[inline(always)]
    fn malloc_body(
        &self,
        shard: &Arc<Shard>,
        req: &Request,
        hot: bool,
        graph: bool,
        off: bool,
    ) -> Result<DevicePtr, Box<Error>> {
        let mut st = self.shards.lock_hot_for_change(shard);
        let detour = if !shard.is_retired() {
            // Made only where a slow path needs it: built on the hit path, it cost 15
            // instructions a call (callgrind, `tests/c/hit_loop.c`).
            let ctx = || self.ctx(shard);
            self.process_events(&mut st, ctx)?;
            match self.serve(&mut st, ctx, req, true)? {
                Served::Block(ptr) => {
                    if graph {
                        st.mark_graph(ptr);
                    }
                    if if off { tags::in_use() } else { self.history.on_or_tagged() } {
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
        self.malloc_detour(shard, req, detour).map_err(Box::new)
    }

    /// The rest of [`DeviceAllocator::malloc_body`] when the cache did not serve the request,
    /// with no shard lock held: the detour `detour` asks for, then the stream's current shard
    /// again and the out-of-memory path. Out of line, so that the detours' code stays out of
    /// the hit path's (inlined there, a change in any of them moved the hit loop's count by
    /// two instructions a pair under callgrind).
    ///
    /// A thread ended in a callout on the way (an observer: `crate::callout`) ends here, its
    /// block given back ([`DeviceAllocator::end_of_malloc`]).
    #[cold]
    #[inline(never)]
    fn malloc_detour(&self, shard: &Arc<Shard>, req: &Request, detour: Option<Served>) -> Result<DevicePtr, Error> {
        let deferred = crate::callout::Deferred::enter();
        let r = self.detour_body(shard, req, detour);
        drop(deferred);
        self.end_of_malloc(r)
    }

    /// The work of [`DeviceAllocator::malloc_detour`].
    fn detour_body(&self, shard: &Arc<Shard>, req: &Request, detour: Option<Served>) -> Result<DevicePtr, Error> {
        match detour {
            Some(Served::PastMark(short)) => self.unmap_other_streams(shard, short, req),
            Some(Served::Collect) => {
                self.collect_garbage();
            }
            Some(Served::Stranded) => {
                self.release_unused_streams(shard);
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
    pub(in crate::caching) fn process_events<'c>(
        &self,
        st: &mut ShardState,
        ctx: impl FnOnce() -> ShardCtx<'c>,
    ) -> Result<(), Error> {
        if st.events_pending() { self.process_events_slow(st, &ctx()) } else { Ok(()) }
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
    /// expandable segments, of the page size `req` grows, are unmapped, `want` bytes of them
    /// if they have that many, each shard locked in turn (the caller holds none); if they are
    /// too few, their free pages of the smaller sizes too, whose handles are released until
    /// `want` bytes are (the rule across page sizes, `expandable::cross`). A failure
    /// leaves those pages cached, or those handles held.
    fn unmap_other_streams(&self, shard: &Arc<Shard>, want: usize, req: &Request) {
        // Only pages of the size the growth maps serve it (see `ExpandablePolicy::page_for`).
        let page = self.expandable.map(|p| p.page_for(req.pool, req.rounded));
        let mut left = want;
        // Then, if the growth's size was not enough, each smaller size, released (`cross`).
        let smaller = page.map_or(Vec::new(), |p| smaller_pages(&self.ctx(shard), p));
        for only in std::iter::once(page).chain(smaller.iter().map(|&s| Some(s))) {
            for other in self.shards.all() {
                if left == 0 {
                    return;
                }
                if Arc::ptr_eq(&other, shard) {
                    continue;
                }
                let ctx = self.ctx(&other);
                let mut st = self.shards.lock_for_change(&other);
                if other.is_retired() {
                    continue;
                }
                // The other stream may have been destroyed: the device is synchronised.
                let unmapped = st.unmap_free_pages(&ctx, left, None, only, PageWait::Device).unwrap_or(0);
                left = left.saturating_sub(match page {
                    Some(page) if only != Some(page) => release_smaller(&ctx, page, left),
                    _ => unmapped,
                });
                self.finish(st, ());
            }
        }
    }

    /// [`DeviceAllocator::serve`] on the current shard of `stream` (its shard may have been
    /// retired by `empty_cache` meanwhile), growing past the high-water mark once this
    /// shard's free pages are unmapped ([`Reclaim::Shard`]): the other streams' were, or
    /// the device is out of memory.
    pub(in crate::caching) fn serve_stream(
        &self,
        pool: u64,
        stream: StreamHandle,
        req: &Request,
    ) -> Result<Option<DevicePtr>, Error> {
        loop {
            let shard = self.shards.get_or_create(pool, stream);
            let mut st = self.shards.lock_for_change(&shard);
            if shard.is_retired() {
                continue;
            }
            let mut ctx = self.ctx(&shard);
            ctx.reclaim = ctx.reclaim.min(Reclaim::Shard);
            self.process_events(&mut st, || ctx)?;
            return Ok(match self.serve(&mut st, || ctx, req, false)? {
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
                Served::PastMark(_) | Served::Collect | Served::Stranded => {
                    unreachable!("only with Reclaim::Device, or collect")
                }
            });
        }
    }

    /// A block for `req` from the cache or from the driver. `collect`: answer
    /// [`Served::Collect`] rather than growing when `garbage_collection_threshold` is due, and
    /// [`Served::Stranded`] when unused streams' cache should be released first. Its
    /// `alloc` event is the caller's to record (see [`ShardState::record_alloc_at`]).
    ///
    /// Inlined up to the front cache's hit; the rest out of line
    /// ([`DeviceAllocator::serve_merged`]).
    #[inline(always)]
    fn serve<'c>(
        &self,
        st: &mut ShardState,
        ctx: impl FnOnce() -> ShardCtx<'c>,
        req: &Request,
        collect: bool,
    ) -> Result<Served, Error> {
        if let Some(id) = st.take_front(req.rounded, req.pool) {
            return Ok(Served::Block(st.hand_out_whole(id, req, self.max_split_size)));
        }
        self.serve_merged(st, ctx, req, collect)
    }

    /// [`DeviceAllocator::serve`] of a request the front cache does not hold.
    #[inline(never)]
    fn serve_merged<'c>(
        &self,
        st: &mut ShardState,
        ctx: impl FnOnce() -> ShardCtx<'c>,
        req: &Request,
        collect: bool,
    ) -> Result<Served, Error> {
        // Any other request is served as PyTorch serves it, from the merged pools: the best
        // fit over blocks merged at their free (a fit among the unmerged ones split other
        // blocks than PyTorch's, and reserved 2% more on vit_train).
        st.drain_front();
        let id = match st.take_cached(req, &self.rules) {
            Some(id) => id,
            None => match self.serve_miss(st, &ctx(), req, collect)? {
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
    ) -> Result<Result<BlockId, Served>, Error> {
        if ctx.segments.on() && crate::caching::observers::segments::observing() {
            return Err(Error::InvalidValue(format!(
                "a request of {} bytes on device {} needs a new segment, and was made from inside a segment observer, \
                 which may not allocate from gpupool (docs/observers.md)",
                req.size, ctx.device
            )));
        }
        // A refusal of a budget's seen by an earlier call is no news for this one.
        crate::caching::budget::take_refusal();
        let status = self.capture.status(ctx.shard.stream)?;
        if status.is_capturing() {
            if ctx.shard.pool == 0 || st.released {
                return Ok(Err(Served::Capturing(status)));
            }
            return match self.new_segment_relaxed(st, ctx, req) {
                Ok(id) => Ok(Ok(grown(st, id))),
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
        if collect && !underway && self.stranded_due(ctx.shard, req.segment) {
            return Ok(Err(Served::Stranded));
        }
        Ok(match self.grow(st, ctx, req, underway)? {
            Some(Growth::Block(id)) => Ok(grown(st, id)),
            Some(Growth::PastMark(short)) => Err(Served::PastMark(short)),
            None => Err(Served::OutOfMemory),
        })
    }
}

/// Block `id`, made by a growth: when observers were told of the growth (queued, for the end of
/// the call), noted as the call's block (`crate::callout`), so that a thread an observer ends
/// gives it back (`DeviceAllocator::finish_slow`): the program never gets it.
fn grown(st: &ShardState, id: BlockId) -> BlockId {
    if !st.segment_events.is_empty() {
        crate::callout::note_block(st.block_addr(id));
    }
    id
}

impl DeviceAllocator {
    /// A new ordinary segment made with the calling thread's capture mode relaxed, and the mode
    /// set back after (PyTorch's `CUDAStreamCaptureModeGuard` in `cudaMallocMaybeCapturing`).
    fn new_segment_relaxed(&self, st: &mut ShardState, ctx: &ShardCtx, req: &Request) -> Result<BlockId, DriverError> {
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
}
