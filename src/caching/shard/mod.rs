//! One stream's share of a device: its segments, its small and large pools, its blocks awaiting
//! events or a device synchronisation, and its statistics, all behind one lock.
//!
//! PyTorch keeps every stream of a device in one `DeviceCachingAllocator` under one mutex, and
//! a free block is only ever reused by the stream it was allocated on (its pools are ordered by
//! stream first). A segment's blocks therefore always belong to one stream, and gpupool gives
//! each stream its own shard: threads on different streams share no lock. The rules inside a
//! shard are PyTorch's, function for function; each method names the one it mirrors.
//!
//! - this file: the shard, its lock and the state behind it, and what a device passes to it;
//! - [`malloc`]: a request, and a block taken from the cache and handed out;
//! - [`free_block`]: a block freed, back to its pool at once or waiting for other streams' work;
//! - [`waiting`]: freed blocks that wait for events, a device synchronisation or a capture's
//!   end, and their return to the pools;
//! - [`blocks`]: splitting and merging blocks;
//! - [`front`]: blocks freed on the hit path, held whole by exact size in front of the pools;
//! - [`segments`]: segments from and back to the driver;
//! - expandable segments, grown and shrunk a page at a time, are `caching::expandable`;
//! - [`gc_candidates`]: its side of `garbage_collection_threshold`: its wholly free segments with their
//!   ages, and the release of one;
//! - [`check_blocks`]: the consistency check and the diagnosis of a bad pointer;
//! - `caching::history::shard`, in the history's folder: its events in the allocation
//!   history, and its segments for a snapshot;
//! - `caching::largest::shard`, in the largest request's folder: its blocks copied for the
//!   search (`gpupool_largest_allocatable`);
//! - `caching::sleep::shard`, in sleep's folder: its pages given back and mapped again
//!   (`gpupool_sleep`, `gpupool_wake`);
//! - `caching::ipc::shard`, in IPC's folder: its blocks exported to other processes
//!   (`gpupool_ipc_export`), and their free.

mod blocks;
mod check_blocks;
mod free_block;
mod front;
mod gc_candidates;
mod malloc;
mod segments;
mod waiting;

pub(crate) use super::expandable::{ExpandablePolicy, PageWait, Reclaim, release_smaller, smaller_pages};
pub(crate) use malloc::Request;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::accounting::counters::ShardCounters;
use super::block::{Arena, BlockId};
use super::deferred::{DeferredFrees, DeferredList};
use super::events::StreamEvents;
use super::expandable::Expandable;
use super::expandable::PagePool;
use super::limit::MemoryLimit;
use super::observers::segments::{SegmentEvent, SegmentObservers};
use super::pool::FreePool;
use super::retire::UsedStreams;
use super::rules::PoolKind;
use super::segment_index::SegmentIndex;
use super::sleep::ShardSleep;
use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::history::HistoryHook;
use front::FrontCache;

/// A shard: the state of one (device, stream) pair of a pool behind its own lock: the
/// device's default pools (pool 0) or a private pool (see `caching::pools`).
pub(crate) struct Shard {
    pub stream: StreamHandle,
    /// The private pool the shard belongs to; 0 for the device's default pools.
    pub pool: u64,
    /// Set, under the lock, when the shard is taken out of its device's table (see
    /// `shard_table`); a thread that kept it in its cache of recent shards then fetches the
    /// stream's new shard.
    retired: AtomicBool,
    /// The program's allocator of the pool's segments (`pools::source`); `None`: the driver.
    pub source: Option<Arc<super::pools::source::PoolSource>>,
    /// The budget of the shard's pool on its device, shared by the pool's shards (see
    /// `caching::budget`): charged where a segment is made or pages mapped.
    pub budget: Arc<super::budget::PoolBudget>,
    state: Mutex<ShardState>,
}

impl Shard {
    pub fn new(pool: u64, stream: StreamHandle, budget: Arc<super::budget::PoolBudget>) -> Shard {
        let source = super::pools::source::get(pool);
        let no_split = super::pools::flags::no_split(pool);
        let state = Mutex::new(ShardState { no_split, ..ShardState::default() });
        Shard { stream, pool, retired: AtomicBool::new(false), source, budget, state }
    }

    /// The lock, with the front cache merged into the pools (see `front`): what every call
    /// but the hit path's takes, so that it sees PyTorch's merged pools.
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, ShardState> {
        let mut st = self.state.lock();
        st.drain_front();
        st
    }

