//! The consistency check of a shard, and what to tell a caller whose pointer is not an
//! allocated block.

use rustc_hash::FxHashMap;

use super::ShardState;
use crate::caching::accounting::counters::{CELLS, Metric, OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS, StatType, cell};
use crate::caching::block::{BlockId, BlockState, NIL};
use crate::caching::expandable::Expandable;
use crate::caching::rules::PoolKind;
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;

impl ShardState {
    /// Says what is wrong with a pointer that is not an allocated block of this shard
    /// (`segment`: the base of the segment that contains it, if any): a double free, a
    /// pointer into the middle of an allocated block, or one into memory gpupool holds but
    /// handed to nobody.
    pub(super) fn diagnose(&self, ptr: DevicePtr, segment: DevicePtr) -> Error {
        let not_ours = || Error::InvalidPointer(format!("pointer {ptr:#x} was not allocated by gpupool"));
        let Some(seg) = self.segments.get(&segment) else {
            return not_ours();
        };
        let mut id = seg.head;
        while id != NIL {
            let b = &self.blocks[id];
            if ptr >= b.addr && ptr - b.addr < b.size as u64 {
                let inside = ptr - b.addr;
                let msg = match (b.state, inside) {
                    (BlockState::Allocated, _) => format!(
                        "pointer {ptr:#x} is {inside} bytes inside the block at {:#x}, which is allocated: pass the \
                         pointer the allocation returned",
                        b.addr
                    ),
                    (BlockState::Free | BlockState::Cached, 0)
                    | (BlockState::AwaitingEvents | BlockState::AwaitingSync, 0) => {
                        format!("pointer {ptr:#x} is not allocated (double free, or used after it was freed)")
                    }
                    (BlockState::AwaitingEvents | BlockState::AwaitingSync | BlockState::Cached, _) => format!(
                        "pointer {ptr:#x} is {inside} bytes inside the block at {:#x}, which was already freed",
                        b.addr
                    ),
                    (BlockState::Free, _) => format!(
                        "pointer {ptr:#x} is not allocated: it lies in memory gpupool caches but has not handed out \
                         (never returned by an allocation, or freed)"
                    ),
                    (BlockState::Unmapped, _) => format!(
                        "pointer {ptr:#x} is not allocated: it lies in address space gpupool reserved for an \
                         expandable segment, with no memory mapped there"
                    ),
                };
                return Error::InvalidPointer(msg);
            }
            id = b.next;
        }
        not_ours()
    }

    /// The rule of a pool not split below `align` bytes (`pools::source::PoolSource::
    /// split_alignment`): every segment and every block of it, free or allocated, is a multiple
    /// of `align`, so each block starts at a multiple of it from its segment's start.
    pub fn check_alignment(&self, owner: StreamHandle, align: usize) -> Result<(), String> {
        for (&base, seg) in &self.segments {
            if seg.size % align != 0 {
                return Err(format!(
                    "stream {owner:#x}: segment {base:#x} of {} bytes is not a multiple of {align}",
                    seg.size
                ));
            }
            let mut id = seg.head;
            while id != NIL {
                let b = &self.blocks[id];
                if b.size % align != 0 {
                    return Err(format!(
                        "stream {owner:#x}: block {:#x} of {} bytes splits below {align}",
                        b.addr, b.size
                    ));
                }
                id = b.next;
            }
        }
        Ok(())
    }

    /// The rule of a pool that never splits (`POOL_NO_SPLIT`): each of its segments is one
    /// block, free or not (expandable segments, which a private pool never has, apart).
    pub fn check_unsplit(&self, owner: StreamHandle) -> Result<(), String> {
        for (&base, seg) in &self.segments {
            if seg.exp.is_none() && self.blocks[seg.head].next != NIL {
                return Err(format!("stream {owner:#x}: segment {base:#x} of a pool that never splits is split"));
            }
        }
        Ok(())
    }

