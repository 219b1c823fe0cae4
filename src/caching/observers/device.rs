//! The rest of PyTorch's `DeviceCachingAllocator::malloc` once the cache and a new segment
//! have failed: release-and-retry, then the out-of-memory observers, one more attempt if one
//! of them asked, and the error with its message.
//!
//! Called from [`DeviceAllocator::malloc`] with the shard unlocked: the calling thread holds no
//! lock of gpupool's here, so an observer may call back into the allocator (free, stats,
//! empty_cache, malloc on any stream). Each step below takes its locks and drops them before
//! the next. (The thread's cache of recent shards is lent to this call, read-only: a nested call
//! that misses it leaves it as it is, see `Allocator::with_shard`.)

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::message;
use crate::caching::accounting::counters::bump;
use crate::caching::budget;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::{Request, Shard};
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;
use crate::history::tags;

impl DeviceAllocator {
    /// The out-of-memory path of `malloc` for `req` on `stream`:
    /// 0. a request to the default pools is served from the cache of a pool created with
    ///    `POOL_USE_ON_OOM` if one can ([`DeviceAllocator::serve_fallback`], PyTorch
    ///    `try_mempool_fallback`, tried before any release since PR #169699): then it is no
    ///    out-of-memory (no count, no event, no observer), whatever refused it (the driver, the
    ///    memory fraction, or the default pools' budget);
    ///    when the request's pool's budget refused it, the pool's own path next
    ///    ([`DeviceAllocator::malloc_over_budget`]);
    /// 1. release-and-retry ([`DeviceAllocator::release_and_retry`]);
    /// 2. if that fails, the request counts in `num_ooms` (once, as PyTorch counts before its
    ///    observers run), and `observers` are called in the order attached;
    /// 3. if any asked, one more attempt: the cache, a new segment, release-and-retry again
    ///    (RMM's `failure_callback_resource_adaptor` retries while its callback asks; gpupool
    ///    once, so that an observer that frees nothing cannot loop). The observers are not
    ///    called again;
    /// 4. the out-of-memory error, its figures read after the last attempt.
    ///
    /// Errors: [`Error::OutOfMemory`] as above; [`Error::Cuda`] when a driver call fails on the
    /// way.
    #[cold]
    #[inline(never)]
    pub fn malloc_after_oom(&self, pool: u64, stream: StreamHandle, req: &Request) -> Result<DevicePtr, Error> {
        // The fallback pools' cache (`caching::pools::fallback`); the budget's refusal, a
        // thread-local flag, stays for the step after, which takes it.
        if let Some(ptr) = self.serve_fallback(pool, stream, req)? {
            budget::take_refusal();
            return Ok(ptr);
        }
        // The pool's budget refused: its own path (`budget.rs`), the device's if that finds
        // the device out of memory instead.
        if budget::take_refusal()
            && let Some(ptr) = self.malloc_over_budget(pool, stream, req)?
        {
            return Ok(ptr);
        }
        if let Some(ptr) = self.release_and_retry(pool, stream, req)? {
            return Ok(ptr);
        }
        if self.history.on() {
            self.record_oom(stream, req);
        }
        bump(&self.counters.num_ooms);
        // No retry for a thread an observer ended (`crate::callout`): it will never get the block.
        if self.observers.notify(self.device, req.size, || self.stats()) && !crate::callout::exiting() {
            if let Some(ptr) = self.serve_stream(pool, stream, req)? {
                return Ok(ptr);
            }
            if let Some(ptr) = self.release_and_retry(pool, stream, req)? {
                return Ok(ptr);
            }
        }
        Err(self.sleep_page_note(pool, req, self.out_of_memory(req)))
    }

