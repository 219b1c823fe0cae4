//! The free list of one pool of one stream (PyTorch `BlockPool::blocks`).
//!
//! The order is PyTorch's: the first block at or above a request by (size, address) is the best
//! fit, the smallest block that fits and the lowest address among equals. PyTorch keeps one
//! `std::set` ordered by (stream, size, address) per device; gpupool keeps one pool per stream,
//! so the stream needs no comparison and streams share no lock.
//!
//! The set is split for speed: blocks sit in bins of one exact size, each sorted by address,
//! found through a hash map; a B-tree of the sizes is consulted only when no block of the
//! exact size is free. A bin that empties stays listed until a search passes it, so a request
//! that is served and freed again (the cache-hit path) touches only its bin.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use super::block::BlockId;
use crate::driver::DevicePtr;

/// Empty bins a search may pass before it unlists them.
const UNLIST_AFTER: usize = 8;

#[derive(Default, Debug)]
struct Bin {
    /// (address, block), ascending by address.
    blocks: Vec<(DevicePtr, BlockId)>,
    /// Whether the size is in `FreePool::sizes`.
    listed: bool,
}

#[derive(Default, Debug)]
pub(crate) struct FreePool {
    bins: FxHashMap<usize, Bin>,
    /// Every size with a non-empty bin, and perhaps some emptied since.
    sizes: BTreeSet<usize>,
    len: usize,
}

impl FreePool {
    pub fn insert(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let bin = self.bins.entry(size).or_default();
        let at = bin.blocks.partition_point(|&(a, _)| a < addr);
        debug_assert!(bin.blocks.get(at).is_none_or(|&(a, _)| a != addr), "block {id} inserted into its pool twice");
        bin.blocks.insert(at, (addr, id));
        if !bin.listed {
            bin.listed = true;
            self.sizes.insert(size);
        }
        self.len += 1;
    }

    pub fn remove(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let bin = self.bins.get_mut(&size).expect("pool has no bin for a block's size");
        let at = bin.blocks.partition_point(|&(a, _)| a < addr);
        debug_assert_eq!(bin.blocks.get(at), Some(&(addr, id)), "block {id} missing from its pool");
        bin.blocks.remove(at);
        self.len -= 1;
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
            return Some((size, addr, id));
        }
        let (found, addr, id) = self.scan_above(size)?;
        if !accept(found) {
            return None;
        }
        self.remove(found, addr, id);
        Some((found, addr, id))
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
        // Empty bins met on the way stay listed (a size that was free once tends to be again:
        // unlisting and relisting it would cost two tree writes per hit); only when a search
        // had to pass many are they dropped.
        let mut skipped = [0usize; UNLIST_AFTER];
        let mut n = 0;
        let mut found = None;
        for &s in self.sizes.range(size..) {
            match self.bins[&s].blocks.first() {
                Some(&(addr, id)) => {
                    found = Some((s, addr, id));
                    break;
                }
                None if n < UNLIST_AFTER => {
                    skipped[n] = s;
                    n += 1;
                }
                None => {}
            }
        }
        if n == UNLIST_AFTER {
            for s in skipped {
                self.sizes.remove(&s);
                self.bins.get_mut(&s).expect("listed size has a bin").listed = false;
            }
        }
        found
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
        assert_eq!(p.len(), 3);
        let order: Vec<_> = p.iter().map(|e| e.2).collect();
        assert_eq!(order, [3, 2, 4]);
        let order: Vec<_> = p.iter_largest_first().map(|e| e.2).collect();
        assert_eq!(order, [4, 3, 2]);
    }
}
