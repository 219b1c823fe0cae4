//! A device's part of the allocation history (`crate::history`): its recording level, its
//! out-of-memory events, and its segments and trace for a snapshot (PyTorch
//! `DeviceCachingAllocator::recordHistory`, the `OOM` event of `malloc`, `snapshot` and
//! `trace`).

use std::sync::Arc;

use parking_lot::MutexGuard;

use crate::caching::device::DeviceAllocator;
use crate::caching::shard::{Request, Shard, ShardState};
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;
use crate::history::{Action, Entry, HistoryContext, RawSegment};

impl DeviceAllocator {
    /// Records at `level` from now on (what [`crate::history::Recorder::set`] returned). When
    /// stacks stop being kept, every block and segment forgets its own (keeping its tag), so
    /// that none is taken for the stack of a later allocation made while they are not kept.
    pub fn set_history_level(&self, level: u32) {
        let kept = self.history.keeps(HistoryContext::State);
        self.history.set_level(level);
        if kept && !self.history.keeps(HistoryContext::State) {
            for shard in self.shards.all() {
                shard.lock().clear_contexts(&self.history.recorder().contexts);
            }
        }
    }

    /// The `oom` event of a request of `stream` that failed for lack of memory, after every
    /// retry (PyTorch `malloc`): the device's free bytes (`cuMemGetInfo`; 0 if it cannot say)
    /// and the rounded size asked for, with the caller's stack if events keep stacks.
    #[cold]
    pub(in crate::caching) fn record_oom(&self, stream: StreamHandle, req: &Request) {
        let free = self.driver.mem_info(self.device).map_or(0, |i| i.free);
        let c = self.history.capture(HistoryContext::Alloc);
        self.history.record(Action::Oom, free as u64, req.rounded, req.rounded, stream, c);
    }

    /// The `annotate` event of the allocated block at `ptr` of `shard` (PyTorch
    /// `annotateMemory`): the block's address, requested and rounded sizes and stream, `meta`
    /// as its `user_metadata`, and the caller's stack where events keep stacks
    /// ([`HistoryContext::Alloc`] and up). Recorded under the shard's lock, so that it comes
    /// before the block's `free_requested` in the trace, or the block is found freed. While
    /// history is off, only checks the block.
    ///
    /// Errors: [`Error::InvalidPointer`] when `ptr` is not the address of an allocated block of
    /// the shard (freed, or inside a block), recording nothing.
    pub fn annotate(&self, shard: &Arc<Shard>, ptr: DevicePtr, meta: Arc<str>) -> Result<(), Error> {
        let not_live = || {
            Error::InvalidPointer(format!(
                "pointer {ptr:#x} is not an allocated block: it was freed, or lies inside a block (annotate the \
                 address gpupool_malloc returned)"
            ))
        };
        if !self.history.on() {
            return if shard.lock().is_allocated(ptr) { Ok(()) } else { Err(not_live()) };
        }
        // The stack before the shard's lock: reading Python frames may take the GIL.
        let scope = self.history.python_scope(HistoryContext::Alloc);
        let c = self.history.capture(HistoryContext::Alloc);
        drop(scope);
        let st = shard.lock();
        let id = st.allocated(ptr).ok_or_else(not_live)?;
        let b = &st.blocks[id];
        self.history.record_meta(Action::Annotate, b.addr, b.requested, b.size, shard.stream, c, Some(meta));
        Ok(())
    }

    /// The context and size (rounded) of every allocated block of the device, one shard locked
    /// at a time (a consistent state per stream, not across streams: enough for a report).
    pub fn live_blocks(&self) -> Vec<(u32, usize)> {
        let mut out = Vec::new();
        for shard in self.shards.all() {
            shard.lock().live_into(&mut out);
        }
        out
    }

    /// Appends the device's segments to `out` and returns its trace and the bytes of pages it
    /// holds unmapped, all taken with every shard locked (one consistent state, as PyTorch
    /// takes it under its device lock); while
    /// history is on, the trace ends with a `snapshot` event carrying the device's active
    /// bytes (PyTorch `snapshot`). Without `traces` (PyTorch's `include_traces=False`), the
    /// trace is not copied (an empty one is returned) but the `snapshot` event is still
    /// recorded.
    pub fn snapshot_into(&self, out: &mut Vec<RawSegment>, traces: bool) -> (Vec<Entry>, usize) {
        let _peaks = self.peaks.lock();
        let list = self.shards.all();
        let guards: Vec<MutexGuard<'_, ShardState>> = list.iter().map(|s| s.lock()).collect();
        let start = out.len();
        for (shard, st) in list.iter().zip(&guards) {
            st.snapshot_into(self.device, shard.stream, shard.pool, out);
        }
        if self.history.on() {
            let active = out[start..].iter().map(|r| r.segment.active_size).sum();
            self.history.record(Action::Snapshot, 0, active, active, 0, 0);
        }
        let trace = if traces { self.history.recorder().trace(self.device as usize) } else { Vec::new() };
        (trace, self.pages.held())
    }
}
