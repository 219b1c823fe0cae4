//! gpupool's high-water rule for expandable segments (`GPUPOOL_EXPANDABLE_RECLAIM`; not in
//! PyTorch, which unmaps pages only in `empty_cache` and on out of memory): what growing past
//! the device's high-water mark does first.

use super::PageWait;
use crate::caching::block::BlockId;
use crate::caching::shard::{ShardCtx, ShardState};

/// gpupool's rule for expandable segments (not in PyTorch, which unmaps pages only when the
/// cache is released): the device's physical bytes (reserved, and pages held unmapped in its
/// pool) do not pass their high-water mark while wholly free pages are mapped anywhere on the
/// device. Before an expandable segment creates pages past the mark, free pages are unmapped
/// instead (after the growing stream's work is waited for, see `ShardState::unmap_free_pages`;
/// other streams' pages after a device synchronisation) and their handles,
/// held in the device's page pool, are mapped where the growth needs them, so that memory
/// freed by one request or one stream holds the next one's growth, wherever it must be mapped,
/// without a page created or released. The mark counts physical memory because that is what
/// the rule saves: unmapping a page into the pool frees nothing on the device, so it must not
/// lower what counts (a growth would then create past the real peak), and mapping a held
/// handle takes nothing new, so it must not raise it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reclaim {
    /// Grow without unmapping (the rule is off).
    Off,
    /// Unmap free pages of this shard, then grow.
    Shard,
    /// Unmap free pages of this shard; if that is not enough, answer
    /// [`Growth::PastMark`](crate::caching::shard::Growth::PastMark) so that the caller,
    /// holding no shard lock, unmaps other streams' pages first.
    Device,
}

impl ShardState {
    /// The high-water rule before [`ShardState::grow_expandable`] creates `bytes` of new pages
    /// (those its held handles do not cover) for a request of `rounded` bytes whose plan
    /// starts at block `start` in a range of `page`-byte pages: with the rule on, free pages
    /// of that size of this shard are unmapped into the device's pool, as many as the growth
    /// passes the mark by, for the growth to map; if they are too few, this shard's free pages
    /// of the smaller sizes are unmapped and their handles released for the growth to create
    /// its own within the mark (`cross`). Returns the bytes it
    /// would still pass the mark by when the caller must unmap other streams' pages before it
    /// grows ([`Reclaim::Device`]; a range the growth reserved and left empty is given back
    /// then), `None` when the growth goes on.
    pub(super) fn reclaim_before_growth(
        &mut self,
        ctx: &ShardCtx,
        start: BlockId,
        rounded: usize,
        page: usize,
        bytes: usize,
    ) -> Option<usize> {
        let over = ctx.limit.over_mark(bytes);
        if over > 0 && ctx.reclaim != Reclaim::Off {
            // The free pages outside the bytes the request will take (the free blocks the plan
            // walks may hold more than it needs), as many as it passes the mark by. The plan
            // stays valid: the blocks it maps keep their addresses (a block after them that is
            // unmapped merges into the last of them). Opportunistic: a failure to synchronise
            // or unmap leaves those pages cached (the next release of the cache reports it),
            // and the request maps past the mark.
            let at = self.blocks[start].addr;
            // The call is on this shard's stream (a growth serves a malloc on it), so only that
            // stream's work is waited for (see `PageWait::for_stream`).
            let (keep, wait) = (at..at + rounded as u64, PageWait::for_stream(ctx.shard.stream));
            let mut unmapped = self.unmap_free_pages(ctx, over, Some(keep.clone()), Some(page), wait).unwrap_or(0);
            // Then the smaller page sizes' free pages, released (see `cross`).
            if unmapped < over {
                unmapped += self.reclaim_smaller_pages(ctx, over - unmapped, Some(keep), page, wait);
            }
            if unmapped < over && ctx.reclaim == Reclaim::Device {
                let base = self.expandable_of(at).0;
                self.free_range_if_empty(ctx, base);
                return Some(over - unmapped);
            }
        }
        None
    }
}
