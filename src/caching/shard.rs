//! One stream's share of a device: its segments, its small and large pools, its blocks awaiting
//! events, and its statistics, all behind one lock.
//!
//! PyTorch keeps every stream of a device in one `DeviceCachingAllocator` under one mutex, and
//! a free block is only ever reused by the stream it was allocated on (its pools are ordered by
//! stream first). A segment's blocks therefore always belong to one stream, and gpupool gives
//! each stream its own shard: threads on different streams share no lock. The rules inside a
//! shard are PyTorch's, function for function; each method names the one it mirrors.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::block::{Arena, Block, BlockId, BlockState, NIL};
use super::pool::FreePool;
use super::rules::{self, PoolKind};
use super::segment_index::{SegmentEntry, SegmentIndex};
use crate::driver::{DevicePtr, Driver, DriverError, EventHandle, StreamHandle};
use crate::error::Error;
use crate::stats::{DeviceCounters, Metric, OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS, ShardCounters};

/// A shard: the state of one (device, stream) pair behind its own lock.
pub(crate) struct Shard {
    pub stream: StreamHandle,
    state: Mutex<ShardState>,
}

impl Shard {
    pub fn new(stream: StreamHandle) -> Shard {
        Shard { stream, state: Mutex::new(ShardState::default()) }
    }

    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, ShardState> {
        self.state.lock()
    }
}

/// What a shard operation needs from its device.
pub(crate) struct Env<'a> {
    pub driver: &'a dyn Driver,
    pub device: i32,
    pub max_split_size: usize,
    pub index: &'a SegmentIndex,
    pub shard: &'a Arc<Shard>,
    pub counters: &'a DeviceCounters,
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
    /// Errors: [`Error::InvalidValue`] when rounding the size overflows.
    pub fn new(size: usize) -> Result<Request, Error> {
        let overflow = || Error::InvalidValue(format!("size {size} bytes overflows when rounded to a block size"));
        let rounded = rules::round_size(size).ok_or_else(overflow)?;
        let segment = rules::segment_size(rounded).ok_or_else(overflow)?;
        Ok(Request { size, rounded, pool: rules::pool_for(rounded), segment })
    }
}

struct SegmentInfo {
    head: BlockId,
    size: usize,
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
    /// Per stream that used a freed block, its events in recording order (PyTorch
    /// `cuda_events`, keyed by stream).
    pending: Vec<(StreamHandle, VecDeque<(EventHandle, BlockId)>)>,
    pending_count: usize,
    /// Blocks awaiting a device synchronisation, with the device's synchronisation epoch when
    /// they were freed: a synchronisation that began in a later epoch covers them.
    deferred: Vec<(BlockId, u64)>,
    /// Completed events kept for reuse (PyTorch `EventPool`).
    spare_events: Vec<EventHandle>,
    pub counters: ShardCounters,
}

