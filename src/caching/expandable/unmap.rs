//! Unmapping the wholly free pages of expandable segments (the expandable half of PyTorch
//! `release_blocks`, with `unmap_block`), and giving back a range left with nothing mapped.

use super::round_up;
use crate::caching::accounting::counters::Metric;
use crate::caching::block::{BlockId, NIL};
use crate::caching::observers::segments::SegmentEventKind;
use crate::caching::segment_index::SegmentEntry;
use crate::caching::shard::{ShardCtx, ShardState};
use crate::driver::DevicePtr;
use crate::error::Error;

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, one handle for all threads.
const PER_THREAD_STREAM: usize = 2;

/// What [`ShardState::unmap_free_pages`] waits for before it unmaps: the work that may still
/// read or write the free pages of a shard. Those blocks were freed in stream order on the
/// shard's stream, and a block another stream used (`record_stream`) reaches the pool only
/// once that stream's event completed, so the shard's stream is the only one whose queued work
/// can still touch them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageWait {
    /// A device synchronisation, when the shard's stream may have been destroyed (the cache
    /// released by `empty_cache` or on out of memory, another stream's growth unmapping this
    /// shard's pages): a synchronisation of a destroyed stream crashes, as it crashes PyTorch
    /// 2.11's `emptyCache`.
    Device,
    /// An event recorded on the shard's stream now and waited for (`cuEventRecord`,
    /// `cuEventSynchronize`), when the call is on that stream (the high-water rule before a
    /// growth of the calling stream's segment): only that stream's work is waited for, not
    /// the other streams' (PyTorch's `ExpandableSegment::unmapHandles` synchronises the
    /// segment's stream likewise). Chosen by [`PageWait::for_stream`].
    Stream,
}

impl PageWait {
    /// How to wait for the work of `stream`, the calling stream: an event on it, but for the
    /// per-thread default stream (`CU_STREAM_PER_THREAD`, one handle that names each thread's
    /// own stream, so one shard for all of them: an event on the calling thread's stream would
    /// not cover another thread's work there), a device synchronisation.
    pub(crate) fn for_stream(stream: usize) -> PageWait {
        if stream == PER_THREAD_STREAM { PageWait::Device } else { PageWait::Stream }
    }
}

impl ShardState {
    /// Gives back the range of the expandable segment at `base` if nothing is mapped in it
    /// (its one block is unmapped). A failure leaves it as it is, to be tried again when the
    /// cache is next released.
    pub(super) fn free_range_if_empty(&mut self, ctx: &ShardCtx, base: DevicePtr) {
        let seg = self.segments.get_mut(&base).expect("listed");
        let (size, head) = (seg.size, seg.head);
        let e = seg.exp.as_deref_mut().expect("expandable");
        if e.mapped != 0 {
            return;
        }
        let pool = self.blocks[head].pool;
        debug_assert_eq!(self.blocks[head].next, NIL);
        // Out of the index first: once the driver has the range back, another stream may
        // reserve the same addresses. Back in if the driver refuses.
        ctx.index.remove(base);
        let reindex = scopeguard::guard((), |()| {
            ctx.index.insert(SegmentEntry { base, size, device: ctx.device, owner: ctx.shard.clone() })
        });
        if e.free(ctx.driver, ctx.device).is_err() {
            return;
        }
        scopeguard::ScopeGuard::into_inner(reindex);
        self.unmapped_set(pool).remove(&(base, head));
        self.blocks.remove(head);
        self.segments.remove(&base);
        self.expandables.retain(|&b| b != base);
        self.counters.decrease(Metric::Segment, pool, 1);
    }

    /// The expandable half of PyTorch `release_blocks` (`empty_cache`, the out-of-memory
    /// path): every wholly free page of this shard's expandable segments is unmapped (see
    /// [`ShardState::unmap_free_pages`]; its handle goes to the device's pool, which the
    /// device releases once every shard is done), and a range left with nothing mapped is
    /// given back. Returns the bytes unmapped.
    ///
    /// Errors: [`Error::Cuda`] when the synchronisation or an unmapping fails; what was
    /// unmapped stays unmapped, the rest stays cached.
    pub fn release_pages(&mut self, ctx: &ShardCtx) -> Result<usize, Error> {
        let released = self.unmap_free_pages(ctx, usize::MAX, None, None, PageWait::Device);
        for base in self.expandables.clone() {
            let e = self.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
            e.release_orphans(ctx.driver, ctx.device);
            self.free_range_if_empty(ctx, base);
        }
        released
    }

