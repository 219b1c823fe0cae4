//! The free side of a shard (PyTorch `free`): a block stops being allocated and goes back to
//! its pool at once, or waits for events on the streams that used it (`record_stream`), or for
//! the next device synchronisation when an event cannot be recorded. The cache-hit free runs
//! through here; what the waiting blocks do afterwards is in `waiting`.

use super::front::FRONT_BYTES;
use super::{ShardCtx, ShardState};
use crate::caching::accounting::counters::{Metric, OVERSIZE_ALLOCATIONS};
use crate::caching::block::{BlockId, BlockState};
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;

impl ShardState {
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
    ///
    /// `ctx` makes what the device passes, for the slow paths only; `max_split_size` is the
    /// device's.
    #[inline(always)]
    pub fn free<'c>(
        &mut self,
        ctx: impl FnOnce() -> ShardCtx<'c>,
        max_split_size: usize,
        ptr: DevicePtr,
        segment: DevicePtr,
    ) -> Result<(), Error> {
        let Some(id) = self.allocated(ptr) else {
            return Err(self.diagnose(ptr, segment));
        };
        self.free_block_at(ctx, max_split_size, ptr, id)
    }

    /// [`ShardState::free`] of the allocated block `id` at `ptr`, found already (the hit
    /// path's free looks it up once, to learn whether the shard it guessed holds it: a
    /// second probe of the live map cost 22 instructions a pair, callgrind,
    /// `tests/c/hit_loop.c`).
    #[inline(always)]
    pub fn free_block_at<'c>(
        &mut self,
        ctx: impl FnOnce() -> ShardCtx<'c>,
        max_split_size: usize,
        ptr: DevicePtr,
        id: BlockId,
    ) -> Result<(), Error> {
        debug_assert_eq!(self.allocated(ptr), Some(id));
        if !self.blocks[id].stream_uses.is_empty() {
            return self.free_used(&ctx(), ptr, id);
        }
        self.free_whole(ptr, id, max_split_size);
        Ok(())
    }

    /// Frees the allocated block `id` at `ptr` that no other stream used: counted, and to the
    /// front cache or its pool.
    ///
    /// The block is looked up once, for its statistics and the front cache both (the fields
    /// borrowed apart): a look-up in each cost a bounds check each (callgrind,
    /// `tests/c/hit_loop.c`). Its statistics are [`ShardState::count_free`] and
    /// `count_inactive` at once, counted as the hit path counts (see `accounting::counters::pending_sums`).
    #[inline(always)]
    fn free_whole(&mut self, ptr: DevicePtr, id: BlockId, max_split_size: usize) {
        let ShardState { blocks, counters, front, frees, .. } = self;
        let b = &mut blocks[id];
        let (size, requested, pool) = (b.size, b.requested, b.pool);
        b.requested = 0;
        counters.hit_decrease(pool, size as i64, requested as i64);
        if size >= max_split_size {
            counters.decrease_single(OVERSIZE_ALLOCATIONS);
        }
        // A block the front cache takes stays in the live map (see `live`).
        if b.expandable && size <= FRONT_BYTES && front.has_room(size) {
            *frees = frees.wrapping_add(1);
            b.state = BlockState::Cached;
            b.freed_at = *frees;
            front.push(size, b.addr, id);
            return;
        }
        self.free_whole_merged(ptr, id);
    }

    /// The rest of [`ShardState::free_whole`] when the front cache has no room for the block
    /// (the oldest go first) or does not take it.
    #[inline(never)]
    fn free_whole_merged(&mut self, ptr: DevicePtr, id: BlockId) {
        if !self.cache_freed(id) {
            self.live.remove(&ptr);
        }
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
        if self.ipc_free(ptr, id)? {
            return Ok(());
        }
        if self.blocks[id].stream_uses.is_empty() {
            self.free_whole(ptr, id, ctx.max_split_size);
            return Ok(());
        }
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

    /// The statistics of a block that stops being allocated (it stays active until
    /// `free_block`).
    #[inline(always)]
    fn count_free(&mut self, id: BlockId, max_split_size: usize) {
        let b = &self.blocks[id];
        let (size, pool) = (b.size, b.pool);
        self.counters.decrease(Metric::Allocation, pool, 1);
        self.counters.decrease(Metric::AllocatedBytes, pool, size as i64);
        if size >= max_split_size {
            self.counters.decrease_single(OVERSIZE_ALLOCATIONS);
        }
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
        let Some(id) = self.allocated(ptr) else {
            return Err(self.diagnose(ptr, segment));
        };
        if stream != owner && !self.blocks[id].stream_uses.contains(&stream) {
            self.blocks[id].add_stream_use(stream);
            self.note_stream_use(stream);
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
        let Some(id) = self.allocated(ptr) else {
            return Err(self.diagnose(ptr, segment));
        };
        if self.ipc_free(ptr, id)? {
            return Ok(0);
        }
        self.live.remove(&ptr);
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
}
