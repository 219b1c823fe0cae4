//! A stream about to be destroyed (`gpupool_stream_retire`; not in PyTorch, whose streams come
//! from its own pool and are never destroyed). gpupool keys a stream's pools by its handle, as
//! PyTorch does (`BlockPool` by `cudaStream_t`), and reuses a block freed on a stream for the
//! next request on that handle without an event: the stream's order makes it safe. CUDA hands
//! a destroyed stream's handle to the next stream created, at once and while the old stream's
//! work still runs (on an H200, 1,000 create/destroy cycles gave one handle, with work pending
//! at each destroy: `examples/c/stream_id_cost.c`; rapidsai/rmm#2251). The new stream is not
//! ordered after the old one's work, so a block freed on the old stream and still read by its
//! kernels could be handed to the new one and overwritten: `tests/gpu/test_streams.cu` read
//! 40% of its words wrong so on two H200s (2026-11-29).
//!
//! Telling the two streams apart on every malloc would take the driver's unique id
//! (`cuStreamGetId`, 25 ns a call on that H200, against 55-65 ns for the whole hit pair), so
//! the hit path keeps the handle, and a program that destroys a stream says so first:
//! [`Allocator::retire_stream`] waits for the stream's work when gpupool holds any block or
//! segment of it (rapidsai/rmm#649's `invalidate_stream`, its "trivial implementation"), after
//! which what was freed on it is free for whatever stream gets the handle next. So does a live
//! block in use on the stream (`record_stream`), which then forgets the use: its free would
//! otherwise record an event on the destroyed handle. A stream gpupool never served costs no
//! wait.
//!
//! - `mod.rs`: [`Allocator::retire_stream`], and the two looks at a shard's live blocks it
//!   makes (a use on the stream, then forgetting it), each only where the shard's `uses`
//!   says a live block may be in use on the stream.
//! - `uses.rs`: [`UsedStreams`], the streams `record_stream` named for a shard's live blocks.
//! - `tests`: on the simulated device (whose `cuStreamSynchronize` runs the work a test holds
//!   on the stream): the wait, the refusals, the driver's faults; `uses_tests`: the set of
//!   streams named, its bound, and the invariant checker's rule.

mod uses;

pub(crate) use uses::UsedStreams;

use crate::caching::allocator::Allocator;
use crate::caching::ipc::EXPORTED;
use crate::caching::shard::ShardState;
use crate::driver::StreamHandle;
use crate::error::Error;

impl Allocator {
    /// Before `stream` of `device` (-1: the current device) is destroyed: when any pool of the
    /// device (the default pools or a private pool) has a shard for the stream, or a live
    /// block of the device is in use on it (`record_stream`), waits for the stream's work
    /// (`cuStreamSynchronize`), so that the blocks freed on it, which the next stream given
    /// the same handle reuses without an event, are no longer in use; then the live blocks
    /// forget their use on it, whose work is done, so that their free records no event on the
    /// destroyed handle (a driver error, or an event of the next stream given the handle).
    /// Returns whether it waited. Call it last before `cudaStreamDestroy`, with no work queued
    /// on the stream after it.
    ///
    /// Cost: without a shard of the stream, each shard of the device locked in turn and asked
    /// whether `record_stream` named the stream for a live block (a set of such streams; its
    /// live blocks are read only where it did, as after a wait, to forget the uses); no
    /// driver call.
    ///
    /// Errors, each leaving every pool as it was: [`Error::InvalidValue`] for a device out of
    /// range and for one of CUDA's default streams (handles 0, 1 and 2: never destroyed);
    /// [`Error::Capture`] for a stream that captures a CUDA graph (a wait would invalidate the
    /// capture: end it first); [`Error::Cuda`] when the driver cannot read the capture status
    /// or wait (the stream's work may then still use what was freed on it).
    ///
    /// Thread-safe; takes the device's shard table lock briefly and each shard's lock in turn
    /// (so a shard's sleep or wake under way, which holds its lock, delays the retire), and no
    /// lock while it waits.
    pub fn retire_stream(&self, device: i32, stream: StreamHandle) -> Result<bool, Error> {
        if stream <= 2 {
            return Err(Error::InvalidValue(format!(
                "stream {stream:#x} is one of CUDA's default streams (legacy or per-thread), which are never \
                 destroyed: there is nothing to retire (gpupool_stream_retire)"
            )));
        }
        let dev = self.device_or_init(device)?;
        let shards = dev.shards.all();
        if !shards.iter().any(|s| s.stream == stream || s.lock().uses_stream(stream)) {
            return Ok(false);
        }
        let d = dev.device;
        let what = |doing: &str| format!("{doing} stream {stream:#x} of device {d} before it is destroyed");
        let status = self
            .driver
            .stream_capture_status(d, stream)
            .map_err(|e| Error::driver_call(e, &what("reading the capture status of")))?;
        if status.is_capturing() {
            return Err(Error::Capture(format!(
                "stream {stream:#x} of device {d} captures a CUDA graph: waiting for it would invalidate the \
                 capture; end the capture before retiring the stream (gpupool_stream_retire)"
            )));
        }
        self.driver
            .stream_synchronize(d, stream)
            .map_err(|e| Error::driver_call(e, &what("waiting for the work of")))?;
        for shard in &shards {
            shard.lock().forget_stream_use(stream);
        }
        Ok(true)
    }
}

impl ShardState {
    /// Notes that `record_stream` named `stream` for a live block (its first use of that
    /// block), for [`ShardState::uses_stream`]; past the set's bound, rebuilds it from the live
    /// blocks (a look at each).
    pub(in crate::caching) fn note_stream_use(&mut self, stream: StreamHandle) {
        if self.retire_uses.note(stream) {
            let (live, blocks) = (&self.live, &self.blocks);
            let named = live.values().flat_map(|&id| blocks[id].stream_uses.iter().copied());
            self.retire_uses.rebuild(named.filter(|&s| s != EXPORTED));
        }
    }

    /// Whether a live block is in use on `stream` besides its own (`record_stream`). A stream
    /// noted that no live block uses any more (their frees came after the note) is forgotten.
    fn uses_stream(&mut self, stream: StreamHandle) -> bool {
        if !self.retire_uses.may_hold(stream) {
            return false;
        }
        let used = self.live.values().any(|&id| self.blocks[id].stream_uses.contains(&stream));
        if !used {
            self.retire_uses.forget(stream);
        }
        used
    }

    /// Drops `stream` from the uses of every live block: its work is done (the retire waited).
    /// Never the all-ones handle, which also marks an exported block (`ipc`): a stream of that
    /// handle keeps its uses, and the exports their marks.
    fn forget_stream_use(&mut self, stream: StreamHandle) {
        if stream == EXPORTED || !self.retire_uses.may_hold(stream) {
            return;
        }
        for &id in self.live.values() {
            let uses = &mut self.blocks[id].stream_uses;
            if uses.contains(&stream) {
                *uses = uses.iter().copied().filter(|&s| s != stream).collect();
            }
        }
        self.retire_uses.forget(stream);
    }

    /// The invariant checker's rule: every stream a live block is in use on (`record_stream`;
    /// an export's mark aside) is noted, so that a retire skipping the shard skips no use.
    pub(in crate::caching) fn check_retire_uses(&self) -> Result<(), String> {
        for &id in self.live.values() {
            let b = &self.blocks[id];
            if let Some(&s) = b.stream_uses.iter().find(|&&s| s != EXPORTED && !self.retire_uses.may_hold(s)) {
                return Err(format!(
                    "live block {:#x} is in use on stream {s:#x}, which the retire's set does not note",
                    b.addr
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod uses_tests;
