//! The shard's part of the allocation history (`crate::history`): the events of its blocks and
//! segments, recorded under its lock as they happen, and its segments for a snapshot (PyTorch
//! `DeviceCachingAllocator::snapshot`).
//!
//! Called only while history is on (the callers test [`ShardCtx::history`] first), or, for a
//! block's allocation and free, while tags are in use (`crate::history::tags::in_use`); but for
//! [`ShardState::snapshot_into`], [`ShardState::live_into`] and [`ShardState::clear_contexts`].

use crate::caching::block::{BlockId, BlockState, NIL};
use crate::caching::expandable::Expandable;
use crate::caching::rules::PoolKind;
use crate::caching::shard::{ShardCtx, ShardState};
use crate::driver::{DevicePtr, StreamHandle};
use crate::history::{
    Action, BlockState as SnapState, ContextTable, HistoryContext, HistoryHook, RawSegment, SnapshotBlock,
    SnapshotSegment, tags,
};

impl ShardState {
    /// The block at `ptr`, just handed out on `stream` for a request of `requested` bytes:
    /// its context (the calling thread's tag, and its stack: the one captured for the segment
    /// this call made, if any, else one captured now if stacks are kept), counted to its tag,
    /// and, while history is on, its `alloc` event (PyTorch `alloc_found_block`).
    #[cold]
    pub fn record_alloc_at(&mut self, h: &HistoryHook, stream: StreamHandle, ptr: DevicePtr, requested: usize) {
        let Some(id) = self.allocated(ptr) else { return };
        let tag = tags::current();
        let c = match std::mem::take(&mut self.pending_ctx) {
            0 => h.capture_tagged(HistoryContext::State, tag),
            c => c,
        };
        let b = &mut self.blocks[id];
        b.ctx = c;
        h.recorder().tags.alloc(tag, b.size);
        if h.on() {
            h.record(Action::Alloc, b.addr, requested, b.size, stream, c);
        }
    }

    /// The `segment_alloc` event of the segment of `size` bytes at `addr` just made: returns
    /// the stack captured for it (0 if stacks are not kept), left for the `alloc` event of the
    /// block handed out from it.
    #[cold]
    pub(in crate::caching) fn record_segment(&mut self, ctx: &ShardCtx, addr: DevicePtr, size: usize) -> u32 {
        let c = ctx.history.capture(HistoryContext::State);
        ctx.history.record(Action::SegmentAlloc, addr, size, size, ctx.shard.stream, c);
        self.pending_ctx = c;
        c
    }

    /// What the events and the tag's statistics of a free of the block at `ptr` need, read
    /// before the free merges it: `None` for a pointer that is not an allocated block (the free
    /// fails). Captures the stack of the free, with the block's tag, if stacks are kept for
    /// frees.
    #[cold]
    pub fn about_to_free(&self, h: &HistoryHook, ptr: DevicePtr) -> Option<Freed> {
        let id = self.allocated(ptr)?;
        let b = &self.blocks[id];
        let contexts = &h.recorder().contexts;
        let tag = contexts.tag_of(b.ctx);
        let ctx = if h.keeps(HistoryContext::All) { contexts.capture(tag) } else { b.ctx };
        Some(Freed { addr: b.addr, size: b.size, requested: b.requested, ctx, tag, at_once: b.stream_uses.is_empty() })
    }

    /// The `free_completed` event of block `id`, freed earlier, now that its events completed
    /// or the device was synchronised, with its allocation's stack. Call before it is merged.
    #[cold]
    pub(in crate::caching) fn record_free_completed(&self, h: &HistoryHook, stream: StreamHandle, id: BlockId) {
        let b = &self.blocks[id];
        h.record(Action::FreeCompleted, b.addr, b.requested, b.size, stream, b.ctx);
    }

    /// `segment_map` (`mapped`) or `segment_unmap` events for the stretches of `len` bytes at
    /// `offset` into the expandable segment at `base` that are now mapped (or unmapped), one
    /// per run of pages (PyTorch `map_block`, `unmap_block`).
    #[cold]
    pub(in crate::caching) fn record_pages(
        &self,
        ctx: &ShardCtx,
        base: DevicePtr,
        offset: usize,
        len: usize,
        mapped: bool,
        c: u32,
    ) {
        let e: &Expandable = self.segments[&base].exp.as_deref().expect("expandable");
        let action = if mapped { Action::SegmentMap } else { Action::SegmentUnmap };
        let mut run: Option<usize> = None;
        for p in (offset..offset + len).step_by(e.page).chain(std::iter::once(offset + len)) {
            let now = p < offset + len && e.is_mapped(p) == mapped;
            match (run, now) {
                (None, true) => run = Some(p),
                (Some(start), false) => {
                    ctx.history.record(action, base + start as u64, p - start, p - start, ctx.shard.stream, c);
                    run = None;
                }
                _ => {}
            }
        }
    }

