//! Expandable segments (PyTorch's `expandable_segments:True`), every part: a segment is an
//! address range reserved per (stream, pool) whose pages are mapped as requests need them, so
//! that it grows instead of a new segment being allocated, and whose wholly free pages are
//! unmapped when the cache is released.
//!
//! The blocks of an expandable segment tile its whole range, as an ordinary segment's do:
//! mapped blocks (free, allocated, awaiting events or a synchronisation) and unmapped blocks
//! (whole pages, [`BlockState::Unmapped`](crate::caching::block::BlockState::Unmapped), in
//! the pool's set of unmapped blocks ordered by address). Two unmapped blocks are never
//! neighbours, nor are two free ones.
//!
//! In reading order:
//! - [`segment`]: one range and its page table on the driver's virtual memory calls (PyTorch
//!   `ExpandableSegment`); it knows pages only;
//! - [`page_pool`]: the device's physical pages held unmapped, which growths map before they
//!   create any;
//! - this file: how ranges are sized ([`ExpandablePolicy`]), and which range of a shard holds
//!   an address;
//! - [`grow`]: [`ShardState::grow_expandable`], PyTorch `try_allocate_expandable_block` with
//!   `find_expandable_block` and `map_block`;
//! - [`pages`]: a shard's blocks following the page table once pages are mapped or unmapped;
//! - [`unmap`]: [`ShardState::release_pages`], the expandable half of PyTorch `release_blocks`,
//!   with `unmap_block`;
//! - [`high_water`]: gpupool's high-water rule, [`Reclaim`]; [`cross`]: the rule across page
//!   sizes (smaller free pages released for a growth);
//! - `tests.rs`: how ranges are sized, and their pages; `segment_tests.rs`: [`segment`]'s
//!   tests on the simulated driver (pages mapped and unmapped, failures undone, orphans).
//!
//! A shard's free mapped bytes by page size are read for `Allocator::breakdown` in
//! `caching::breakdown`.
//!
//! Where gpupool differs: the address range is sized by use (see [`ExpandablePolicy`]) rather
//! than 1.125 times the device's memory per stream and pool, so that thousands of streams do
//! not exhaust the address space, and a shard may hold several ranges per pool; before pages
//! are unmapped when the cache is released the device is synchronised, never a stream (a
//! stream the program destroyed would crash `cudaStreamSynchronize`, as it crashes PyTorch
//! 2.11's `emptyCache`), and before the high-water rule unmaps the growing stream's own pages
//! an event recorded on that stream is waited for (see `unmap::PageWait`); a map that
//! fails halfway is undone (PyTorch keeps what it mapped); each range counts as a segment
//! (PyTorch counts none); pages are 2 MiB in both pools, and 20 MiB (or larger, the
//! ladder of [`ExpandablePolicy::page_for`]) in ranges of their own for requests of 20 MiB
//! and more unless 2 MiB pages map fewer bytes for the growth ([`grow`]; PyTorch maps 2 MiB
//! pages in its small pool and 20 MiB pages for every request of its large pool); a segment
//! does not grow past the device's high-water mark while
//! free pages are mapped (see `Reclaim`; PyTorch unmaps only in `empty_cache` and on out of
//! memory); and an unmapped page keeps its physical handle in the device's pool, for the next
//! growth of any stream to map ([`page_pool`]; PyTorch releases it).

mod cross;
mod grow;
mod high_water;
mod page_pool;
mod pages;
mod segment;
mod unmap;

#[cfg(test)]
mod tests;

pub(crate) use cross::{release_smaller, smaller_pages};
pub(crate) use high_water::Reclaim;
pub(crate) use page_pool::PagePool;
pub(crate) use segment::Expandable;
pub(crate) use unmap::PageWait;

use crate::caching::block::BlockId;
use crate::caching::rules::PoolKind;
use crate::caching::shard::ShardState;
use crate::driver::DevicePtr;