impl ShardState {
    fn pool(&mut self, kind: PoolKind) -> &mut FreePool {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    /// PyTorch `get_free_block`: the best fit in the request's pool, within the
    /// `max_split_size` rules, taken out of the pool.
    #[inline]
    pub fn take_cached(&mut self, req: &Request, max_split_size: usize) -> Option<BlockId> {
        let rounded = req.rounded;
        let fits = |size| rules::fits_oversize_rules(size, rounded, max_split_size);
        self.pool(req.pool).take_best_fit(rounded, fits).map(|(_, _, id)| id)
    }

    /// PyTorch `alloc_block`: a new segment from the driver, as one free block (not in the
    /// pool: the caller hands it out at once).
    ///
    /// A device with a memory fraction set refuses a segment that would take its reserved
    /// bytes past the limit, as out of memory (PyTorch `alloc_block` with `set_fraction`).
    pub fn new_segment(&mut self, env: &Env, req: &Request) -> Result<BlockId, DriverError> {
        let size = req.segment;
        if !env.counters.try_reserve(size) {
            return Err(DriverError::OutOfMemory);
        }
        let addr = match env.driver.mem_alloc(env.device, size) {
            Ok(addr) => addr,
            Err(e) => {
                env.counters.unreserve(size);
                return Err(e);
            }
        };
        let id = self.blocks.insert(Block {
            addr,
            size,
            requested: 0,
            prev: NIL,
            next: NIL,
            state: BlockState::Free,
            pool: req.pool,
            event_count: 0,
            stream_uses: Vec::new(),
        });
        self.segments.insert(addr, SegmentInfo { head: id, size });
        env.index.insert(SegmentEntry { base: addr, size, device: env.device, shard: env.shard.clone() });
        self.counters.increase(Metric::Segment, req.pool, 1);
        self.counters.increase(Metric::ReservedBytes, req.pool, size as i64);
        if size >= env.max_split_size {
            self.counters.increase_single(OVERSIZE_SEGMENTS);
        }
        DeviceCounters::bump(&env.counters.num_device_alloc);
        Ok(id)
    }

    /// The rest of PyTorch `malloc` once a block is found: split off what is not needed
    /// (`should_split`), mark it allocated and count it, with PyTorch's `inactive_split`
    /// bookkeeping. Returns the block's address.
    #[inline]
    pub fn hand_out(&mut self, id: BlockId, req: &Request, max_split_size: usize) -> DevicePtr {
        let b = &self.blocks[id];
        let (addr, size, pool, next) = (b.addr, b.size, b.pool, b.next);
        let already_split = b.is_split();
        let mut kept = size;
        if rules::should_split(pool, size, req.rounded, max_split_size) {
            kept = req.rounded;
            let rest_size = size - kept;
            let rest = self.blocks.insert(Block {
                addr: addr + kept as u64,
                size: rest_size,
                requested: 0,
                prev: id,
                next,
                state: BlockState::Free,
                pool,
                event_count: 0,
                stream_uses: Vec::new(),
            });
            if next != NIL {
                self.blocks[next].prev = rest;
            }
            let b = &mut self.blocks[id];
            b.size = kept;
            b.next = rest;
            self.pool(pool).insert(rest_size, addr + kept as u64, rest);
            if already_split {
                // An inactive split block shrinks by the part handed out.
                self.counters.decrease(Metric::InactiveSplitBytes, pool, kept as i64);
            } else {
                // A new inactive split block: the remainder of a formerly whole segment.
                self.counters.increase(Metric::InactiveSplitBytes, pool, rest_size as i64);
                self.counters.increase(Metric::InactiveSplit, pool, 1);
            }
        } else if already_split {
            // An inactive split block becomes active whole.
            self.counters.decrease(Metric::InactiveSplitBytes, pool, size as i64);
            self.counters.decrease(Metric::InactiveSplit, pool, 1);
        }
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = req.size;
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
    /// Errors: [`Error::InvalidPointer`] for a pointer that is not an allocated block of this
    /// shard (`segment` is the base of the segment that contains it); [`Error::Cuda`] if an
    /// event cannot be recorded, in which case the block stays allocated and nothing changed.
    pub fn free(&mut self, env: &Env, ptr: DevicePtr, segment: DevicePtr) -> Result<(), Error> {
        let Some(id) = self.live.remove(&ptr) else {
            return Err(self.diagnose(ptr, segment, "gpupool_free"));
        };
        if self.blocks[id].stream_uses.is_empty() {
            self.count_free(id, env.max_split_size);
            self.free_block(id);
            return Ok(());
        }
        let uses = std::mem::take(&mut self.blocks[id].stream_uses);
        let mut recorded = Vec::with_capacity(uses.len());
        for &stream in &uses {
            match self.record_event(env, stream) {
                Ok(ev) => recorded.push((stream, ev)),
                Err(e) => {
                    // Undo: the block stays allocated, as it was.
                    self.spare_events.extend(recorded.iter().map(|r| r.1));
                    self.blocks[id].stream_uses = uses;
                    self.live.insert(ptr, id);
                    return Err(Error::driver(e, "recording the event of a stream given to gpupool_record_stream"));
                }
            }
        }
        self.count_free(id, env.max_split_size);
        let b = &mut self.blocks[id];
        b.state = BlockState::AwaitingEvents;
        b.event_count = recorded.len() as u32;
        for (stream, ev) in recorded {
            match self.pending.iter_mut().find(|q| q.0 == stream) {
                Some(q) => q.1.push_back((ev, id)),
                None => self.pending.push((stream, VecDeque::from([(ev, id)]))),
            }
            self.pending_count += 1;
        }
        Ok(())
    }

    fn count_free(&mut self, id: BlockId, max_split_size: usize) {
        let b = &self.blocks[id];
        let (size, pool) = (b.size, b.pool);
        self.counters.decrease(Metric::Allocation, pool, 1);
        self.counters.decrease(Metric::AllocatedBytes, pool, size as i64);
        if size >= max_split_size {
            self.counters.decrease_single(OVERSIZE_ALLOCATIONS);
        }
    }

    fn record_event(&mut self, env: &Env, stream: StreamHandle) -> Result<EventHandle, DriverError> {
        let ev = match self.spare_events.pop() {
            Some(ev) => ev,
            None => env.driver.event_create(env.device)?,
        };
        match env.driver.event_record(env.device, ev, stream) {
            Ok(()) => Ok(ev),
            Err(e) => {
                self.spare_events.push(ev);
                Err(e)
            }
        }
    }

    /// PyTorch `free_block`: back to the pool, merged with free neighbours
    /// (`try_merge_blocks`), with PyTorch's net `inactive_split` change.
    fn free_block(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (orig_size, requested, pool) = (b.size, b.requested, b.pool);
        let mut net_blocks = 0i64;
        let mut net_bytes = 0i64;
        let mut id = id;
        let prev = self.blocks[id].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Free {
            let (psize, paddr) = (self.blocks[prev].size, self.blocks[prev].addr);
            self.pool(pool).remove(psize, paddr, prev);
            self.absorb_next(prev);
            id = prev;
            net_blocks -= 1;
            net_bytes -= psize as i64;
        }
        let next = self.blocks[id].next;
        if next != NIL && self.blocks[next].state == BlockState::Free {
            let (nsize, naddr) = (self.blocks[next].size, self.blocks[next].addr);
            self.pool(pool).remove(nsize, naddr, next);
            self.absorb_next(id);
            net_blocks -= 1;
            net_bytes -= nsize as i64;
        }
        let b = &mut self.blocks[id];
        b.state = BlockState::Free;
        b.requested = 0;
        let (size, addr, split) = (b.size, b.addr, b.is_split());
        self.pool(pool).insert(size, addr, id);
        if split {
            net_blocks += 1;
            net_bytes += size as i64;
        }
        let c = &mut self.counters;
        c.change(Metric::InactiveSplit, pool, net_blocks);
        c.change(Metric::InactiveSplitBytes, pool, net_bytes);
        c.decrease(Metric::Active, pool, 1);
        c.decrease(Metric::ActiveBytes, pool, orig_size as i64);
        c.decrease(Metric::RequestedBytes, pool, requested as i64);
    }

    /// Merges the block after `id` into `id` (the lower block survives, so a segment's head
    /// keeps its id).
    fn absorb_next(&mut self, id: BlockId) {
        let next = self.blocks[id].next;
        let (nsize, nnext) = (self.blocks[next].size, self.blocks[next].next);
        let b = &mut self.blocks[id];
        b.size += nsize;
        b.next = nnext;
        if nnext != NIL {
            self.blocks[nnext].prev = id;
        }
        self.blocks.remove(next);
    }

    /// PyTorch `process_events`: returns to their pools the blocks whose events have all
    /// completed, querying each stream's events in order and stopping at the first that has not.
    /// Never blocks; no driver call when nothing is pending.
    ///
    /// Errors: [`Error::Cuda`] when a query fails; that event stays pending.
    #[inline]
    pub fn process_events(&mut self, env: &Env) -> Result<(), Error> {
        if self.pending_count == 0 {
            return Ok(());
        }
        self.drain_events(env, false)
    }

    /// PyTorch `synchronize_and_free_events`: waits for every pending event of this shard and
    /// returns the blocks to their pools.
    pub fn synchronize_events(&mut self, env: &Env) -> Result<(), Error> {
        self.drain_events(env, true)
    }

    fn drain_events(&mut self, env: &Env, wait: bool) -> Result<(), Error> {
        let mut result = Ok(());
        'queues: for q in 0..self.pending.len() {
            while let Some(&(ev, id)) = self.pending[q].1.front() {
                let done =
                    if wait { env.driver.event_synchronize(ev).map(|_| true) } else { env.driver.event_query(ev) };
                match done {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        result = Err(Error::driver(e, "waiting for the events of freed blocks"));
                        break 'queues;
                    }
                }
                self.pending[q].1.pop_front();
                self.pending_count -= 1;
                self.spare_events.push(ev);
                let b = &mut self.blocks[id];
                b.event_count -= 1;
                if b.event_count == 0 {
                    self.free_block(id);
                }
            }
        }
        self.pending.retain(|q| !q.1.is_empty());
        result
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
            return Err(self.diagnose(ptr, segment, "gpupool_record_stream"));
        };
        let uses = &mut self.blocks[id].stream_uses;
        if stream != owner && !uses.contains(&stream) {
            uses.push(stream);
        }
        Ok(())
    }

    /// A free whose block waits for the next device synchronisation instead of events: it stops
    /// being allocated now and stays active until [`ShardState::release_synced`] (a device
    /// synchronisation waits for every stream, so streams named by `record_stream` need no
    /// event). Returns the block's size in bytes.
    ///
    /// Errors: [`Error::InvalidPointer`] as [`ShardState::free`], nothing changed.
    pub fn free_after_sync(
        &mut self,
        env: &Env,
        ptr: DevicePtr,
        segment: DevicePtr,
        epoch: u64,
    ) -> Result<usize, Error> {
        let Some(id) = self.live.remove(&ptr) else {
            return Err(self.diagnose(ptr, segment, "gpupool_free"));
        };
        self.count_free(id, env.max_split_size);
        let b = &mut self.blocks[id];
        b.stream_uses.clear();
        b.state = BlockState::AwaitingSync;
        self.deferred.push((id, epoch));
        Ok(self.blocks[id].size)
    }

    /// Returns to their pools the blocks freed in epochs up to `epoch`, which a device
    /// synchronisation has covered. Returns (blocks, bytes) released.
    pub fn release_synced(&mut self, epoch: u64) -> (usize, usize) {
        let (mut blocks, mut bytes) = (0, 0);
        let mut keep = Vec::new();
        for (id, e) in std::mem::take(&mut self.deferred) {
            if e <= epoch {
                blocks += 1;
                bytes += self.blocks[id].size;
                self.free_block(id);
            } else {
                keep.push((id, e));
            }
        }
        self.deferred = keep;
        (blocks, bytes)
    }

    /// The size in bytes (rounded, as counted in `allocated_bytes`) of the allocated block at
    /// `ptr`, or `None` when `ptr` is not the start of an allocated block.
    pub fn allocated_size(&self, ptr: DevicePtr) -> Option<usize> {
        self.live.get(&ptr).map(|&id| self.blocks[id].size)
    }

    /// PyTorch `release_block`: a whole free segment goes back to the driver.
    fn release_segment(&mut self, env: &Env, id: BlockId) -> Result<(), Error> {
        let b = &self.blocks[id];
        debug_assert!(b.state == BlockState::Free && !b.is_split());
        let (addr, size, pool) = (b.addr, b.size, b.pool);
        // Out of the index first: once the driver has the memory back, another stream's new
        // segment may start at the same address.
        env.index.remove(addr);
        if let Err(e) = env.driver.mem_free(env.device, addr) {
            env.index.insert(SegmentEntry { base: addr, size, device: env.device, shard: env.shard.clone() });
            return Err(Error::driver(e, "returning a cached segment to the driver"));
        }
        self.pool(pool).remove(size, addr, id);
        self.segments.remove(&addr);
        self.blocks.remove(id);
        self.counters.decrease(Metric::Segment, pool, 1);
        self.counters.decrease(Metric::ReservedBytes, pool, size as i64);
        if size >= env.max_split_size {
            self.counters.decrease_single(OVERSIZE_SEGMENTS);
        }
        env.counters.unreserve(size);
        DeviceCounters::bump(&env.counters.num_device_free);
        Ok(())
    }

    /// PyTorch `release_blocks` over both pools: every cached segment that is wholly free goes
    /// back to the driver. Split segments stay. The events kept for reuse are destroyed too
    /// (PyTorch keeps its `EventPool` for the life of the process; gpupool gives everything
    /// idle back).
    pub fn release_cached(&mut self, env: &Env) -> Result<(), Error> {
        for ev in self.spare_events.drain(..) {
            env.driver.event_destroy(env.device, ev);
        }
        let whole: Vec<BlockId> = self
            .small
            .iter()
            .chain(self.large.iter())
            .map(|(_, _, id)| id)
            .filter(|&id| !self.blocks[id].is_split())
            .collect();
        for id in whole {
            self.release_segment(env, id)?;
        }
        Ok(())
    }

    /// PyTorch `release_available_cached_blocks`: with `max_split_size` set, release oversize
    /// cached segments of the request's pool, the smallest that is big enough or else the
    /// largest ones until enough is released. Returns whether enough was.
    pub fn release_available(&mut self, env: &Env, req: &Request) -> Result<bool, Error> {
        let max = env.max_split_size;
        if max == usize::MAX {
            return Ok(false);
        }
        let want = req.rounded.max(max);
        let pool = self.pool(req.pool);
        if let Some((_, _, id)) = pool.best_fit(want) {
            if self.blocks[id].is_split() {
                return Ok(false);
            }
            self.release_segment(env, id)?;
            return Ok(true);
        }
        let candidates: Vec<(usize, BlockId)> =
            pool.iter_largest_first().take_while(|&(size, _, _)| size >= max).map(|(s, _, id)| (s, id)).collect();
        let mut released = 0;
        for (size, id) in candidates {
            if released >= want {
                break;
            }
            if !self.blocks[id].is_split() {
                self.release_segment(env, id)?;
                released += size;
            }
        }
        Ok(released >= want)
    }

    /// Says what is wrong with a pointer that is not an allocated block: a double free or a
    /// pointer into the middle of a block.
    fn diagnose(&self, ptr: DevicePtr, segment: DevicePtr, call: &str) -> Error {
        let Some(seg) = self.segments.get(&segment) else {
            return Error::InvalidPointer(format!("{call}: pointer {ptr:#x} was not allocated by gpupool"));
        };
        let mut id = seg.head;
        while id != NIL {
            let b = &self.blocks[id];
            if ptr >= b.addr && ptr - b.addr < b.size as u64 {
                let msg = if ptr != b.addr {
                    format!(
                        "{call}: pointer {ptr:#x} is {} bytes inside the block at {:#x}; pass the pointer gpupool_malloc returned",
                        ptr - b.addr,
                        b.addr
                    )
                } else {
                    format!("{call}: pointer {ptr:#x} is not allocated (double free, or used after gpupool_free)")
                };
                return Error::InvalidPointer(msg);
            }
            id = b.next;
        }
        Error::InvalidPointer(format!("{call}: pointer {ptr:#x} was not allocated by gpupool"))
    }

    /// The consistency check of this shard (see [`crate::Allocator::check_invariants`]):
    /// segment lists, pools, the live map, pending events and a recount of every statistic.
    pub fn check(&self, owner: StreamHandle, max_split_size: usize) -> Result<(), String> {
        let mut recount = [[0i64; 3]; 9];
        let mut add = |m: Metric, pool: PoolKind, n: i64| {
            recount[m as usize][0] += n;
            recount[m as usize][1 + pool as usize] += n;
        };
        let mut oversize = [0i64; 2];
        let (mut free_blocks, mut awaiting) = (0usize, FxHashMap::<BlockId, u32>::default());
        let mut deferred_blocks = 0usize;
        for (&base, seg) in &self.segments {
            let head = &self.blocks[seg.head];
            if head.addr != base || head.prev != NIL {
                return Err(format!("stream {owner:#x}: segment {base:#x} does not start with its head block"));
            }
            let pool = head.pool;
            add(Metric::Segment, pool, 1);
            add(Metric::ReservedBytes, pool, seg.size as i64);
            oversize[1] += (seg.size >= max_split_size) as i64;
            let (mut id, mut prev, mut at) = (seg.head, NIL, base);
            while id != NIL {
                let b = &self.blocks[id];
                if b.addr != at || b.prev != prev || b.pool != pool || b.size == 0 {
                    return Err(format!("stream {owner:#x}: block list of segment {base:#x} is broken at {at:#x}"));
                }
                match b.state {
                    BlockState::Allocated => {
                        if self.live.get(&b.addr) != Some(&id) {
                            return Err(format!("allocated block {:#x} is missing from the live map", b.addr));
                        }
                        add(Metric::Allocation, pool, 1);
                        add(Metric::AllocatedBytes, pool, b.size as i64);
                    }
                    BlockState::Free => {
                        free_blocks += 1;
                        if !self.pool_ref(pool).iter().any(|e| e == (b.size, b.addr, id)) {
                            return Err(format!("free block {:#x} is missing from its pool", b.addr));
                        }
                        if prev != NIL && self.blocks[prev].state == BlockState::Free {
                            return Err(format!("free blocks {:#x} and its predecessor were not coalesced", b.addr));
                        }
                        if b.is_split() {
                            add(Metric::InactiveSplit, pool, 1);
                            add(Metric::InactiveSplitBytes, pool, b.size as i64);
                        }
                    }
                    BlockState::AwaitingEvents => {
                        awaiting.insert(id, b.event_count);
                    }
                    BlockState::AwaitingSync => {
                        if !self.deferred.iter().any(|&(d, _)| d == id) {
                            return Err(format!(
                                "block {:#x} awaits a device synchronisation but is not listed",
                                b.addr
                            ));
                        }
                        deferred_blocks += 1;
                    }
                }
                if b.state != BlockState::Free {
                    add(Metric::Active, pool, 1);
                    add(Metric::ActiveBytes, pool, b.size as i64);
                    add(Metric::RequestedBytes, pool, b.requested as i64);
                    oversize[0] += (b.state == BlockState::Allocated && b.size >= max_split_size) as i64;
                }
                at += b.size as u64;
                prev = id;
                id = b.next;
            }
            if at != base + seg.size as u64 {
                return Err(format!("blocks of segment {base:#x} do not cover it exactly"));
            }
        }
        if free_blocks != self.small.len() + self.large.len() {
            return Err(format!(
                "stream {owner:#x}: {} blocks in the pools but {free_blocks} free blocks in segments",
                self.small.len() + self.large.len()
            ));
        }
        if deferred_blocks != self.deferred.len() {
            return Err(format!("stream {owner:#x}: blocks listed as awaiting a device synchronisation are not"));
        }
        if self.live.len() != recount[Metric::Allocation as usize][0] as usize {
            return Err(format!("stream {owner:#x}: the live map holds blocks that are not allocated"));
        }
        let mut queued = FxHashMap::<BlockId, u32>::default();
        for (_, q) in &self.pending {
            for &(_, id) in q {
                *queued.entry(id).or_default() += 1;
            }
        }
        if queued != awaiting || self.pending_count != queued.values().sum::<u32>() as usize {
            return Err(format!("stream {owner:#x}: pending events do not match the blocks awaiting them"));
        }
        for (m, types) in recount.iter().enumerate() {
            for (t, &want) in types.iter().enumerate() {
                let have = self.counters.cells[m * 3 + t].current;
                if have != want {
                    return Err(format!("stream {owner:#x}: statistic {m} type {t} is {have}, recount {want}"));
                }
            }
        }
        if self.counters.cells[OVERSIZE_ALLOCATIONS].current != oversize[0]
            || self.counters.cells[OVERSIZE_SEGMENTS].current != oversize[1]
        {
            return Err(format!("stream {owner:#x}: oversize counts differ from a recount"));
        }
        Ok(())
    }

    fn pool_ref(&self, kind: PoolKind) -> &FreePool {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }
}
