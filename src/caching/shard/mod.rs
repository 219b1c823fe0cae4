//! One stream's share of a device: its segments, its small and large pools, its blocks awaiting
//! events or a device synchronisation, and its statistics, all behind one lock.
//!
//! PyTorch keeps every stream of a device in one `DeviceCachingAllocator` under one mutex, and
//! a free block is only ever reused by the stream it was allocated on (its pools are ordered by
//! stream first). A segment's blocks therefore always belong to one stream, and gpupool gives
//! each stream its own shard: threads on different streams share no lock. The rules inside a
//! shard are PyTorch's, function for function; each method names the one it mirrors.
//!
//! - this file: the shard, a request, and the calls a device makes on it;
//! - [`blocks`]: splitting and merging blocks;
//! - [`segments`]: segments from and back to the driver;
//! - [`expand`]: expandable segments, grown and shrunk a page at a time;
//! - [`check`]: the consistency check and the diagnosis of a bad pointer;
//! - [`record`]: its events in the allocation history, and its segments for a snapshot.

mod blocks;
mod check;
mod expand;
mod gc;
mod record;
mod segments;

pub(crate) use expand::ExpandablePolicy;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::block::{Arena, BlockId, BlockState};
use super::counters::{DeviceCounters, Metric, OVERSIZE_ALLOCATIONS, ShardCounters};
use super::deferred::{DeferredFrees, DeferredList};
use super::events::StreamEvents;
use super::expandable::Expandable;
use super::limit::MemoryLimit;
use super::pool::FreePool;
use super::rules::{self, PoolKind, SizeRules};
use super::segment_index::SegmentIndex;
use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::Error;
use crate::history::HistoryHook;

/// A shard: the state of one (device, stream) pair of a pool behind its own lock: the
/// device's default pools (pool 0) or a private pool (see `device::pools`).
pub(crate) struct Shard {
    pub stream: StreamHandle,
    /// The private pool the shard belongs to; 0 for the device's default pools.
    pub pool: u64,
    /// Set, under the lock, when the shard is taken out of its device's table (see
    /// `shard_table`); a thread that kept it in its cache of recent shards then fetches the
    /// stream's new shard.
    retired: AtomicBool,
    state: Mutex<ShardState>,
}

impl Shard {
    pub fn new(pool: u64, stream: StreamHandle) -> Shard {
        Shard { stream, pool, retired: AtomicBool::new(false), state: Mutex::new(ShardState::default()) }
    }

    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, ShardState> {
        self.state.lock()
    }

    /// The lock if it is free now (`empty_cache` passes over a busy shard).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, ShardState>> {
        self.state.try_lock()
    }

    /// Whether the shard was retired; exact when read with its lock held.
    #[inline]
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Flags the shard retired; `st` is its locked state.
    pub fn retire(&self, st: &mut ShardState) {
        debug_assert!(st.is_idle());
        self.retired.store(true, Ordering::Relaxed);
    }
}

/// What a shard's operations need from its device: the driver, the device's settings and
/// shared state, and the shard itself (to index its new segments).
#[derive(Clone, Copy)]
pub(crate) struct ShardCtx<'a> {
    pub driver: &'a dyn Driver,
    pub device: i32,
    pub max_split_size: usize,
    pub index: &'a SegmentIndex<Arc<Shard>>,
    pub shard: &'a Arc<Shard>,
    pub limit: &'a MemoryLimit,
    pub counters: &'a DeviceCounters,
    pub deferred: &'a DeferredFrees,
    /// How expandable segments are laid out; `None` when the device uses ordinary segments.
    pub expandable: Option<&'a ExpandablePolicy>,
    /// What growing an expandable segment past the device's high-water mark does first.
    pub reclaim: Reclaim,
    /// The device's allocation history: each event is recorded while it is on.
    pub history: &'a HistoryHook,
    /// Whether a capture is under way, asked only before a call CUDA forbids during one.
    pub capture: &'a crate::caching::capture::CaptureProbe,
}

/// gpupool's rule for expandable segments (not in PyTorch, which unmaps pages only when the
/// cache is released): the device's reserved bytes do not pass their high-water mark while
/// wholly free pages are mapped anywhere on the device. Before an expandable segment grows
/// past the mark, free pages are unmapped instead (a device synchronisation, see
/// `ShardState::unmap_free_pages`), so that memory freed by one request or one stream holds
/// the next one's growth, wherever it must be mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reclaim {
    /// Grow without unmapping (the rule is off).
    Off,
    /// Unmap free pages of this shard, then grow.
    Shard,
    /// Unmap free pages of this shard; if that is not enough, answer [`Growth::PastMark`] so
    /// that the caller, holding no shard lock, unmaps other streams' pages first.
    Device,
}

