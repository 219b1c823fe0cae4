//! The free list of one pool of one stream (PyTorch `BlockPool::blocks`).
//!
//! Blocks are ordered by (size, address), so the first block at or above a request is PyTorch's
//! best fit: the smallest block that fits, the lowest address among equals. PyTorch orders by
//! (stream, size, address) in one set per device; gpupool keeps one set per stream instead, so
//! the stream needs no comparison and streams never share a lock.

use std::collections::BTreeSet;

use super::block::BlockId;
use crate::driver::DevicePtr;

#[derive(Default, Debug)]
pub struct FreePool {
    blocks: BTreeSet<(usize, DevicePtr, BlockId)>,
}

impl FreePool {
    pub fn insert(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let fresh = self.blocks.insert((size, addr, id));
        debug_assert!(fresh, "block {id} inserted into its pool twice");
    }

    pub fn remove(&mut self, size: usize, addr: DevicePtr, id: BlockId) {
        let present = self.blocks.remove(&(size, addr, id));
        debug_assert!(present, "block {id} missing from its pool");
    }

    /// The best-fitting block of at least `size` bytes, without removing it.
    #[inline]
    pub fn best_fit(&self, size: usize) -> Option<(usize, DevicePtr, BlockId)> {
        self.blocks.range((size, 0, 0)..).next().copied()
    }

    /// The blocks from largest to smallest (for PyTorch's `release_available_cached_blocks`).
    pub fn iter_largest_first(&self) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.blocks.iter().rev().copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = (usize, DevicePtr, BlockId)> + '_ {
        self.blocks.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }
}