/// How a device's expandable segments are laid out. Sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExpandablePolicy {
    /// Page size of the small pool's segments (PyTorch: `kSmallBuffer`, 2 MiB).
    pub small_page: usize,
    /// Page size of the large pool's segments (PyTorch: `kLargeBuffer`, 20 MiB; gpupool: 2 MiB,
    /// see `device`).
    pub large_page: usize,
    /// Requests of the large pool from this many bytes on grow ranges of their own mapped in
    /// pages of `huge_page` bytes (`GPUPOOL_EXPANDABLE_LARGE_PAGES`); `usize::MAX`: never.
    pub huge_from: usize,
    /// Page size of those ranges (PyTorch's `kLargeBuffer`, 20 MiB).
    pub huge_page: usize,
    /// A request from `huge_from` on maps at most this many pages
    /// (`GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST`): its ranges' page is `huge_page` doubled until
    /// it does; 0: `huge_page` at any size (see [`ExpandablePolicy::page_for`]).
    pub pages_per_request: usize,
    /// A growth for a request from `huge_from` on maps pages of `large_page` bytes instead of
    /// its large ones where they map fewer bytes, and at most this many of them (see
    /// [`ShardState::grow_expandable`]); 0: never (with `pages_per_request` 0, and with the
    /// high-water rule).
    pub small_pages_within: usize,
    /// Those small pages only where the bytes they save (the large pages' mapping less
    /// theirs) are at least the bytes the shard's ranges of the pool would map with them over
    /// this many (see [`ShardState::grow_expandable`]); 0: wherever they save any.
    pub small_pages_saving: usize,
    /// The device's total memory (`cuMemGetInfo`): a shard's first range in the large pool
    /// is an eighth of it, in the small pool a sixty-fourth, and each further range of a pool
    /// (and page size) twice the largest it has, or the request if that is larger.
    pub device_total: usize,
}

impl ExpandablePolicy {
    /// Every (pool, page size in bytes) that ranges may have: the small pool's, the large
    /// pool's, and with large pages the large pool's ranges of large pages, each step of the
    /// ladder (see [`ExpandablePolicy::page_for`]) up to the device's memory.
    pub(crate) fn page_sizes(&self) -> impl Iterator<Item = (PoolKind, usize)> {
        let huge = self.ladder().map(|(page, _)| (PoolKind::Large, page));
        [(PoolKind::Small, self.small_page), (PoolKind::Large, self.large_page)].into_iter().chain(huge)
    }

    /// The sizes of the large pool at which [`ExpandablePolicy::page_for`] changes: requests of
    /// each size and more grow ranges of other pages than those below it.
    pub(crate) fn page_edges(&self) -> impl Iterator<Item = usize> {
        self.ladder().map(|(_, from)| from)
    }

    /// The large pages, each with the smallest request that maps it: `huge_page` from
    /// `huge_from`, then with `pages_per_request` each double of it from one byte past
    /// `pages_per_request` times the page before (a request of exactly that many pages maps
    /// them), while the page is at most the device's memory. Empty without large pages.
    fn ladder(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let first = (self.huge_from != usize::MAX).then_some((self.huge_page, self.huge_from));
        std::iter::successors(first, move |&(page, _)| {
            let n = self.pages_per_request;
            let next = page.checked_mul(2).filter(|&p| n > 0 && p <= self.device_total)?;
            Some((next, page.checked_mul(n)?.checked_add(1)?.max(self.huge_from)))
        })
    }

