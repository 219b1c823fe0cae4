//! The free list of one pool of one stream (PyTorch `BlockPool::blocks`).
//!
//! The order is PyTorch's: the first block at or above a request by (size, address) is the best
//! fit, the smallest block that fits and the lowest address among equals. PyTorch keeps one
//! `std::set` ordered by (stream, size, address) per device; gpupool keeps one pool per stream,
//! so the stream needs no comparison and streams share no lock.
//!
//! The set is split for speed: blocks sit in bins of one exact size, each sorted by address,
//! found through a hash map; the sizes of the bins that hold a block are a [`SizeSet`], whose
//! first size at or above a request is the best fit's. A bin that empties stays in the map (its
//! vector keeps its capacity), so a size that is freed and served again makes no heap
//! allocation; empty bins are dropped in a sweep once there are more of them than blocks in the
//! pool (and at least [`EMPTY_BINS_KEPT`]), and at `empty_cache`: the host memory a pool takes
//! follows the blocks it holds, not every size it has ever seen.

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::block::BlockId;
use super::size_set::SizeSet;
use crate::driver::DevicePtr;

/// Empty bins a pool keeps however few blocks it holds: a stream cycling through a few sizes
/// never sweeps.
const EMPTY_BINS_KEPT: usize = 64;

/// The free blocks of one size: (address, block), ascending by address. One block inline,
/// as most bins hold one: a bin made again after a sweep dropped it allocates nothing.
#[derive(Default, Debug)]
struct Bin {
    blocks: SmallVec<[(DevicePtr, BlockId); 1]>,
}

#[derive(Debug)]
pub(crate) struct FreePool {
    bins: FxHashMap<usize, Bin>,
    /// The sizes of the bins that hold a block.
    sizes: SizeSet,
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
            sizes: SizeSet::default(),
            len: 0,
            empty_bins: 0,
            filled: [0; FILTER_SLOTS],
        }
    }
}

impl FreePool {
    pub fn insert(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let mut new = false;
        let bin = self.bins.entry(size).or_insert_with(|| {
            new = true;
            Bin::default()
        });
        if bin.blocks.is_empty() {
            self.filled[filter_slot(size)] += 1;
            self.sizes.insert(size);
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
        self.sizes.remove(size);
        self.empty_bins += 1;
        if self.empty_bins > EMPTY_BINS_KEPT && self.empty_bins > self.len {
            self.sweep();
        }
    }

    /// Drops every empty bin.
    pub fn sweep(&mut self) {
        self.bins.retain(|_, bin| !bin.blocks.is_empty());
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
        let found = self.sizes.first_at_or_above(size)?;
        if !accept(found) {
            return None;
        }
        let bin = self.bins.get_mut(&found).expect("a size listed has its bin");
        let (addr, id) = bin.blocks.remove(0);
        self.len -= 1;
        if bin.blocks.is_empty() {
            self.emptied(found);
        }
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
    pub fn best_fit(&self, size: usize) -> Option<(usize, DevicePtr, BlockId)> {
        let found = self.sizes.first_at_or_above(size)?;
        let &(addr, id) = self.bins[&found].blocks.first().expect("a size listed has a block");
        Some((found, addr, id))
    }

    /// The size of the largest block in the pool, if any (for the out-of-memory message; a
    /// walk down the sizes past empty bins).
    pub fn largest(&self) -> Option<usize> {
        self.sizes.last()
    }

    /// The blocks from largest to smallest, lowest address first among equals (for PyTorch's
    /// `release_available_cached_blocks`).
    pub fn iter_largest_first(&self) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.sizes.ascending().into_iter().rev().flat_map(move |s| self.bin_blocks(s))
    }

    /// The blocks in (size, address) order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.sizes.ascending().into_iter().flat_map(move |s| self.bin_blocks(s))
    }

    /// The blocks of the bin of `size`, lowest address first.
    fn bin_blocks(&self, size: usize) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.bins[&size].blocks.iter().map(move |&(a, id)| (size, a, id))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether [`FreePool::filled`] counts exactly the bins that hold a block, and the set of
    /// sizes lists exactly those (the consistency check's).
    pub fn filter_consistent(&self) -> bool {
        let mut filled = [0u32; FILTER_SLOTS];
        let mut sizes: Vec<usize> = Vec::new();
        for (&size, bin) in &self.bins {
            filled[filter_slot(size)] += u32::from(!bin.blocks.is_empty());
            if !bin.blocks.is_empty() {
                sizes.push(size);
            }
        }
        sizes.sort_unstable();
        let empty = self.bins.values().filter(|b| b.blocks.is_empty()).count();
        filled == self.filled
            && sizes == self.sizes.ascending()
            && self.sizes.summary_consistent()
            && empty == self.empty_bins
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