    /// The lock, the front cache left as it is: for malloc, free and `record_stream`, which
    /// take from and add to it, and for the consistency check, which checks it.
    #[inline(always)]
    pub fn lock_hot(&self) -> MutexGuard<'_, ShardState> {
        self.state.lock()
    }

    /// The lock if it is free now (`empty_cache` passes over a busy shard), with the front
    /// cache merged as [`Shard::lock`].
    pub fn try_lock(&self) -> Option<MutexGuard<'_, ShardState>> {
        let mut st = self.state.try_lock()?;
        st.drain_front();
        Some(st)
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
    /// The device's physical pages held unmapped, for expandable segments to map first.
    pub pages: &'a PagePool,
    pub deferred: &'a DeferredFrees,
    /// How expandable segments are laid out; `None` when the device uses ordinary segments.
    pub expandable: Option<&'a ExpandablePolicy>,
    /// What growing an expandable segment past the device's high-water mark does first.
    pub reclaim: Reclaim,
    /// The device's allocation history: each event is recorded while it is on.
    pub history: &'a HistoryHook,
    /// Whether a capture is under way, asked only before a call CUDA forbids during one.
    pub capture: &'a crate::caching::capture::CaptureProbe,
    /// The allocator's segment observers, told of segments made and given back.
    pub segments: &'a SegmentObservers,
    /// The devices the device's pages are mapped for (see `caching::peers`), read by each map
    /// under the shard's lock.
    pub peers: &'a crate::caching::peers::Peers,
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

pub(in crate::caching) struct SegmentInfo {
    pub(in crate::caching) head: BlockId,
    /// Bytes: the segment's size, or an expandable segment's address range.
    pub(in crate::caching) size: usize,
    /// An expandable segment's page table.
    pub(in crate::caching) exp: Option<Box<Expandable>>,
    /// The stack of the call that made it in the history's table (PyTorch
    /// `context_when_segment_allocated`), 0 for none; as [`super::block::Block::ctx`].
    pub(in crate::caching) ctx: u32,
    /// A block of it was handed out while the allocating stream captured a CUDA graph: the
    /// graph's kernels use its addresses at every replay, so it stays reserved, wholly free or
    /// not, until its private pool is released (see `caching::pools`).
    pub(in crate::caching) graph: bool,
}

/// The state behind a shard's lock.
///
/// In declaration order (`repr(C)`), the fields a malloc or free reads on every call first,
/// so that they share cache lines: at 1,000 streams in rotation each call finds its shard's
/// lines cold, and the compiler's order spread these over five lines of the struct's 74
/// (cachegrind, `examples/stream_rotation.rs`, issue 42).
#[derive(Default)]
#[repr(C)]
pub(crate) struct ShardState {
    /// The settle epoch in which the shard last joined its device's dirty list.
    pub dirty_epoch: u64,
    /// The address and id of the block handed out last: [`ShardState::allocated`] looks here
    /// before `live`, because a program that allocates and frees in a loop frees the block it
    /// took last (the hash probe cost the hit pair about 30 instructions, callgrind). A hint
    /// only: checked against the block before it is believed.
    last_out: (DevicePtr, BlockId),
    /// Blocks freed on this shard, wrapping (the clock of `garbage_collection_threshold`'s
    /// ages, see `device::gc_threshold`).
    frees: u32,
    /// The stack the history captured for the segment (or pages) the current malloc made,
    /// for the `alloc` event of its block (PyTorch gathers one context per malloc); 0 for none.
    pub(in crate::caching) pending_ctx: u32,
    /// Allocated blocks by address (PyTorch `allocated_blocks`), and the front cache's blocks,
    /// which stay listed while cached so that a free and a malloc of the same block touch
    /// the map neither time ([`ShardState::allocated`] tells the two apart).
    pub(in crate::caching) live: FxHashMap<DevicePtr, BlockId>,
    pub(in crate::caching) events: StreamEvents,
    /// The shard's private pool was released (`gpupool_release_pool`): its segments go back
    /// to the driver as soon as they are wholly free, and nothing is allocated from it again.
    pub released: bool,
    /// The shard's pool never splits a block (`POOL_NO_SPLIT`, PyTorch `MemPool(no_split=True)`):
    /// fixed when the shard is made.
    pub(in crate::caching) no_split: bool,
    /// A sleep copies the shard's live blocks (its first half ran, [`ShardState::prepare_sleep`])
    /// and will unmap every page it maps then: until the sleep unmaps them or is abandoned,
    /// no page may be unmapped by anyone else, for the copies read them and the wake maps and
    /// restores exactly the pages the sleep unmapped (see `caching::sleep::shard`).
    pub(in crate::caching) sleep_prepared: bool,
    /// Blocks freed on the hit path, not merged yet (see `front`).
    front: FrontCache,
    pub(in crate::caching) blocks: Arena,
    pub(in crate::caching) small: FreePool,
    pub(in crate::caching) large: FreePool,
    /// The shard's pool sleeps (`gpupool_sleep`, see `caching::sleep::shard`): its pages are
    /// given back, its blocks keep their addresses, and nothing may unmap, release or hand out
    /// its memory.
    pub(in crate::caching) asleep: Option<Box<ShardSleep>>,
    pub(in crate::caching) segments: FxHashMap<DevicePtr, SegmentInfo>,
    /// The bases of the expandable segments among `segments`.
    pub(in crate::caching) expandables: Vec<DevicePtr>,
    /// Unmapped blocks of expandable segments, per pool, by address (PyTorch
    /// `BlockPool::unmapped`).
    pub(in crate::caching) unmapped: [BTreeSet<(DevicePtr, BlockId)>; 2],
    pub(in crate::caching) deferred: DeferredList,
    /// Segment events of allocations and mappings made under the lock, for the call to deliver
    /// once the lock is dropped (see `segment_observers`); empty with no observer attached.
    pub segment_events: Vec<SegmentEvent>,
    /// Blocks freed while a capture was under way whose other streams (`record_stream`) need
    /// events, which may not be recorded and queried then: they wait, active, until no capture
    /// is (PyTorch `needs_events_deferred_until_no_capture`). Each is in
    /// [`BlockState::AwaitingEvents`](super::block::BlockState::AwaitingEvents) with no event yet.
    capture_deferred: Vec<BlockId>,
    pub counters: ShardCounters,
    /// The streams `record_stream` named for live blocks, for `gpupool_stream_retire` (see
    /// `caching::retire::uses`); last, away from the hit path's lines.
    pub(in crate::caching) retire_uses: UsedStreams,
}

