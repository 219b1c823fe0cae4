//! What a snapshot holds ([`crate::Allocator::snapshot`]): PyTorch's `SnapshotInfo` as
//! `torch.cuda.memory._snapshot()` returns it, field for field. Sizes in bytes, times in
//! microseconds since the Unix epoch.

use std::sync::Arc;

use super::Action;
use super::entry::Entry;
use super::frame::Frame;
use super::stacks::ContextTable;
use crate::driver::{DevicePtr, StreamHandle};

/// A block's state in the snapshot (PyTorch's `active_allocated`, `active_pending_free`,
/// `inactive`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed to a caller and not freed.
    ActiveAllocated,
    /// Freed, but waiting for the events of `record_stream` or for a device synchronisation
    /// before it goes back to its pool (PyTorch's docstring calls it `active_awaiting_free`;
    /// its code and viewer write `active_pending_free`).
    ActivePendingFree,
    /// Free in its pool.
    Inactive,
}

impl BlockState {
    /// The name the snapshot writes.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A block of a segment (PyTorch `BlockInfo`).
#[derive(Clone, Debug)]
pub struct SnapshotBlock {
    /// Its address: the segment's, plus the sizes of the blocks before it.
    pub address: DevicePtr,
    /// Bytes, rounded.
    pub size: usize,
    /// Bytes the caller asked for (0 for an inactive block).
    pub requested_size: usize,
    /// Allocated, waiting, or free.
    pub state: BlockState,
    /// Who allocated it, when recorded with [`super::HistoryContext::State`] or more while it
    /// was allocated; empty for an inactive block.
    pub frames: Arc<[Frame]>,
}

/// A segment (PyTorch `SegmentInfo`): an ordinary segment, or one mapped stretch of an
/// expandable segment (PyTorch reports each contiguous mapped range of an expandable segment
/// as a segment of its own; the unmapped address space is not shown). Its blocks tile it in
/// address order.
#[derive(Clone, Debug)]
pub struct SnapshotSegment {
    /// The device ordinal.
    pub device: i32,
    /// Start address.
    pub address: DevicePtr,
    /// Bytes: the sum of its blocks' sizes.
    pub total_size: usize,
    /// The stream whose pools it belongs to.
    pub stream: StreamHandle,
    /// The private pool it belongs to (PyTorch `segment_pool_id`, written as the tuple
    /// `(0, pool)`); 0 for the default pools.
    pub pool: u64,
    /// In the large pool (`segment_type` `large`) or the small one (`small`).
    pub is_large: bool,
    /// Bytes of its blocks that are allocated.
    pub allocated_size: usize,
    /// Bytes of its blocks that are allocated or waiting to be freed.
    pub active_size: usize,
    /// Bytes asked for by the callers of its active blocks.
    pub requested_size: usize,
    /// Part of an expandable segment.
    pub is_expandable: bool,
    /// Its pool sleeps (`gpupool_sleep`): its pages are given back, its blocks keep their
    /// addresses and states. Not in PyTorch: the pickle writes `is_sleeping: True` on such a
    /// segment only, a key PyTorch's viewer and `_snapshot()` readers pass over.
    pub is_sleeping: bool,
    /// Who made the segment, when recorded with [`super::HistoryContext::State`] or more.
    pub frames: Arc<[Frame]>,
    /// Its blocks, in address order.
    pub blocks: Vec<SnapshotBlock>,
}

/// One event of a device's trace (PyTorch `TraceEntry`).
#[derive(Clone, Debug)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The block's or segment's address, or the pages' for `segment_map`/`segment_unmap`; for
    /// [`Action::Oom`] the bytes the device had free (PyTorch writes it as `device_free`); 0
    /// for [`Action::Snapshot`].
    pub addr: u64,
    /// The bytes PyTorch writes as the event's `size`: the size asked for (`alloc`,
    /// `free_requested`, `free_completed`), the segment's or pages' size, the rounded size of
    /// the failed request (`oom`), the device's active bytes (`snapshot`).
    pub size: usize,
    /// The block's size, rounded, for `alloc`, `free_requested` and `free_completed`; else as
    /// `size`. Not in PyTorch's pickle.
    pub block_size: usize,
    /// The stream of the block or segment.
    pub stream: StreamHandle,
    /// The device ordinal.
    pub device: i32,
    /// When, in microseconds since the Unix epoch.
    pub time_us: i64,
    /// The call stack recorded with it, if any.
    pub frames: Arc<[Frame]>,
    /// The metadata of the thread that recorded it (`gpupool_set_memory_metadata`, PyTorch
    /// `_set_memory_metadata`), or, for [`Action::Annotate`], the annotation; `None` when
    /// there is none (the pickle then writes no `user_metadata` key).
    pub user_metadata: Option<Arc<str>>,
}

