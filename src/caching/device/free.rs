//! Giving a block back to its shard: PyTorch `free` and `recordStream`, and gpupool's free
//! that waits for a device synchronisation.

use std::sync::Arc;

use parking_lot::MutexGuard;

use super::DeviceAllocator;
use crate::caching::shard::{Shard, ShardState};
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;
use crate::history::{HistoryContext, Scope, tags};

impl DeviceAllocator {
    /// PyTorch `free` on the block at `ptr` of `shard`'s segment at `segment`.
    ///
    /// A free keeps the credit it frees (as on a hot stream) whichever thread calls it: the
    /// next call on the shard, if the stream is not hot for its thread, gives it back, and a
    /// settle takes it back from a stream that went quiet.
    ///
    /// Inlined into the free through the segment index (`free_indexed`): a call cost it about
    /// 20 instructions (callgrind, `examples/stream_rotation.rs`).
    #[inline(always)]
    pub fn free(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<(), Error> {
        if self.history.on() {
            return self.free_with_history(shard, ptr, segment);
        }
        self.free_body(shard, ptr, segment, true)
    }

    /// [`DeviceAllocator::free`] while history is on: the calling thread's Python frames are
    /// read first, before any lock, for the stack of the free (see `crate::history`'s
    /// `python`).
    #[cold]
    #[inline(never)]
    fn free_with_history(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<(), Error> {
        let _python = self.history.python_scope(HistoryContext::All);
        let freed = self.free_body(shard, ptr, segment, false);
        // The thread ended while it waited for the GIL (`crate::callout`): freed, it ends now.
        crate::callout::raise_if_exiting();
        freed
    }

    /// [`DeviceAllocator::free`] of `ptr` if it is an allocated block of `shard`, which the
    /// caller guessed without the segment index (the shard the calling thread allocated from
    /// last); `None`, having changed nothing, when it is not, or while history is on (whose
    /// frees read Python frames before any lock).
    ///
    /// The error is boxed so that the answer fits two registers: a `Result<(), Error>` in an
    /// `Option` was copied through the stack at each of the hit path's joins (9 instructions
    /// a free, callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    pub fn free_if_listed(&self, shard: &Arc<Shard>, ptr: DevicePtr) -> Option<Result<(), Box<Error>>> {
        if self.history.on() {
            return None;
        }
        let st = shard.lock_hot();
        let id = st.allocated(ptr)?;
        let mut st = self.shards.dirty_on_change(shard, st);
        // The block is allocated: the segment's base, which only a bad pointer's message
        // needs, is not looked up.
        if tags::in_use() {
            return Some(self.free_locked(shard, st, ptr, 0, true).map_err(Box::new));
        }
        let ctx = || self.ctx(shard);
        // A match, not `map`: the compiler kept `map`'s closure out of line (callgrind: 20
        // instructions a free).
        Some(match st.free_block_at(ctx, self.max_split_size, ptr, id) {
            Ok(()) => {
                self.free_end(st, &ctx);
                Ok(())
            }
            Err(e) => Err(Box::new(e)),
        })
    }

    /// The body of [`DeviceAllocator::free`]; `off`: history was off at the call's start.
    #[inline(always)]
    fn free_body(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr, off: bool) -> Result<(), Error> {
        let st = self.shards.lock_hot_for_change(shard);
        self.free_locked(shard, st, ptr, segment, off)
    }

    /// [`DeviceAllocator::free_body`] with the shard locked for a change.
    #[inline(always)]
    fn free_locked(
        &self,
        shard: &Arc<Shard>,
        mut st: MutexGuard<'_, ShardState>,
        ptr: DevicePtr,
        segment: DevicePtr,
        off: bool,
    ) -> Result<(), Error> {
        // Made only where a slow path needs it (see `malloc_body`).
        let ctx = || self.ctx(shard);
        if if off { tags::in_use() } else { self.history.on_or_tagged() } {
            self.free_recorded(&mut st, shard, ptr, segment)?;
        } else {
            st.free(ctx, self.max_split_size, ptr, segment)?;
        }
        self.free_end(st, &ctx);
        Ok(())
    }

    /// The end of a free that succeeded: segments it emptied given back (see
    /// `release_emptied`), then the call's end.
    #[inline(always)]
    fn free_end<'c>(
        &'c self,
        mut st: MutexGuard<'c, ShardState>,
        ctx: &impl Fn() -> crate::caching::shard::ShardCtx<'c>,
    ) {
        if st.released {
            self.release_emptied(&mut st, &ctx());
        }
        self.finish(st, ());
    }