    /// PyTorch `unmap_block` over the free blocks of this shard's expandable segments, the
    /// largest first, until `want` bytes are unmapped (whole pages; the last block gives only
    /// what is still wanted, from its lower end), skipping blocks that overlap `keep`, and
    /// with `page`, blocks of ranges of another page size (a growth can map only handles of
    /// its own page size: the high-water rule unmaps those). The
    /// handles unmapped go to the device's page pool (PyTorch releases them). First, if
    /// anything is to be unmapped, the work that may still use those pages is waited for as
    /// `wait` says (with the shard's lock held, so that no block of this stream is handed out
    /// and freed again meanwhile): a block freed in stream order may still be in use by work
    /// queued before its free, and `cuMemUnmap` does not wait for it. Returns the bytes
    /// unmapped.
    ///
    /// Errors: [`Error::Cuda`] when the wait or an unmapping fails; what was unmapped stays
    /// unmapped, the rest stays cached.
    pub fn unmap_free_pages(
        &mut self,
        ctx: &ShardCtx,
        want: usize,
        keep: Option<std::ops::Range<DevicePtr>>,
        page: Option<usize>,
        wait: PageWait,
    ) -> Result<usize, Error> {
        // (segment base, block, first page offset, end offset) of each free block with whole
        // pages outside `keep`'s pages, largest first. `keep` starts at a block's address, so
        // a block overlapping it starts in it: only its pages after `keep` are candidates.
        let mut candidates: Vec<(DevicePtr, BlockId, u64, u64)> = Vec::new();
        for pool in [&self.small, &self.large] {
            for (size, addr, id) in pool.iter_largest_first() {
                if !self.blocks[id].expandable {
                    continue;
                }
                let end = addr + size as u64;
                let (base, e) = self.expandable_of(addr);
                if page.is_some_and(|p| p != e.page) {
                    continue;
                }
                let page = e.page as u64;
                let mut lo = (addr - base).div_ceil(page) * page;
                let mut hi = (end - base) / page * page;
                if let Some(k) = keep.as_ref().filter(|k| k.start >= base && k.start - base < e.size as u64) {
                    if addr >= k.start {
                        lo = lo.max((k.end - base).div_ceil(page) * page);
                    } else {
                        hi = hi.min((k.start - base) / page * page);
                    }
                }
                if hi > lo {
                    candidates.push((base, id, lo, hi));
                }
            }
        }
        candidates.sort_by_key(|c| std::cmp::Reverse(c.3 - c.2));
        // A sleeping shard maps nothing (and one a sleep is copying keeps its pages), and a segment a CUDA graph uses (a sleepable private
        // pool's) keeps its free pages: the graph writes there at every replay.
        if self.keeps_pages() {
            return Ok(0);
        }
        candidates.retain(|c| self.releasable(c.0));
        let mut released = 0;
        // The device synchronisation below would break a capture, which may be under way while
        // a route to a private pool is active: the pages stay mapped until then.
        if candidates.is_empty() || ctx.capture.any_underway() {
            return Ok(0);
        }
        self.wait_for_pages(ctx, wait)?;
        for (base, id, lo, hi) in candidates {
            if released >= want {
                break;
            }
            let (before, page) = {
                let e = self.segments[&base].exp.as_deref().expect("expandable");
                (e.mapped, e.page)
            };
            let left = (want - released) as u64;
            let len = if left >= hi - lo { hi - lo } else { round_up(left as usize, page) as u64 };
            // The block follows the page table whatever happens, unwinding included, the
            // handles unmapped go to the device's pool (still device memory: the limit keeps
            // counting them), and the pages unmapped are recorded.
            if ctx.segments.on() {
                self.observe_now(ctx, SegmentEventKind::Unmap, base + lo, len as usize);
            }
            let mut spare = Vec::new();
            let mut g = scopeguard::guard((&mut *self, &mut spare), |(st, spare)| {
                ctx.shard.budget.adjust(st.adopt(base, std::iter::once(id), before));
                ctx.pages.put(page, spare);
                if ctx.history.on() {
                    let c = st.segments[&base].ctx;
                    st.record_pages(ctx, base, lo as usize, len as usize, false, c);
                }
            });
            let (st, spare) = &mut *g;
            let e = st.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
            let r = e.unmap(ctx.driver, ctx.device, lo as usize, len as usize, spare);
            drop(g);
            released += before - self.segments[&base].exp.as_deref().expect("expandable").mapped;
            if r.is_err() && ctx.segments.on() {
                // What the driver kept mapped is told mapped again.
                self.observe_mapped(ctx, base, lo as usize, len as usize);
            }
            r.map_err(|e| Error::driver(e, "unmapping the free pages of an expandable segment"))?;
        }
        Ok(released)
    }

    /// Waits as `wait` says for the work that may still use this shard's free pages (see
    /// [`PageWait`]). The event comes from, and goes back to, the shard's idle events.
    fn wait_for_pages(&mut self, ctx: &ShardCtx, wait: PageWait) -> Result<(), Error> {
        match wait {
            PageWait::Device => ctx.driver.device_synchronize(ctx.device).map_err(|e| {
                Error::driver(e, "synchronising the device before unmapping the free pages of expandable segments")
            }),
            PageWait::Stream => {
                let ev = self.events.record(ctx.driver, ctx.device, ctx.shard.stream).map_err(|e| {
                    Error::driver(e, "recording an event on the stream before unmapping its free pages")
                })?;
                // Back to the idle events whatever happens, unwinding included.
                let events = scopeguard::guard(&mut self.events, |events| events.unused([ev]));
                let r = ctx.driver.event_synchronize(ev);
                drop(events);
                r.map_err(|e| Error::driver(e, "waiting for the stream's work before unmapping its free pages"))
            }
        }
    }
}