/// The allocator's settings, as PyTorch's snapshot reports them (`allocator_settings`).
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorSettings {
    /// The configuration string (`GPUPOOL_CONF`'s syntax, every key), which PyTorch reports
    /// as `PYTORCH_CUDA_ALLOC_CONF`.
    pub conf: String,
    /// `max_split_size` in bytes (`usize::MAX`: none).
    pub max_split_size: usize,
    /// `garbage_collection_threshold` (0: off).
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `pinned_num_register_threads`.
    pub pinned_num_register_threads: usize,
    /// `release_lock_on_cudamalloc`.
    pub release_lock_on_cudamalloc: bool,
    /// `pinned_use_cuda_host_register`.
    pub pinned_use_cuda_host_register: bool,
    /// `roundup_power2_divisions`, one entry per power-of-two interval from 1 MiB.
    pub roundup_power2_divisions: Vec<usize>,
}

/// Every segment of every device and each device's trace (PyTorch `SnapshotInfo`), as
/// [`crate::Allocator::snapshot`] takes it; [`Snapshot::to_pickle`] writes PyTorch's file.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The segments, by device, then by address.
    pub segments: Vec<SnapshotSegment>,
    /// One trace per device ordinal of the driver (empty for a device never used), oldest
    /// event first; every one empty in a snapshot taken without traces
    /// ([`crate::Allocator::snapshot_with`]).
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The allocator's settings.
    pub allocator_settings: AllocatorSettings,
    /// Per device ordinal (as `device_traces`), the bytes of physical pages held unmapped for
    /// expandable segments when the device was taken (`DeviceStats::unmapped_held_bytes`;
    /// not in PyTorch). The pickle writes it as `gpupool_unmapped_held_bytes`, a top-level key
    /// PyTorch's viewer does not read.
    pub unmapped_held_bytes: Vec<usize>,
}

/// A segment as the allocator core collects it under its locks: its stacks still as ids
/// ([`super::stacks`]), symbolised by [`Snapshot::assemble`] once the locks are released.
pub(crate) struct RawSegment {
    pub segment: SnapshotSegment,
    /// The segment's stack.
    pub ctx: u32,
    /// Each block's stack, in the order of `segment.blocks`.
    pub block_ctx: Vec<u32>,
}

impl Snapshot {
    /// The snapshot of `segments` (any order), of each device's trace (`traces[d]` for
    /// device `d`) and held pages, their stacks symbolised from `contexts`.
    pub(crate) fn assemble(
        contexts: &ContextTable,
        mut segments: Vec<RawSegment>,
        traces: Vec<Vec<Entry>>,
        allocator_settings: AllocatorSettings,
        unmapped_held_bytes: Vec<usize>,
    ) -> Snapshot {
        segments.sort_by_key(|r| (r.segment.device, r.segment.address));
        let mut sym = contexts.symbolizer();
        let segments = segments
            .into_iter()
            .map(|mut r| {
                r.segment.frames = sym.frames(r.ctx);
                for (b, &c) in r.segment.blocks.iter_mut().zip(&r.block_ctx) {
                    b.frames = sym.frames(c);
                }
                r.segment
            })
            .collect();
        let device_traces = traces
            .into_iter()
            .enumerate()
            .map(|(d, t)| {
                t.into_iter()
                    .map(|e| TraceEntry {
                        action: e.action,
                        addr: e.addr,
                        size: e.size,
                        block_size: e.block_size,
                        stream: e.stream,
                        device: d as i32,
                        time_us: e.time_us,
                        frames: sym.frames(e.ctx),
                        user_metadata: e.meta,
                    })
                    .collect()
            })
            .collect();
        Snapshot { segments, device_traces, allocator_settings, unmapped_held_bytes }
    }
}