impl ShardState {
    pub(in crate::caching) fn pool(&mut self, kind: PoolKind) -> &mut FreePool {
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

    /// Whether this shard holds cache and no block in use: nothing allocated, nothing
    /// awaiting an event, a device synchronisation or a capture's end (see
    /// `device::stranded`).
    pub fn is_unused_with_cache(&self) -> bool {
        !self.segments.is_empty()
            && self.live.is_empty()
            && !self.events_pending()
            && self.deferred.len() == 0
            && !self.has_capture_deferred()
    }

    /// Whether the shard holds nothing: no segment (so no block), no event, no deferred free.
    /// Its counters' current values are then all zero.
    pub fn is_idle(&self) -> bool {
        self.segments.is_empty() && self.events.is_unused() && self.deferred.len() == 0
    }

    /// Flags as used by a CUDA graph the segment holding the allocated block at `ptr` (see
    /// `SegmentInfo::graph`).
    pub fn mark_graph(&mut self, ptr: DevicePtr) {
        let Some(id) = self.allocated(ptr) else { return };
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
    pub(in crate::caching) fn releasable(&self, base: DevicePtr) -> bool {
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
        self.allocated(ptr).map(|id| self.blocks[id].size)
    }

    /// Whether `ptr` is an allocated block of this shard.
    #[inline(always)]
    pub fn is_allocated(&self, ptr: DevicePtr) -> bool {
        self.allocated(ptr).is_some()
    }

    /// The allocated block at `ptr`, if there is one (not one of the front cache's).
    #[inline(always)]
    pub fn allocated(&self, ptr: DevicePtr) -> Option<BlockId> {
        let (last, hint) = self.last_out;
        if last == ptr
            && let Some(b) = self.blocks.get(hint)
            && b.addr == ptr
            && b.state == super::block::BlockState::Allocated
        {
            return Some(hint);
        }
        let &id = self.live.get(&ptr)?;
        (self.blocks[id].state == super::block::BlockState::Allocated).then_some(id)
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    /// What every malloc and free reads of a shard's state stays in the struct's first two
    /// cache lines (issue 42: at 1,000 streams each of them is a miss).
    #[test]
    fn the_fields_each_call_reads_end_within_the_first_two_cache_lines() {
        let ends = [
            ("dirty_epoch", offset_of!(ShardState, dirty_epoch) + size_of::<u64>()),
            ("last_out", offset_of!(ShardState, last_out) + size_of::<(DevicePtr, BlockId)>()),
            ("live", offset_of!(ShardState, live) + size_of::<FxHashMap<DevicePtr, BlockId>>()),
            ("events", offset_of!(ShardState, events) + size_of::<StreamEvents>()),
        ];
        for (field, end) in ends {
            assert!(end <= 128, "{field} ends at byte {end}");
        }
        assert!(offset_of!(ShardState, front) <= 128, "the front cache starts in the third line at the latest");
    }
}
