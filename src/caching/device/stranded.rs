//! Streams that come and go (gpupool's, not in PyTorch): the cache of a stream that holds no
//! block any more serves the device's other streams instead of stranding there.
//!
//! PyTorch keeps each stream's free blocks for that stream until the device runs out of
//! memory: a program that creates a stream for each request or step leaves each old stream's
//! cache behind, and reserved memory climbs to the device's size before the out-of-memory
//! path releases it all (vLLM saw 2 GiB a step stranded so, vllm-project/vllm PR #52951).
//! Here, before a stream's growth takes the device's physical memory past its high-water mark,
//! the cache of every other stream that is *unused* (no allocated block, no block awaiting an
//! event, a synchronisation or a capture's end: [`ShardState::is_unused`]) is released as
//! `empty_cache` releases it: its wholly free ordinary segments go back to the driver
//! (`cuMemFree` waits for the work queued on them), the free pages of its expandable segments
//! are unmapped after a device synchronisation into the device's page pool, for the growth to
//! map (`page_pool`), and shards left holding nothing are retired. A stream that still holds a
//! block keeps its cache, as in PyTorch.
//!
//! Cost: nothing on the hit path; a growth past the mark with other streams in the table looks
//! at each of them, so a scan is due only once the bytes grown past the mark since the last
//! scan reach [`SCAN_BYTES_PER_SHARD`] per shard in the table: growths of a few pages over
//! thousands of streams that all hold blocks scan rarely (amortised, a constant per byte
//! grown), while a step's worth of growth on a new stream scans at once.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::DeviceAllocator;
use crate::caching::shard::Shard;

/// Bytes grown past the high-water mark, per shard in the table, that make a scan for unused
/// streams due. 2 MiB: a small pool segment, the least a growth takes.
pub(super) const SCAN_BYTES_PER_SHARD: usize = 2 << 20;

impl DeviceAllocator {
    /// Whether a growth of `bytes` on `shard` should first release the cache of unused
    /// streams: it takes the device's physical memory past its high-water mark, another stream
    /// is in the table, and enough has been grown past the mark since the last scan. Counts
    /// `bytes` towards the next scan when it is not due yet.
    pub(super) fn stranded_due(&self, shard: &Shard, bytes: usize) -> bool {
        if shard.pool != 0 || !self.release_unused_streams || self.limit.over_mark(bytes) == 0 {
            return false;
        }
        let shards = self.shards.len();
        if shards <= 1 {
            return false;
        }
        let grown = self.grown_past_mark.fetch_add(bytes, Ordering::Relaxed) + bytes;
        grown >= shards.saturating_mul(SCAN_BYTES_PER_SHARD)
    }

    /// Releases the cache of every unused stream of the device's default pools but `shard`'s
    /// (each locked in turn; the caller holds none), then retires the shards left holding
    /// nothing. Returns the bytes of physical memory the device gave back or holds unmapped
    /// for the next growth. Opportunistic: a failure leaves that stream's cache as it was,
    /// for the next scan or `empty_cache`.
    pub(super) fn release_unused_streams(&self, shard: &Arc<Shard>) -> usize {
        self.grown_past_mark.store(0, Ordering::Relaxed);
        if self.capture.any_underway() {
            return 0;
        }
        let (reserved, held) = (self.limit.reserved(), self.pages.held());
        let mut released = false;
        for other in self.shards.all() {
            if Arc::ptr_eq(&other, shard) || other.pool != 0 {
                continue;
            }
            // Most streams hold blocks: look before locking for a change.
            if !other.lock().is_unused_with_cache() {
                continue;
            }
            let ctx = self.ctx(&other);
            let mut st = self.shards.lock_for_change(&other);
            if !other.is_retired() && st.is_unused_with_cache() {
                released |= st.release_cached(&ctx).is_ok();
            }
            self.finish(st, ());
        }
        if released {
            self.retire_idle_shards();
        }
        let mapped_given = (reserved - self.limit.reserved()).max(0) as usize;
        mapped_given + self.pages.held().saturating_sub(held)
    }
}