    /// The page size in bytes of the ranges a request of `rounded` bytes of `pool` grows: each range
    /// has one page size, and a growth looks only at ranges of the page it maps (so that blocks of
    /// 20 MiB and more, laid out in their own ranges, are moved by the high-water rule in large
    /// pages, and the small ones in small pages). With `small_pages_within`, a growth from
    /// `huge_from` on may map `large_page` pages instead, where they map fewer bytes
    /// ([`ShardState::grow_expandable`]).
    ///
    /// From `huge_from` on, the page is `huge_page` (PyTorch's 20 MiB) doubled until the
    /// request maps at most `pages_per_request` pages (gpupool's, not in PyTorch, which maps
    /// 20 MiB pages at any size). A page costs a `cuMemCreate` and a `cuMemMap` whatever its
    /// size (tens of microseconds on an H100, GPU.md), so a 4 GiB request mapped 205 driver
    /// pages; at most 16 it maps no more than an eighth of its size past what it asked for,
    /// and what it maps past it serves any request.
    pub(crate) fn page_for(&self, pool: PoolKind, rounded: usize) -> usize {
        match pool {
            PoolKind::Small => self.small_page,
            PoolKind::Large if rounded >= self.huge_from => {
                let mut page = self.huge_page;
                let n = self.pages_per_request;
                // While the request spans more than `n` pages (`rounded > n * page`); doubling
                // stops below the request, so it never overflows.
                while n > 0 && (rounded - 1) / n >= page && page <= self.device_total / 2 {
                    page *= 2;
                }
                page
            }
            PoolKind::Large => self.large_page,
        }
    }

    /// The page sizes a growth for `rounded` bytes of `pool` may map, in the order tried when
    /// none is chosen first (see [`ShardState::grow_expandable`]), each after the one before
    /// found the device (or the memory fraction) out of memory: [`page_for`]'s, then each rung
    /// of the ladder below it down to `huge_page`, then with `small_pages_within`
    /// `large_page`. What a larger page maps past the request may not fit where the request
    /// would (1,000 MiB on a 1 GiB device: 13 pages of 80 MiB do not fit, 50 of 20 MiB do),
    /// and PyTorch, which maps 20 MiB pages at any size, serves it: so does gpupool, in
    /// smaller pages. The request succeeds if a growth in any of them does.
    ///
    /// [`page_for`]: ExpandablePolicy::page_for
    pub(crate) fn pages_tried(&self, pool: PoolKind, rounded: usize) -> impl Iterator<Item = usize> + '_ {
        let ladder = pool == PoolKind::Large && rounded >= self.huge_from;
        let small =
            (ladder && self.small_pages_within > 0 && self.large_page < self.huge_page).then_some(self.large_page);
        std::iter::successors(Some(self.page_for(pool, rounded)), move |&page| {
            (ladder && page > self.huge_page).then_some(page / 2)
        })
        .chain(small)
    }

    /// Bytes of address space for a new range of `pool` in `page`-byte pages that must hold
    /// `need` bytes, when the shard's largest range of that pool and page is `largest` bytes
    /// (0: none).
    fn range_size_in(&self, pool: PoolKind, need: usize, largest: usize, page: usize) -> Option<usize> {
        let share = match pool {
            PoolKind::Small => self.device_total / 64,
            PoolKind::Large => self.device_total / 8,
        };
        let want = need.max(share).max(largest.saturating_mul(2)).max(page);
        want.checked_next_multiple_of(page)
    }

    /// [`ExpandablePolicy::range_size_in`] in the pages of [`ExpandablePolicy::page_for`].
    #[cfg(test)]
    fn range_size(&self, pool: PoolKind, need: usize, largest: usize) -> Option<usize> {
        self.range_size_in(pool, need, largest, self.page_for(pool, need))
    }
}

fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

impl ShardState {
    fn unmapped_set(&mut self, pool: PoolKind) -> &mut std::collections::BTreeSet<(DevicePtr, BlockId)> {
        &mut self.unmapped[pool as usize]
    }

    /// The expandable segment whose range contains `addr`.
    fn expandable_of(&self, addr: DevicePtr) -> (DevicePtr, &Expandable) {
        for &base in &self.expandables {
            let e = self.segments[&base].exp.as_deref().expect("listed segments are expandable");
            if addr >= base && addr - base < e.size as u64 {
                return (base, e);
            }
        }
        unreachable!("block {addr:#x} lies in no expandable segment of its shard")
    }
}
