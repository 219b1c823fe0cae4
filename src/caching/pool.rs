//! The free list of one pool of one stream (PyTorch `BlockPool::blocks`).
//!
//! The order is PyTorch's: the first block at or above a request by (size, address) is the best
//! fit, the smallest block that fits and the lowest address among equals. PyTorch keeps one
//! `std::set` ordered by (stream, size, address) per device; gpupool keeps one pool per stream,
//! so the stream needs no comparison and streams share no lock.
//!
//! The set is split for speed: blocks sit in bins of one exact size, each sorted by address,
//! found through a hash map; a B-tree of the sizes is consulted only when no block of the
//! exact size is free. A bin that empties stays until a search passes it, so a request
//! that is served and freed again (the cache-hit path) touches only its bin. Empty bins are
//! dropped in a sweep once there are more of them than blocks in the pool (and at least
//! [`EMPTY_BINS_KEPT`]), and at `empty_cache`: the host memory a pool takes follows the blocks
//! it holds, not every size it has ever seen, at an amortised cost of O(1) per emptied bin.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use super::block::BlockId;
use crate::driver::DevicePtr;

/// Empty bins a search may pass before it drops them.
const DROP_AFTER: usize = 8;
/// Empty bins a pool keeps however few blocks it holds: a stream cycling through a few sizes
/// never sweeps.
const EMPTY_BINS_KEPT: usize = 64;

/// The free blocks of one size: (address, block), ascending by address.
#[derive(Default, Debug)]
struct Bin {
    blocks: Vec<(DevicePtr, BlockId)>,
}

#[derive(Debug)]
pub(crate) struct FreePool {
    bins: FxHashMap<usize, Bin>,
    /// The size of every bin (some of them empty).
    sizes: BTreeSet<usize>,
    len: usize,
    /// Bins with no block.
    empty_bins: usize,
    /// Non-empty bins per slot of [`filter_slot`]: a slot at zero says no block of any size
    /// that maps there is free, so [`FreePool::lowest_of`] (asked on every malloc the front
    /// cache serves) answers without probing the hash map (21 instructions a probe, callgrind,
    /// `tests/c/hit_loop.c`).
    filled: [u32; FILTER_SLOTS],
}

/// Slots of the filter of sizes present ([`FreePool::filled`]).
const FILTER_SLOTS: usize = 64;

/// The filter slot of a size: sizes are multiples of 512 (PyTorch's `kMinBlockSize`), so its
/// bits above those.
#[inline(always)]
fn filter_slot(size: usize) -> usize {
    (size >> 9) % FILTER_SLOTS
}

impl Default for FreePool {
    fn default() -> Self {
        FreePool {
            bins: FxHashMap::default(),
            sizes: BTreeSet::new(),
            len: 0,
            empty_bins: 0,
            filled: [0; FILTER_SLOTS],
        }
    }
}

impl FreePool {
    pub fn insert(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let sizes = &mut self.sizes;
        let mut new = false;
        let bin = self.bins.entry(size).or_insert_with(|| {
            sizes.insert(size);
            new = true;
            Bin::default()
        });
        if bin.blocks.is_empty() {
            self.filled[filter_slot(size)] += 1;
            if !new {
                self.empty_bins -= 1;
            }
        }
        let at = bin.blocks.partition_point(|&(a, _)| a < addr);
        debug_assert!(bin.blocks.get(at).is_none_or(|&(a, _)| a != addr), "block {id} inserted into its pool twice");
        bin.blocks.insert(at, (addr, id));
        self.len += 1;
    }

    /// Counts a bin of `size` that was just emptied, and sweeps when there are too many.
    #[inline]
    fn emptied(&mut self, size: usize) {
        self.filled[filter_slot(size)] -= 1;
        self.empty_bins += 1;
        if self.empty_bins > EMPTY_BINS_KEPT && self.empty_bins > self.len {
            self.sweep();
        }
    }

    /// Drops every empty bin.
    pub fn sweep(&mut self) {
        let sizes = &mut self.sizes;
        self.bins.retain(|size, bin| {
            if bin.blocks.is_empty() {
                sizes.remove(size);
                return false;
            }
            true
        });
        self.empty_bins = 0;
    }

    /// Bins held, empty or not (host memory, for tests).
    pub fn bin_count(&self) -> usize {
        self.bins.len()
    }

    pub fn remove(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let bin = self.bins.get_mut(&size).expect("pool has no bin for a block's size");
        let at = bin.blocks.partition_point(|&(a, _)| a < addr);
        debug_assert_eq!(bin.blocks.get(at), Some(&(addr, id)), "block {id} missing from its pool");
        bin.blocks.remove(at);
        self.len -= 1;
        if bin.blocks.is_empty() {
            self.emptied(size);
        }
    }

    /// Removes and returns the best-fitting block of at least `size` bytes, if `accept` takes
    /// it (the `max_split_size` rules); one search, where `best_fit` then `remove` would be two.
    #[inline]
    pub fn take_best_fit(
        &mut self,
        size: usize,
        accept: impl FnOnce(usize) -> bool,
    ) -> Option<(usize, DevicePtr, BlockId)> {
        if let Some(bin) = self.bins.get_mut(&size)
            && let Some(&(addr, id)) = bin.blocks.first()
        {
            if !accept(size) {
                return None;
            }
            bin.blocks.remove(0);
            self.len -= 1;
            if bin.blocks.is_empty() {
                self.emptied(size);
            }
            return Some((size, addr, id));
        }
        let (found, addr, id) = self.scan_above(size)?;
        if !accept(found) {
            return None;
        }
        self.remove(found, addr, id);
        Some((found, addr, id))
    }