    /// Blocks in IPC limbo that no process holds any more are freed first
    /// (`caching::ipc::device`). Blocks awaiting a device synchronisation are cache that a
    /// synchronisation frees, so they are tried before the whole cache goes back to the driver
    /// (not in PyTorch, which has no such blocks); then PyTorch's `release_cached_blocks` and
    /// one retry (`num_alloc_retries`). `Ok(None)`: still out of memory.
    fn release_and_retry(&self, pool: u64, stream: StreamHandle, req: &Request) -> Result<Option<DevicePtr>, Error> {
        // Blocks freed while another process imported them, and held by none now (`caching::ipc`).
        if self.reclaim_ipc_limbo() > 0
            && let Some(ptr) = self.serve_stream(pool, stream, req)?
        {
            return Ok(Some(ptr));
        }
        if self.release_deferred()? > 0
            && let Some(ptr) = self.serve_stream(pool, stream, req)?
        {
            return Ok(Some(ptr));
        }
        // While a capture may be under way the cache stays (its release would synchronise):
        // still out of memory, as PyTorch, which skips `release_cached_blocks` while
        // `captures_underway` is not empty. The refusal, checked by the release itself, is no
        // error of this request's.
        match self.release_cached_blocks() {
            Err(Error::Capture(_)) => return Ok(None),
            r => r?,
        }
        bump(&self.counters.num_alloc_retries);
        self.serve_stream(pool, stream, req)
    }

    /// The error of a private pool that cannot grow while its stream captures: the device is
    /// out of memory, and gpupool may not release its cache then (that synchronises, which
    /// would break the capture). Counted in `num_ooms`; the observers are not called (they
    /// may empty the cache).
    #[cold]
    pub(in crate::caching) fn out_of_memory_capturing(&self, shard: &Arc<Shard>, req: &Request) -> Error {
        bump(&self.counters.num_ooms);
        if budget::take_refusal() {
            return self.over_budget(shard.pool, req);
        }
        let base = self.out_of_memory(req);
        Error::OutOfMemory(format!(
            "{} (private pool {} could not grow while stream {:#x} captures a CUDA graph; gpupool does not release              its cache during capture: free memory or call gpupool_empty_cache before capturing)",
            base.message(),
            shard.pool,
            shard.stream
        ))
    }

    /// PyTorch's out-of-memory error for `req`, with the device's figures as they are now (not
    /// counted here: `malloc_after_oom` counted the request).
    pub(in crate::caching) fn out_of_memory(&self, req: &Request) -> Error {
        let largest_free = self.largest_free_blocks();
        let stats = self.stats();
        message::message(
            &*self.driver,
            &message::Report {
                device: self.device,
                req,
                stats: &stats,
                limit: self.limit.get(),
                largest_free,
                top_tags: self.top_tags(message::TOP_TAGS),
            },
        )
    }

    /// The `n` tags holding the most allocated bytes on the device, most first (name, bytes,
    /// blocks); none when no tag was ever pushed.
    fn top_tags(&self, n: usize) -> Vec<(Arc<str>, usize, usize)> {
        if !tags::in_use() {
            return Vec::new();
        }
        let contexts = &self.history.recorder().contexts;
        let mut by_tag: FxHashMap<u32, (usize, usize)> = FxHashMap::default();
        for (ctx, size) in self.live_blocks() {
            let tag = contexts.tag_of(ctx);
            if tag != 0 {
                let e = by_tag.entry(tag).or_default();
                e.0 += size;
                e.1 += 1;
            }
        }
        let mut top: Vec<(u32, usize, usize)> = by_tag.into_iter().map(|(t, (b, c))| (t, b, c)).collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        top.into_iter().take(n).filter_map(|(t, b, c)| Some((tags::name_of(t)?, b, c))).collect()
    }

    /// The largest free block of each pool, `[small, large]` in bytes, over every stream's
    /// shard (0: none). Locks one shard at a time and holds none while taking the next, as the
    /// lock order requires (a shard lock holder takes no other shard lock).
    fn largest_free_blocks(&self) -> [usize; 2] {
        let mut largest = [0; 2];
        for shard in self.shards.all() {
            let found = shard.lock().largest_free();
            for (l, f) in largest.iter_mut().zip(found) {
                *l = (*l).max(f);
            }
        }
        largest
    }
}
