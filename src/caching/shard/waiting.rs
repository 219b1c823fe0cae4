//! Freed blocks that wait before they are reused: for the events of the streams that used them
//! (PyTorch `process_events`, `synchronize_and_free_events`), for a device synchronisation
//! (gpupool's deferred frees), or for a CUDA graph capture to end (PyTorch
//! `insert_events_deferred_until_no_capture`), and their return to the pools.

use super::{ShardCtx, ShardState};
use crate::caching::block::BlockState;
use crate::error::Error;

impl ShardState {
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
}