    /// The address of the lowest block of exactly `size` bytes, if any.
    #[inline(always)]
    pub fn lowest_of(&self, size: usize) -> Option<DevicePtr> {
        if self.filled[filter_slot(size)] == 0 {
            return None;
        }
        self.bins.get(&size).and_then(|b| b.blocks.first()).map(|&(addr, _)| addr)
    }

    /// The best-fitting block of at least `size` bytes, without removing it.
    #[inline]
    pub fn best_fit(&mut self, size: usize) -> Option<(usize, DevicePtr, BlockId)> {
        if let Some(&(addr, id)) = self.bins.get(&size).and_then(|b| b.blocks.first()) {
            return Some((size, addr, id));
        }
        self.scan_above(size)
    }

    /// The best fit among sizes of at least `size`, by the B-tree of sizes (the exact size
    /// having been tried).
    fn scan_above(&mut self, size: usize) -> Option<(usize, DevicePtr, BlockId)> {
        // Empty bins met on the way stay (a size that was free once tends to be again: dropping
        // and re-creating its bin would cost two tree writes per hit); only when a search had
        // to pass many are they dropped.
        let mut skipped = [0usize; DROP_AFTER];
        let mut n = 0;
        let mut found = None;
        for &s in self.sizes.range(size..) {
            match self.bins[&s].blocks.first() {
                Some(&(addr, id)) => {
                    found = Some((s, addr, id));
                    break;
                }
                None if n < DROP_AFTER => {
                    skipped[n] = s;
                    n += 1;
                }
                None => {}
            }
        }
        if n == DROP_AFTER {
            for s in skipped {
                self.sizes.remove(&s);
                self.bins.remove(&s);
                self.empty_bins -= 1;
            }
        }
        found
    }

    /// The size of the largest block in the pool, if any (for the out-of-memory message; a
    /// walk down the sizes past empty bins).
    pub fn largest(&self) -> Option<usize> {
        self.sizes.iter().rev().copied().find(|s| !self.bins[s].blocks.is_empty())
    }

    /// The blocks from largest to smallest, lowest address first among equals (for PyTorch's
    /// `release_available_cached_blocks`).
    pub fn iter_largest_first(&self) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.sizes.iter().rev().flat_map(move |&s| self.bins[&s].blocks.iter().map(move |&(a, id)| (s, a, id)))
    }

    /// The blocks in (size, address) order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.sizes.iter().flat_map(move |&s| self.bins[&s].blocks.iter().map(move |&(a, id)| (s, a, id)))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether [`FreePool::filled`] counts exactly the bins that hold a block (the consistency
    /// check's).
    pub fn filter_consistent(&self) -> bool {
        let mut filled = [0u32; FILTER_SLOTS];
        for (&size, bin) in &self.bins {
            filled[filter_slot(size)] += u32::from(!bin.blocks.is_empty());
        }
        filled == self.filled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_is_smallest_size_then_lowest_address() {
        let mut p = FreePool::default();
        p.insert(4096, 0x9000, 1);
        p.insert(2048, 0x5000, 2);
        p.insert(2048, 0x3000, 3);
        p.insert(8192, 0x1000, 4);
        assert_eq!(p.best_fit(1024), Some((2048, 0x3000, 3)));
        assert_eq!(p.best_fit(2048), Some((2048, 0x3000, 3)));
        assert_eq!(p.best_fit(2049), Some((4096, 0x9000, 1)));
        p.remove(4096, 0x9000, 1);
        assert_eq!(p.best_fit(2049), Some((8192, 0x1000, 4)));
        assert_eq!(p.best_fit(8193), None);
        assert_eq!(p.largest(), Some(8192));
        p.remove(8192, 0x1000, 4);
        assert_eq!(p.largest(), Some(2048), "past the emptied bin");
        p.insert(8192, 0x1000, 4);
        assert_eq!(p.len(), 3);
        let order: Vec<_> = p.iter().map(|e| e.2).collect();
        assert_eq!(order, [3, 2, 4]);
        let order: Vec<_> = p.iter_largest_first().map(|e| e.2).collect();
        assert_eq!(order, [4, 3, 2]);
        assert!(p.filter_consistent());
        // Sizes 32 KiB apart share a filter slot: one emptied leaves the other found.
        p.insert(512, 0x7000, 5);
        p.insert(512 + 512 * FILTER_SLOTS, 0x8000, 6);
        p.remove(512, 0x7000, 5);
        assert_eq!((p.lowest_of(512), p.lowest_of(512 + 512 * FILTER_SLOTS)), (None, Some(0x8000)));
        assert!(p.filter_consistent());
    }

    #[test]
    fn empty_bins_do_not_accumulate() {
        let mut p = FreePool::default();
        // A long-running server sees ever new sizes: each served and freed once.
        for i in 0..1_000_000usize {
            let size = 512 * (1 + i % 200_000);
            p.insert(size, 0x1000, 1);
            assert_eq!(p.take_best_fit(size, |_| true), Some((size, 0x1000, 1)));
        }
        assert!(p.bin_count() <= EMPTY_BINS_KEPT + 1, "{} bins kept for an empty pool", p.bin_count());
        // A pool holding blocks keeps at most about as many empty bins as blocks.
        for i in 0..1000 {
            p.insert(512 * (1 + i), 0x1000 * i as u64, i as BlockId);
        }
        for i in 0..1000 {
            p.insert(1 << 30, 0x1000_0000 + 0x1000 * i as u64, 5000 + i as BlockId);
            p.remove(512 * (1 + i), 0x1000 * i as u64, i as BlockId);
        }
        assert!(p.bin_count() <= 1000 + 1, "{} bins for 1000 blocks of one size", p.bin_count());
        p.sweep();
        assert!(p.filter_consistent());
        assert_eq!(p.bin_count(), 1);
        assert_eq!(p.iter().count(), 1000);
    }
}
