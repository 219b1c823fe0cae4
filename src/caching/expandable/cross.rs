//! The high-water rule across page sizes (gpupool's, not in PyTorch): a growth in pages of
//! one size that the free pages of its size cannot hold at the mark takes the physical memory
//! of free pages of the smaller sizes, unmapped and released (`cuMemUnmap`, `cuMemRelease`),
//! so that the pages it creates (`cuMemCreate`) stay within the device's high-water mark.
//!
//! A range has one page size and a handle maps only where pages of its size go, so a free
//! 2 MiB page cannot be mapped in a range of 20 MiB pages; before this, the rule unmapped only
//! the growth's size and grew past the mark while the smaller pages stayed mapped (BERT at
//! random lengths reserved more with the rule than without it, issue 39; `pipeline_streams`'
//! warm pass 1.42 of live on the simulated device, 1.105 with this). Only smaller sizes: a
//! 20 MiB page released for a 2 MiB growth frees ten times what the growth needs, and the
//! next growth of 20 MiB pages creates it again (measured on the simulated device, 2026-11-28:
//! the synthetic BERT trace's warm pass went from no driver call to 240 pages unmapped, for
//! 1.052 of live against 1.058; `docs/fragmentation.md`). Releasing a handle and creating
//! another costs a `cuMemRelease` and a `cuMemCreate` more than moving it; mapping the small
//! handles in a large page's place (GMLake's stitching) would save them, and is not built.

use super::PageWait;
use crate::caching::shard::{ShardCtx, ShardState};
use crate::driver::DevicePtr;

impl ShardState {
    /// For a growth in `page`-byte pages that passes the high-water mark by `want` bytes once
    /// this shard's free pages of its own size are unmapped: the free pages of each smaller
    /// size of this shard outside `keep` are unmapped into the device's page pool (after
    /// waiting as `wait` says), then handles of the smaller sizes are released from the pool
    /// until `want` bytes are (see [`release_smaller`]). Returns the bytes released.
    /// Opportunistic, as the rule is: a failure leaves pages cached or handles held, and the
    /// growth maps past the mark.
    pub(super) fn reclaim_smaller_pages(
        &mut self,
        ctx: &ShardCtx,
        want: usize,
        keep: Option<std::ops::Range<DevicePtr>>,
        page: usize,
        wait: PageWait,
    ) -> usize {
        for smaller in smaller_pages(ctx, page) {
            let _ = self.unmap_free_pages(ctx, want, keep.clone(), Some(smaller), wait);
        }
        release_smaller(ctx, page, want)
    }
}

/// The page sizes of the device's ranges below `page`, smallest first.
pub(crate) fn smaller_pages(ctx: &ShardCtx, page: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = ctx.expandable.iter().flat_map(|p| p.page_sizes().map(|s| s.1)).collect();
    sizes.retain(|&s| s < page);
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// Releases held handles smaller than `page` from the device's page pool until `want` bytes
/// are released or none is left ([`PagePool::release_smaller`]). Returns the bytes
/// released; a handle the driver refuses stays held, for the next release.
///
/// [`PagePool::release_smaller`]: crate::caching::expandable::PagePool::release_smaller
pub(crate) fn release_smaller(ctx: &ShardCtx, page: usize, want: usize) -> usize {
    ctx.pages.release_smaller(ctx.driver, ctx.device, ctx.limit, page, want).0
}