    /// The consistency check of this shard (see [`crate::Allocator::check_invariants`]):
    /// segment lists, pools, the live map, pending events and a recount of every statistic.
    pub fn check(&self, owner: StreamHandle, max_split_size: usize) -> Result<(), String> {
        let mut recount = [0i64; CELLS];
        let mut add = |m: Metric, pool: PoolKind, n: i64| {
            recount[cell(m, StatType::All)] += n;
            recount[cell(m, StatType::Pool(pool))] += n;
        };
        let mut oversize = [0i64; 2];
        let (mut free_blocks, mut awaiting) = (0usize, FxHashMap::<BlockId, u32>::default());
        let (mut deferred_blocks, mut unmapped_blocks) = (0usize, 0usize);
        let mut cached = FxHashMap::<BlockId, usize>::default();
        for (&base, seg) in &self.segments {
            let head = &self.blocks[seg.head];
            if head.addr != base || head.prev != NIL {
                return Err(format!("stream {owner:#x}: segment {base:#x} does not start with its head block"));
            }
            let pool = head.pool;
            let exp = seg.exp.as_deref();
            if seg.graph && self.released {
                return Err(format!("stream {owner:#x}: segment {base:#x} is kept for a graph, but released"));
            }
            add(Metric::Segment, pool, 1);
            match exp {
                // Reserved bytes count the pages a sleeping pool will map again.
                Some(e) => add(Metric::ReservedBytes, pool, (e.mapped + e.slept_bytes) as i64),
                None => {
                    add(Metric::ReservedBytes, pool, seg.size as i64);
                    oversize[1] += (seg.size >= max_split_size) as i64;
                }
            }
            if exp.is_some() != self.expandables.contains(&base) {
                return Err(format!("stream {owner:#x}: segment {base:#x} is not listed as what it is"));
            }
            let mut mapped = 0usize;
            let (mut id, mut prev, mut at) = (seg.head, NIL, base);
            while id != NIL {
                let b = &self.blocks[id];
                if b.addr != at || b.prev != prev || b.pool != pool || b.size == 0 || b.expandable != exp.is_some() {
                    return Err(format!("stream {owner:#x}: block list of segment {base:#x} is broken at {at:#x}"));
                }
                if let Some(e) = exp {
                    self.check_pages(e, id, prev)?;
                    if b.state != BlockState::Unmapped {
                        mapped += b.size;
                    }
                }
                match b.state {
                    BlockState::Allocated => {
                        if self.live.get(&b.addr) != Some(&id) {
                            return Err(format!("allocated block {:#x} is missing from the live map", b.addr));
                        }
                        add(Metric::Allocation, pool, 1);
                        add(Metric::AllocatedBytes, pool, b.size as i64);
                        oversize[0] += (b.size >= max_split_size) as i64;
                    }
                    BlockState::Free => {
                        free_blocks += 1;
                        if !self.pool_ref(pool).iter().any(|e| e == (b.size, b.addr, id)) {
                            return Err(format!("free block {:#x} is missing from its pool", b.addr));
                        }
                        if prev != NIL && self.blocks[prev].state == BlockState::Free {
                            return Err(format!("free blocks {:#x} and its predecessor were not coalesced", b.addr));
                        }
                        if b.is_split() && !b.expandable {
                            add(Metric::InactiveSplit, pool, 1);
                            add(Metric::InactiveSplitBytes, pool, b.size as i64);
                        }
                    }
                    BlockState::Cached => {
                        if !b.expandable || self.live.get(&b.addr) != Some(&id) {
                            return Err(format!(
                                "cached block {:#x} is not in an expandable segment, or not in the live map",
                                b.addr
                            ));
                        }
                        cached.insert(id, b.size);
                    }
                    BlockState::AwaitingEvents => {
                        awaiting.insert(id, b.event_count);
                    }
                    BlockState::Unmapped => unmapped_blocks += 1,
                    BlockState::AwaitingSync => {
                        if !self.deferred.contains(id) {
                            return Err(format!(
                                "block {:#x} awaits a device synchronisation but is not listed",
                                b.addr
                            ));
                        }
                        deferred_blocks += 1;
                    }
                }
                if !matches!(b.state, BlockState::Free | BlockState::Unmapped | BlockState::Cached) {
                    add(Metric::Active, pool, 1);
                    add(Metric::ActiveBytes, pool, b.size as i64);
                    add(Metric::RequestedBytes, pool, b.requested as i64);
                }
                at += b.size as u64;
                prev = id;
                id = b.next;
            }
            if at != base + seg.size as u64 {
                return Err(format!("blocks of segment {base:#x} do not cover it exactly"));
            }
            if exp.is_some_and(|e| e.mapped + e.slept_bytes != mapped) {
                return Err(format!("stream {owner:#x}: expandable segment {base:#x} maps bytes no block covers"));
            }
        }
        if unmapped_blocks != self.unmapped.iter().map(|u| u.len()).sum::<usize>() {
            return Err(format!("stream {owner:#x}: the sets of unmapped blocks do not match the segments"));
        }
        self.check_sleep().map_err(|e| format!("stream {owner:#x}: {e}"))?;
        self.check_retire_uses().map_err(|e| format!("stream {owner:#x}: {e}"))?;
        recount[OVERSIZE_ALLOCATIONS] = oversize[0];
        recount[OVERSIZE_SEGMENTS] = oversize[1];
        if !self.small.filter_consistent() || !self.large.filter_consistent() {
            return Err(format!("stream {owner:#x}: a pool's filter of sizes present is stale"));
        }
        if free_blocks != self.small.len() + self.large.len() {
            return Err(format!(
                "stream {owner:#x}: {} blocks in the pools but {free_blocks} free blocks in segments",
                self.small.len() + self.large.len()
            ));
        }
        // The front cache lists every cached block once, with its size, within its bounds.
        let listed: FxHashMap<BlockId, usize> = self.front_blocks().map(|(size, id)| (id, size)).collect();
        if listed != cached || listed.len() != self.front_blocks().count() {
            return Err(format!("stream {owner:#x}: the front cache does not list exactly the cached blocks"));
        }
        if cached.values().sum::<usize>() > super::front::FRONT_BYTES || cached.len() > super::front::FRONT_SLOTS {
            return Err(format!("stream {owner:#x}: the front cache is over its bounds"));
        }
        if deferred_blocks != self.deferred.len() {
            return Err(format!("stream {owner:#x}: blocks listed as awaiting a device synchronisation are not"));
        }
        if self.live.len() != recount[cell(Metric::Allocation, StatType::All)] as usize + cached.len() {
            return Err(format!("stream {owner:#x}: the live map holds blocks that are not allocated"));
        }
        // The hint of the block handed out last (`last_out`) is believed only for an allocated
        // block at its address, which must then be the live map's; a vacant slot is never
        // allocated, so that a hint naming a block that merged away is not believed.
        if !self.blocks.vacant_are_free() {
            return Err(format!("stream {owner:#x}: a vacant slot of the arena is not free"));
        }
        self.counters.check_lazy().map_err(|e| format!("stream {owner:#x}: {e}"))?;
        self.counters.check_credit_cells().map_err(|e| format!("stream {owner:#x}: {e}"))?;
        let (last, hint) = self.last_out;
        if self.allocated(last) == Some(hint) && self.live.get(&last) != Some(&hint) {
            return Err(format!("stream {owner:#x}: the hint names block {last:#x}, which the live map does not"));
        }
        // Blocks freed during a capture await its end with no event yet.
        for &id in &self.capture_deferred {
            if awaiting.remove(&id) != Some(0) {
                return Err(format!(
                    "stream {owner:#x}: a block deferred until no capture is not awaiting, or has events"
                ));
            }
        }
        let (queued, pending) = self.events.per_block();
        if queued != awaiting || pending != queued.values().sum::<u32>() as usize {
            return Err(format!("stream {owner:#x}: pending events do not match the blocks awaiting them"));
        }
        for (i, &want) in recount.iter().enumerate() {
            let have = self.counters.cell(i).current();
            if have != want {
                return Err(format!("stream {owner:#x}: statistic cell {i} is {have}, recount {want}"));
            }
        }
        Ok(())
    }

