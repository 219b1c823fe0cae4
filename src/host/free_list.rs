//! One size class's free blocks in one stripe: a LIFO list linked through the blocks.
//!
//! PyTorch keeps a `std::deque` per size class (`free_list_`) and pops its back. Kept in a
//! `Vec` per class, the free list cost the pinned hit pair about 20 instructions (its length
//! and capacity tests, the load of its buffer, a class bound check) and each stripe 24 bytes a
//! class (34 KB for 1,397 classes). Linked through a word in each block, a pop is two loads and
//! a store, a push a load and two stores, and a class 8 bytes. The order is PyTorch's: the
//! block freed last is reused first.
//!
//! A block is in at most one free list at a time, and its link is read and written only under
//! the lock of the stripe that lists it (relaxed atomics: plain moves, no data race while other
//! threads read the block's other fields through their own `Arc`s).

use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};

/// What a free list links through: a word of each listed value that holds the next one
/// (`blocks::Block::next`). Read and written only by the list, under its stripe's lock. The list
/// names no block type, so that `blocks`, which keeps the lists, and this file do not import
/// each other (`tests/house.rs`).
pub(super) trait Linked: Sized {
    /// The value's link word.
    fn link(&self) -> &AtomicPtr<Self>;
}

/// The free blocks of one class, most recently freed first. Each listed block holds one
/// strong count of its `Arc`, taken by [`FreeList::push`] and given back by
/// [`FreeList::pop`] (or at the list's drop).
pub(super) struct FreeList<B: Linked> {
    head: *const B,
}

// SAFETY: the list owns `Arc<B>`s (raw), which are `Send` when `B` is `Send` and `Sync`; links
// are only touched through `&mut FreeList`, under its stripe's lock.
unsafe impl<B: Linked + Send + Sync> Send for FreeList<B> {}

impl<B: Linked> Default for FreeList<B> {
    fn default() -> Self {
        FreeList { head: std::ptr::null() }
    }
}

impl<B: Linked> FreeList<B> {
    /// Adds `block` in front (it is reused first).
    #[inline(always)]
    pub(super) fn push(&mut self, block: Arc<B>) {
        let raw = Arc::into_raw(block);
        // SAFETY: `raw` is a live block: this list now holds its strong count.
        unsafe { (*raw).link().store(self.head.cast_mut(), Ordering::Relaxed) };
        self.head = raw;
    }

    /// Takes the block freed last out, if any.
    #[inline(always)]
    pub(super) fn pop(&mut self) -> Option<Arc<B>> {
        let raw = self.head;
        if raw.is_null() {
            return None;
        }
        // SAFETY: a listed block is alive (the list holds a strong count) and was pushed with
        // `Arc::into_raw`, whose count is handed back to the caller here.
        unsafe {
            self.head = (*raw).link().load(Ordering::Relaxed);
            Some(Arc::from_raw(raw))
        }
    }

    /// The blocks, freed last first.
    pub(super) fn iter(&self) -> impl Iterator<Item = &B> + '_ {
        // SAFETY: listed blocks live while the list is borrowed: only `&mut self` unlists.
        std::iter::successors(unsafe { self.head.as_ref() }, |b| unsafe {
            b.link().load(Ordering::Relaxed).cast_const().as_ref()
        })
    }

    /// Keeps the blocks for which `keep` says true, in their order, and returns the others.
    pub(super) fn take_unless(&mut self, mut keep: impl FnMut(&B) -> bool) -> Vec<Arc<B>> {
        let mut kept = Vec::new();
        let mut taken = Vec::new();
        while let Some(b) = self.pop() {
            if keep(&b) { kept.push(b) } else { taken.push(b) }
        }
        for b in kept.into_iter().rev() {
            self.push(b);
        }
        taken
    }
}

impl<B: Linked> Drop for FreeList<B> {
    fn drop(&mut self) {
        while self.pop().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed value: its address, and its link.
    struct Block {
        ptr: usize,
        next: AtomicPtr<Block>,
    }

    impl Linked for Block {
        fn link(&self) -> &AtomicPtr<Block> {
            &self.next
        }
    }

    fn block(ptr: usize) -> Arc<Block> {
        Arc::new(Block { ptr, next: AtomicPtr::new(std::ptr::null_mut()) })
    }

    #[test]
    fn last_in_first_out_and_counts_kept() {
        let mut l = FreeList::default();
        assert!(l.pop().is_none() && l.iter().next().is_none());
        let blocks: Vec<_> = (1..=4).map(|i| block(i << 12)).collect();
        for b in &blocks {
            l.push(b.clone());
        }
        assert!(blocks.iter().all(|b| Arc::strong_count(b) == 2), "the list holds one count each");
        assert_eq!(l.iter().map(|b| b.ptr).collect::<Vec<_>>(), [0x4000, 0x3000, 0x2000, 0x1000]);
        let taken = l.take_unless(|b| b.ptr != 0x3000);
        assert_eq!(taken.iter().map(|b| b.ptr).collect::<Vec<_>>(), [0x3000]);
        assert_eq!(l.iter().map(|b| b.ptr).collect::<Vec<_>>(), [0x4000, 0x2000, 0x1000], "order kept");
        assert_eq!(l.pop().map(|b| b.ptr), Some(0x4000));
        drop(taken);
        drop(l);
        assert!(blocks.iter().all(|b| Arc::strong_count(b) == 1), "the drop gave every count back");
    }
}