    /// [`ShardState::free`] counted to the block's tag and with its events recorded while
    /// history is on, once it succeeded (a free that fails,
    /// or unwinds, leaves the block allocated and records nothing): `free_requested`, and
    /// `free_completed` when the block went back to its pool at once (no other stream used
    /// it); with the stack of the free if stacks are kept for frees, else the block's (PyTorch
    /// `free`).
    #[cold]
    #[inline(never)]
    fn free_recorded(
        &self,
        st: &mut ShardState,
        shard: &Arc<Shard>,
        ptr: DevicePtr,
        segment: DevicePtr,
    ) -> Result<(), Error> {
        let ctx = self.ctx(shard);
        let max_split_size = self.max_split_size;
        let Some(freed) = st.about_to_free(&self.history, ptr) else {
            return st.free(|| ctx, max_split_size, ptr, segment);
        };
        st.free(|| ctx, max_split_size, ptr, segment)?;
        // An exported block still imported stays allocated (`caching::ipc::shard`): its free is
        // recorded when the limbo frees it.
        if !st.is_allocated(ptr) {
            freed.record(&self.history, shard.stream);
        }
        Ok(())
    }

    /// A free that waits for the next device synchronisation (see
    /// [`crate::Allocator::free_after_device_sync`]). Returns the device's deferred bytes.
    pub fn free_after_sync(&self, shard: &Arc<Shard>, ptr: DevicePtr, segment: DevicePtr) -> Result<usize, Error> {
        let _python = if self.history.on() { self.history.python_scope(HistoryContext::All) } else { Scope::none() };
        let ctx = self.ctx(shard);
        let mut st = self.shards.lock_for_change(shard);
        let freed = if self.history.on_or_tagged() { st.about_to_free(&self.history, ptr) } else { None };
        let bytes = st.free_after_sync(&ctx, ptr, segment)?;
        if let Some(mut freed) = freed.filter(|_| !st.is_allocated(ptr)) {
            freed.at_once = false;
            freed.record(&self.history, shard.stream);
        }
        self.finish(st, ());
        crate::callout::raise_if_exiting();
        Ok(bytes)
    }

    /// The end of a call on the hit path whose thread ended in a callout (`crate::callout`),
    /// from `finish_slow` once the call is complete: the block a growth made for it (`grown`,
    /// 0 for none), which the program will never get, goes back, and the thread's end goes on.
    /// Inside a cold path that ends the call itself ([`crate::callout::Deferred`]), nothing.
    #[cold]
    #[inline(never)]
    pub(in crate::caching) fn end_exiting_call(&self, grown: DevicePtr) {
        if crate::callout::deferred() {
            return;
        }
        if grown != 0 {
            self.give_back_block(grown);
        }
        crate::callout::raise_if_exiting();
    }

    /// [`crate::callout::end_of_malloc`] for a malloc of this device: its block given back
    /// through the segment index.
    pub(super) fn end_of_malloc(&self, r: Result<DevicePtr, Error>) -> Result<DevicePtr, Error> {
        crate::callout::end_of_malloc(r, |p| self.give_back_block(p))
    }

    /// Frees the block at `ptr` of this device, made for a call whose thread ended.
    fn give_back_block(&self, ptr: DevicePtr) {
        let seg = self.index.with_segment(ptr, |s| s.map(|e| (e.owner.clone(), e.base)));
        if let Some((shard, base)) = seg {
            let _ = self.free(&shard, ptr, base);
        }
    }

    /// PyTorch `recordStream` on the block at `ptr` of `shard`'s segment at `segment`.
    pub fn record_stream(
        &self,
        shard: &Arc<Shard>,
        ptr: DevicePtr,
        segment: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        shard.lock_hot().record_stream(ptr, segment, shard.stream, stream)
    }
}