    /// The rules of an expandable segment's block `id` (after `prev`) against its page
    /// table `e`: an unmapped block is whole pages, none mapped or slept, in its pool's set,
    /// with no unmapped neighbour before it; any other block lies on mapped (or slept) pages
    /// only.
    fn check_pages(&self, e: &Expandable, id: BlockId, prev: BlockId) -> Result<(), String> {
        let b = &self.blocks[id];
        let (start, end) = ((b.addr - e.base) as usize, (b.addr - e.base) as usize + b.size);
        let first_page = start / e.page * e.page;
        let pages = (first_page..end).step_by(e.page);
        if b.state == BlockState::Unmapped {
            if start % e.page != 0 || end % e.page != 0 || pages.clone().any(|p| e.is_held(p)) {
                return Err(format!("unmapped block {:#x} is not whole unmapped pages", b.addr));
            }
            if !self.unmapped[b.pool as usize].contains(&(b.addr, id)) {
                return Err(format!("unmapped block {:#x} is missing from its pool's set", b.addr));
            }
            if prev != NIL && self.blocks[prev].state == BlockState::Unmapped {
                return Err(format!("unmapped block {:#x} and its predecessor were not merged", b.addr));
            }
        } else if let Some(p) = pages.clone().find(|&p| !e.is_held(p)) {
            return Err(format!("block {:#x} spans the unmapped page at offset {p:#x}", b.addr));
        }
        Ok(())
    }
}