/// What [`ShardState::grow`] obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Growth {
    /// A free block for the request, out of the pool.
    Block(BlockId),
    /// Nothing was mapped: the growth would take the device this many bytes past its
    /// high-water mark ([`Reclaim::Device`] only).
    PastMark(usize),
}

/// A request after PyTorch's rounding: `size` as asked, `rounded` (the block size), its pool
/// and the segment size to ask the driver for if nothing cached fits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub size: usize,
    pub rounded: usize,
    pub pool: PoolKind,
    pub segment: usize,
}

impl Request {
    /// `size` rounded and placed by the device's `rules`.
    ///
    /// Errors: [`Error::InvalidValue`] when rounding the size overflows.
    ///
    /// Inlined: malloc's hit path calls it, and out of line it cost a call there.
    #[inline(always)]
    pub fn new(size: usize, rules: &SizeRules) -> Result<Request, Error> {
        let overflow = || Error::InvalidValue(format!("size {size} bytes overflows when rounded to a block size"));
        let rounded = rules::round_size(size, rules).ok_or_else(overflow)?;
        let segment = rules::segment_size(rounded, rules).ok_or_else(overflow)?;
        Ok(Request { size, rounded, pool: rules::pool_for(rounded), segment })
    }
}

struct SegmentInfo {
    head: BlockId,
    /// Bytes: the segment's size, or an expandable segment's address range.
    size: usize,
    /// An expandable segment's page table.
    exp: Option<Box<Expandable>>,
    /// The stack of the call that made it in the history's table (PyTorch
    /// `context_when_segment_allocated`), 0 for none; as [`super::block::Block::ctx`].
    ctx: u32,
    /// A block of it was handed out while the allocating stream captured a CUDA graph: the
    /// graph's kernels use its addresses at every replay, so it stays reserved, wholly free or
    /// not, until its private pool is released (see `device::pools`).
    graph: bool,
}

/// The state behind a shard's lock.
#[derive(Default)]
pub(crate) struct ShardState {
    blocks: Arena,
    small: FreePool,
    large: FreePool,
    /// Allocated blocks by address (PyTorch `allocated_blocks`).
    live: FxHashMap<DevicePtr, BlockId>,
    segments: FxHashMap<DevicePtr, SegmentInfo>,
    /// The bases of the expandable segments among `segments`.
    expandables: Vec<DevicePtr>,
    /// Unmapped blocks of expandable segments, per pool, by address (PyTorch
    /// `BlockPool::unmapped`).
    unmapped: [BTreeSet<(DevicePtr, BlockId)>; 2],
    events: StreamEvents,
    deferred: DeferredList,
    pub counters: ShardCounters,
    /// The settle epoch in which the shard last joined its device's dirty list.
    pub dirty_epoch: u64,
    /// Blocks freed on this shard, wrapping (the clock of `garbage_collection_threshold`'s
    /// ages, see `device::gc`).
    frees: u32,
    /// The stack the history captured for the segment (or pages) the current malloc made,
    /// for the `alloc` event of its block (PyTorch gathers one context per malloc); 0 for none.
    pending_ctx: u32,
    /// Blocks freed while a capture was under way whose other streams (`record_stream`) need
    /// events, which may not be recorded and queried then: they wait, active, until no capture
    /// is (PyTorch `needs_events_deferred_until_no_capture`). Each is in
    /// [`BlockState::AwaitingEvents`] with no event yet.
    capture_deferred: Vec<BlockId>,
    /// The shard's private pool was released (`gpupool_release_pool`): its segments go back
    /// to the driver as soon as they are wholly free, and nothing is allocated from it again.
    pub released: bool,
}