    /// Appends this shard's segments to `out` as a snapshot shows them: each ordinary
    /// segment, and each run of mapped blocks of an expandable segment, with its blocks in
    /// address order and the stacks recorded for it and its active blocks.
    pub fn snapshot_into(&self, device: i32, stream: StreamHandle, pool: u64, out: &mut Vec<RawSegment>) {
        for seg in self.segments.values() {
            let head = &self.blocks[seg.head];
            let mut run: Option<RawSegment> = None;
            let mut id = seg.head;
            while id != NIL {
                let b = &self.blocks[id];
                let state = match b.state {
                    BlockState::Allocated => Some(SnapState::ActiveAllocated),
                    BlockState::AwaitingEvents | BlockState::AwaitingSync => Some(SnapState::ActivePendingFree),
                    // The front cache is merged before a snapshot (`Shard::lock`).
                    BlockState::Free | BlockState::Cached => Some(SnapState::Inactive),
                    BlockState::Unmapped => None,
                };
                match state {
                    None => out.extend(run.take()),
                    Some(state) => {
                        let r = run.get_or_insert_with(|| RawSegment {
                            segment: SnapshotSegment {
                                device,
                                address: b.addr,
                                total_size: 0,
                                stream,
                                pool,
                                is_large: head.pool == PoolKind::Large,
                                allocated_size: 0,
                                active_size: 0,
                                requested_size: 0,
                                is_expandable: seg.exp.is_some(),
                                is_sleeping: self.is_asleep(),
                                frames: Default::default(),
                                blocks: Vec::new(),
                            },
                            ctx: seg.ctx,
                            block_ctx: Vec::new(),
                        });
                        let g = &mut r.segment;
                        let active = state != SnapState::Inactive;
                        g.total_size += b.size;
                        if state == SnapState::ActiveAllocated {
                            g.allocated_size += b.size;
                        }
                        if active {
                            g.active_size += b.size;
                            g.requested_size += b.requested;
                        }
                        g.blocks.push(SnapshotBlock {
                            address: b.addr,
                            size: b.size,
                            requested_size: if active { b.requested } else { 0 },
                            state,
                            frames: Default::default(),
                        });
                        r.block_ctx.push(if active { b.ctx } else { 0 });
                    }
                }
                id = b.next;
            }
            out.extend(run);
        }
    }

    /// Forgets the stacks of every block and segment, keeping their tags (recording stopped
    /// keeping stacks: a block allocated from now on has none, so none may linger from its
    /// last allocation).
    pub fn clear_contexts(&mut self, contexts: &ContextTable) {
        self.pending_ctx = 0;
        for seg in self.segments.values_mut() {
            seg.ctx = contexts.without_stack(seg.ctx);
            let mut id = seg.head;
            while id != NIL {
                let b = &mut self.blocks[id];
                b.ctx = contexts.without_stack(b.ctx);
                id = b.next;
            }
        }
    }

    /// Appends the context and the size (rounded) of each of this shard's allocated blocks to
    /// `out`, for the live report and the out-of-memory message.
    pub fn live_into(&self, out: &mut Vec<(u32, usize)>) {
        out.extend(self.live.values().map(|&id| (self.blocks[id].ctx, self.blocks[id].size)));
    }
}

/// A block being freed, as its events describe it ([`ShardState::about_to_free`]).
pub(crate) struct Freed {
    addr: DevicePtr,
    size: usize,
    requested: usize,
    /// The stack the events carry: the free's, or the block's.
    ctx: u32,
    /// The block's tag.
    tag: u32,
    /// It goes back to its pool at once (no other stream used it).
    pub at_once: bool,
}

impl Freed {
    /// Counts the free to the block's tag, and, while history is on, records its
    /// `free_requested` event, and its `free_completed` if it went back at once (PyTorch
    /// `free`, and `free_block` when it is called from there). Call once the free succeeded,
    /// under the same lock.
    #[cold]
    pub fn record(&self, h: &HistoryHook, stream: StreamHandle) {
        h.recorder().tags.free(self.tag, self.size);
        if !h.on() {
            return;
        }
        h.record(Action::FreeRequested, self.addr, self.requested, self.size, stream, self.ctx);
        if self.at_once {
            h.record(Action::FreeCompleted, self.addr, self.requested, self.size, stream, self.ctx);
        }
    }
}
