//! The fallback of a request to the default pools that would fail with out of memory: the
//! cache of the pools created with `POOL_USE_ON_OOM` (PyTorch `try_mempool_fallback`, PR
//! #151487, moved before the cache's release by PR #169699).
//!
//! The rules, PyTorch's unless said:
//! - Only a request to the default pools falls back; one routed to a private pool fails as it
//!   did ("if already trying to use a mempool, then just oom").
//! - Where: once the cache and a new segment have failed (and gpupool's release of the
//!   stream's oversize cached segments, with `max_split_size` set, which runs under the
//!   stream's lock with the segment's growth; PyTorch tries the fallback before it), before
//!   anything else is released: the default pools' budget path, release-and-retry and the
//!   out-of-memory observers come after, and only if no fallback pool served.
//! - What: a cached free block of the fallback pool on the request's stream (PyTorch's
//!   `get_free_block` on the pool's block pool, which holds one stream's blocks per request),
//!   its completed events processed first (PyTorch processes every pool's at the start of
//!   malloc). Never a new segment: the fallback pool does not grow, so its budget, and the
//!   memory fraction, hold. The block is split as the fallback pool splits (not at all for a
//!   `POOL_NO_SPLIT` pool), and belongs to the fallback pool: it counts in that pool's
//!   statistics and the device's, and goes back to that pool's cache when freed, wherever.
//! - Which pools, in which order: the fallback pools with memory on the device, by increasing
//!   id (creation order); the first whose cache serves takes the request. PyTorch walks an
//!   unordered set. Pools released on the device, and sleeping ones, are skipped (PyTorch's
//!   `~MemPool` takes a pool out of the set, PR #169699).
//! - Where gpupool differs: a fallback pool's cache on a stream where it keeps a segment for a
//!   CUDA graph serves no fallback (a graph replays into its free blocks too; PyTorch hands
//!   them out).
//! - A request served so is no out-of-memory: not counted in `num_ooms`, no `oom` event in the
//!   history, no observer called (PyTorch falls back before all three).

use std::sync::Arc;

use super::flags;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::{Request, Shard};
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;

impl DeviceAllocator {
    /// The fallback of a default-pool request `req` on `stream` that would fail with out of
    /// memory (see the module): a block from the first fallback pool whose cache on `stream`
    /// serves it, `None` when none does (or the request is a private pool's, `pool != 0`).
    ///
    /// Errors: [`Error::Cuda`] when processing a fallback pool's events fails (PyTorch's
    /// `process_events` throws there too); nothing is handed out then.
    #[cold]
    #[inline(never)]
    pub(in crate::caching) fn serve_fallback(
        &self,
        pool: u64,
        stream: StreamHandle,
        req: &Request,
    ) -> Result<Option<DevicePtr>, Error> {
        if pool != 0 || !flags::any_use_on_oom() {
            return Ok(None);
        }
        let mut candidates: Vec<Arc<Shard>> = self
            .shards
            .all()
            .into_iter()
            .filter(|s| s.pool != 0 && s.stream == stream && flags::use_on_oom(s.pool))
            .collect();
        candidates.sort_unstable_by_key(|s| s.pool);
        for shard in candidates {
            if self.refuse_asleep(shard.pool).is_err() {
                continue;
            }
            if let Some(ptr) = self.serve_from_cache(&shard, req)? {
                self.note_pool_peak(shard.pool);
                return Ok(Some(ptr));
            }
        }
        Ok(None)
    }

    /// `req` served from `shard`'s cache only, as its pool serves (its alignment, its splits);
    /// `None` when the shard was released or retired, or nothing cached fits.
    fn serve_from_cache(&self, shard: &Arc<Shard>, req: &Request) -> Result<Option<DevicePtr>, Error> {
        let req = match shard.source.as_ref().map(|s| s.split_alignment).filter(|&a| a > 0) {
            // A request the pool's alignment cannot round is one it cannot serve.
            Some(align) => match req.aligned(align) {
                Ok(r) => r,
                Err(_) => return Ok(None),
            },
            None => *req,
        };
        let ctx = self.ctx(shard);
        let mut st = self.shards.lock_for_change(shard);
        // A segment kept for a CUDA graph is the graph's at every replay, free blocks included:
        // handing one to an eager request would let the two overwrite each other. PyTorch does
        // not look (its hazard); gpupool skips such a pool's cache on the stream.
        if shard.is_retired() || st.released || st.asleep.is_some() || st.graph_segments() > 0 {
            return Ok(self.finish(st, None));
        }
        self.process_events(&mut st, || ctx)?;
        let Some(id) = st.take_cached(&req, &self.rules) else {
            return Ok(self.finish(st, None));
        };
        let ptr = st.hand_out(id, &req, self.max_split_size);
        if self.history.on_or_tagged() {
            st.record_alloc_at(&self.history, shard.stream, ptr, req.size);
        }
        Ok(Some(self.finish(st, ptr)))
    }
}