impl ShardState {
    fn pool(&mut self, kind: PoolKind) -> &mut FreePool {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    fn pool_ref(&self, kind: PoolKind) -> &FreePool {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    /// PyTorch `get_free_block`: the best fit in the request's pool, within the
    /// `max_split_size` rules, taken out of the pool.
    #[inline]
    pub fn take_cached(&mut self, req: &Request, size_rules: &SizeRules) -> Option<BlockId> {
        let rounded = req.rounded;
        let fits = |size| rules::fits_oversize_rules(size, rounded, size_rules);
        self.pool(req.pool).take_best_fit(rounded, fits).map(|(_, _, id)| id)
    }

    /// The rest of PyTorch `malloc` once a block is found: split off what is not needed
    /// (`should_split`), mark it allocated and count it. Returns the block's address.
    #[inline]
    pub fn hand_out(&mut self, id: BlockId, req: &Request, max_split_size: usize) -> DevicePtr {
        let kept = self.split(id, req.rounded, max_split_size);
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = req.size;
        let (addr, pool) = (b.addr, b.pool);
        let c = &mut self.counters;
        c.increase(Metric::Allocation, pool, 1);
        c.increase(Metric::AllocatedBytes, pool, kept as i64);
        c.increase(Metric::Active, pool, 1);
        c.increase(Metric::ActiveBytes, pool, kept as i64);
        c.increase(Metric::RequestedBytes, pool, req.size as i64);
        if kept >= max_split_size {
            c.increase_single(OVERSIZE_ALLOCATIONS);
        }
        self.live.insert(addr, id);
        addr
    }

    /// PyTorch `free`: the block stops being allocated; if other streams used it
    /// (`record_stream`), one event per such stream is recorded and the block waits for them
    /// (PyTorch `insert_events`), else it goes back to its pool at once (`free_block`).
    ///
    /// If an event cannot be created or recorded (the driver is out of memory for it, say),
    /// the block waits for gpupool's next device synchronisation instead (see `deferred`),
    /// which `empty_cache` and the out-of-memory path make: the free succeeds, and the block is
    /// not reused while work queued before the free may still use it. Not in PyTorch, whose
    /// free fails then.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer that is not an allocated block of this
    /// shard (`segment` is the base of the segment that contains it); nothing changed.
    ///
    /// Inlined into both of the device's paths, with and without the history, so that the
    /// path without keeps the code it would have alone (the cache-hit free).
    #[inline(always)]
    pub fn free(&mut self, ctx: &ShardCtx, ptr: DevicePtr, segment: DevicePtr) -> Result<(), Error> {
        let Some(&id) = self.live.get(&ptr) else {
            return Err(self.diagnose(ptr, segment));
        };
        if !self.blocks[id].stream_uses.is_empty() {
            return self.free_used(ctx, ptr, id);
        }
        self.live.remove(&ptr);
        self.count_free(id, ctx.max_split_size);
        self.free_block(id);
        Ok(())
    }

    /// [`ShardState::free`] of a block that other streams used: one event per stream, or, while
    /// a capture is under way (a route to a private pool is active on the device, or one of
    /// the streams that used it captures: not the block's own, which the program may have
    /// destroyed and which gets no event), no event yet: recording one into a capture and querying it
    /// later is illegal, so the block waits in `capture_deferred` (PyTorch `free`, with
    /// `insert_events_deferred_until_no_capture`).
    #[cold]
    #[inline(never)]
    fn free_used(&mut self, ctx: &ShardCtx, ptr: DevicePtr, id: BlockId) -> Result<(), Error> {
        if ctx.capture.underway(self.blocks[id].stream_uses.iter().copied()) {
            self.live.remove(&ptr);
            self.count_free(id, ctx.max_split_size);
            let b = &mut self.blocks[id];
            b.state = BlockState::AwaitingEvents;
            b.event_count = 0;
            self.capture_deferred.push(id);
            return Ok(());
        }
        // Events first, the block's state after: a driver call that fails or unwinds leaves
        // the block allocated, as it was.
        let mut recorded = Vec::new();
        for &stream in &self.blocks[id].stream_uses {
            match self.events.record(ctx.driver, ctx.device, stream) {
                Ok(ev) => recorded.push((stream, ev)),
                Err(_) => {
                    self.events.unused(recorded.iter().map(|r| r.1));
                    self.live.remove(&ptr);
                    self.defer(ctx, id);
                    return Ok(());
                }
            }
        }
        self.live.remove(&ptr);
        self.count_free(id, ctx.max_split_size);
        let b = &mut self.blocks[id];
        b.stream_uses = Box::default();
        b.state = BlockState::AwaitingEvents;
        b.event_count = recorded.len() as u32;
        for (stream, ev) in recorded {
            self.events.push(stream, ev, id);
        }
        Ok(())
    }

    /// Records the events of the blocks freed during a capture (see `capture_deferred`) once
    /// no capture is under way on their streams (PyTorch
    /// `insert_events_deferred_until_no_capture`). A block whose event cannot be recorded
    /// waits for the next device synchronisation instead, as in [`ShardState::free`].
    pub fn insert_deferred_events(&mut self, ctx: &ShardCtx) {
        let ids = std::mem::take(&mut self.capture_deferred);
        let mut waiting = Vec::new();
        for id in ids {
            if ctx.capture.underway(self.blocks[id].stream_uses.iter().copied()) {
                waiting.push(id);
                continue;
            }
            let uses = std::mem::take(&mut self.blocks[id].stream_uses);
            let mut recorded = Vec::new();
            let mut failed = false;
            for &stream in uses.iter() {
                match self.events.record(ctx.driver, ctx.device, stream) {
                    Ok(ev) => recorded.push((stream, ev)),
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            if failed {
                self.events.unused(recorded.iter().map(|r| r.1));
                let b = &mut self.blocks[id];
                b.state = BlockState::AwaitingSync;
                let size = b.size;
                self.deferred.push(id, ctx.deferred.epoch());
                ctx.deferred.add(size);
                continue;
            }
            self.blocks[id].event_count = recorded.len() as u32;
            for (stream, ev) in recorded {
                self.events.push(stream, ev, id);
            }
        }
        waiting.append(&mut self.capture_deferred);
        self.capture_deferred = waiting;
    }

    /// Whether blocks freed during a capture wait for it to end.
    #[inline]
    pub fn has_capture_deferred(&self) -> bool {
        !self.capture_deferred.is_empty()
    }

    /// The statistics of a block that stops being allocated (it stays active until
    /// `free_block`).
    fn count_free(&mut self, id: BlockId, max_split_size: usize) {
        let b = &self.blocks[id];
        let (size, pool) = (b.size, b.pool);
        self.counters.decrease(Metric::Allocation, pool, 1);
        self.counters.decrease(Metric::AllocatedBytes, pool, size as i64);
        if size >= max_split_size {
            self.counters.decrease_single(OVERSIZE_ALLOCATIONS);
        }
    }

    /// Whether events of freed blocks are pending (the hit path's test).
    #[inline(always)]
    pub fn events_pending(&self) -> bool {
        !self.events.is_empty()
    }

    /// PyTorch `process_events`: returns to their pools the blocks whose events have all
    /// completed. Never blocks; no driver call when nothing is pending.
    ///
    /// Errors: [`Error::Cuda`] when a query fails (even for lack of memory: it is no
    /// allocation); that event stays pending.
    #[inline]
    pub fn process_events(&mut self, ctx: &ShardCtx) -> Result<(), Error> {
        if self.events.is_empty() {
            return Ok(());
        }
        self.drain_events(ctx, false)
    }

    /// PyTorch `synchronize_and_free_events`: waits for every pending event of this shard and
    /// returns the blocks to their pools.
    pub fn synchronize_events(&mut self, ctx: &ShardCtx) -> Result<(), Error> {
        self.drain_events(ctx, true)
    }

    fn drain_events(&mut self, ctx: &ShardCtx, wait: bool) -> Result<(), Error> {
        // The events are out of the state while they drain (each completed one is handled as
        // it is found), and back in on every exit, unwinding included.
        let events = std::mem::take(&mut self.events);
        let mut g = scopeguard::guard((self, events), |(st, events)| st.events = events);
        let (st, events) = &mut *g;
        let result = events.drain(ctx.driver, wait, |id| {
            let b = &mut st.blocks[id];
            b.event_count -= 1;
            if b.event_count == 0 {
                if ctx.history.on() {
                    st.record_free_completed(ctx.history, ctx.shard.stream, id);
                }
                st.free_block(id);
            }
        });
        result.map_err(|e| Error::driver_call(e, "waiting for the events of freed blocks"))
    }

    /// PyTorch `recordStream`: the block at `ptr` is in use on `stream` as well; when freed it
    /// waits for the work issued there so far. Uses on the owning stream need no event.
    ///
    /// Errors: [`Error::InvalidPointer`] when `ptr` is not an allocated block of this shard.
    pub fn record_stream(
        &mut self,
        ptr: DevicePtr,
        segment: DevicePtr,
        owner: StreamHandle,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        let Some(&id) = self.live.get(&ptr) else {
            return Err(self.diagnose(ptr, segment));
        };
        let b = &mut self.blocks[id];
        if stream != owner && !b.stream_uses.contains(&stream) {
            b.add_stream_use(stream);
        }
        Ok(())
    }

    /// A free whose block waits for the next device synchronisation instead of events (see
    /// `deferred`): it stops being allocated now and stays active until
    /// [`ShardState::release_synced`] (a device synchronisation waits for every stream, so
    /// streams named by `record_stream` need no event). Returns the device's deferred bytes.
    ///
    /// Errors: [`Error::InvalidPointer`] as [`ShardState::free`], nothing changed.
    pub fn free_after_sync(&mut self, ctx: &ShardCtx, ptr: DevicePtr, segment: DevicePtr) -> Result<usize, Error> {
        let Some(id) = self.live.remove(&ptr) else {
            return Err(self.diagnose(ptr, segment));
        };
        Ok(self.defer(ctx, id))
    }

    /// Frees the allocated block `id`, out of the live map already, to wait for the device's
    /// next synchronisation. Returns the device's deferred bytes.
    fn defer(&mut self, ctx: &ShardCtx, id: BlockId) -> usize {
        self.count_free(id, ctx.max_split_size);
        let b = &mut self.blocks[id];
        b.stream_uses = Box::default();
        b.state = BlockState::AwaitingSync;
        let size = b.size;
        self.deferred.push(id, ctx.deferred.epoch());
        ctx.deferred.add(size)
    }

    /// Returns to their pools the blocks freed in epochs up to `epoch`, which a device
    /// synchronisation has covered. Returns (blocks, bytes) released.
    pub fn release_synced(&mut self, ctx: &ShardCtx, epoch: u64) -> (usize, usize) {
        let synced = self.deferred.take_synced(epoch);
        let mut bytes = 0;
        for &id in &synced {
            bytes += self.blocks[id].size;
            if ctx.history.on() {
                self.record_free_completed(ctx.history, ctx.shard.stream, id);
            }
            self.free_block(id);
        }
        (synced.len(), bytes)
    }

    /// Whether the shard holds nothing: no segment (so no block), no event, no deferred free.
    /// Its counters' current values are then all zero.
    pub fn is_idle(&self) -> bool {
        self.segments.is_empty() && self.events.is_unused() && self.deferred.len() == 0
    }

    /// Flags as used by a CUDA graph the segment holding the allocated block at `ptr` (see
    /// `SegmentInfo::graph`).
    pub fn mark_graph(&mut self, ptr: DevicePtr) {
        let Some(&id) = self.live.get(&ptr) else { return };
        let mut head = id;
        while self.blocks[head].prev != super::block::NIL {
            head = self.blocks[head].prev;
        }
        let base = self.blocks[head].addr;
        if let Some(seg) = self.segments.get_mut(&base) {
            seg.graph = true;
        }
    }

    /// Lets every segment go back to the driver once wholly free: the pool is released.
    pub fn release_graph_segments(&mut self) {
        self.released = true;
        for seg in self.segments.values_mut() {
            seg.graph = false;
        }
    }

    /// Whether the segment at `base` may go back to the driver when wholly free: not while a
    /// live CUDA graph may use it.
    fn releasable(&self, base: DevicePtr) -> bool {
        self.segments.get(&base).is_none_or(|s| !s.graph)
    }

    /// Segments of the shard (for the check).
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Segments a CUDA graph keeps reserved (for the statistics of pools and the check).
    pub fn graph_segments(&self) -> usize {
        self.segments.values().filter(|s| s.graph).count()
    }

    /// Size bins of both pools, empty or not (host memory, for tests).
    pub fn bin_count(&self) -> usize {
        self.small.bin_count() + self.large.bin_count()
    }

    /// The largest free block of the small and of the large pool, in bytes (0: none); blocks
    /// awaiting events or a synchronisation, and unmapped pages, are not free.
    pub fn largest_free(&self) -> [usize; 2] {
        [self.small.largest().unwrap_or(0), self.large.largest().unwrap_or(0)]
    }

    /// The size in bytes (rounded, as counted in `allocated_bytes`) of the allocated block at
    /// `ptr`, or `None` when `ptr` is not the start of an allocated block.
    pub fn allocated_size(&self, ptr: DevicePtr) -> Option<usize> {
        self.live.get(&ptr).map(|&id| self.blocks[id].size)
    }
}
