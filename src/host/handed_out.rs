//! The blocks a stripe handed out, by address: the few handed out last in a small stack that
//! a free finds with a compare or two, the rest in a hash map.
//!
//! PyTorch's `CachingHostAllocatorImpl` keeps every allocated block in one hash set
//! (`blocks_`). A program that pins, copies and frees a buffer in a loop frees the block it
//! took last: looked up in a hash map, that pair cost about 100 of its 457 instructions
//! (callgrind, `tests/c/hit_loop.c host`, 2026-11-27), an insert and a remove. The stack holds
//! [`RECENT`] blocks; a block handed out while it is full moves the oldest of them (about: see
//! `take_at`) to the map, where it stays until it is freed. Every block is in exactly one of
//! the two.

use std::mem::MaybeUninit;
use std::sync::Arc;

use crate::driver::{HostPtr, StreamHandle};

/// Blocks the stack holds: a free scans at most this many addresses before the map.
pub(super) const RECENT: usize = 8;

/// A block (`B`: the stripes' `Block`) handed out, with the streams (and their devices) named
/// by `record_event` since.
pub(super) struct HandedOut<B> {
    pub(super) block: Arc<B>,
    pub(super) streams: Vec<(StreamHandle, i32)>,
}

/// The blocks one stripe handed out that are not freed yet, by address. A block named by
/// `record_event` lives in the map, with its streams: the stack holds only blocks with none,
/// so that the hit path moves one pointer, not a block and its list of streams.
pub(super) struct HandedOutSet<B> {
    /// Addresses of `recent`'s blocks, `len` of them, about oldest first (see `take_at`).
    ptrs: [HostPtr; RECENT],
    /// The blocks, each holding its strong count; slots from `len` on are uninitialised (a
    /// slot kept as an `Option` was cleared at each take and tested at each free, 4
    /// instructions a pair, callgrind).
    recent: [MaybeUninit<Arc<B>>; RECENT],
    len: usize,
    older: rustc_hash::FxHashMap<HostPtr, HandedOut<B>>,
}

impl<B> Default for HandedOutSet<B> {
    fn default() -> Self {
        HandedOutSet {
            ptrs: [0; RECENT],
            recent: [const { MaybeUninit::uninit() }; RECENT],
            len: 0,
            older: Default::default(),
        }
    }
}

impl<B> Drop for HandedOutSet<B> {
    fn drop(&mut self) {
        for slot in &mut self.recent[..self.len] {
            // SAFETY: the first `len` slots hold blocks, each dropped once here.
            unsafe { slot.assume_init_drop() };
        }
    }
}

impl<B> HandedOutSet<B> {
    /// Adds `block` at `ptr`, just handed out (no stream named yet), which must not be in the
    /// set.
    #[inline(always)]
    pub(super) fn insert(&mut self, ptr: HostPtr, block: Arc<B>) {
        if !self.has_room() {
            self.spill(0);
        }
        // SAFETY: room made above.
        unsafe { self.push(ptr, block) };
    }

    /// Whether the stack has a free slot, for [`HandedOutSet::push`].
    #[inline(always)]
    pub(super) fn has_room(&self) -> bool {
        self.len < RECENT
    }

    /// [`HandedOutSet::insert`] with no spill: the hit path's, with no call (a spill, or a
    /// bound's panic) that would give it a stack frame.
    ///
    /// # Safety
    /// The stack has room ([`HandedOutSet::has_room`]).
    #[inline(always)]
    pub(super) unsafe fn push(&mut self, ptr: HostPtr, block: Arc<B>) {
        debug_assert!(self.has_room());
        // `len` read once: a store to `ptrs` may alias it (see the front cache's `push`).
        let i = self.len;
        // SAFETY: `i < RECENT`, the caller's promise. The slots from `len` on hold nothing.
        unsafe {
            *self.ptrs.get_unchecked_mut(i) = ptr;
            self.recent.get_unchecked_mut(i).write(block);
        }
        self.len = i + 1;
    }

    /// Moves the stack's block `i` to the map, and returns its entry there.
    #[cold]
    #[inline(never)]
    fn spill(&mut self, i: usize) -> &mut HandedOut<B> {
        let ptr = self.ptrs[i];
        let block = self.take_at(i);
        self.older.entry(ptr).or_insert(HandedOut { block, streams: Vec::new() })
    }

    /// Takes the stack's block `i` (below `len`) out; the last block takes its slot. Slot 0 is
    /// then no longer always the oldest, which only makes a spill's choice less apt: shifting
    /// the rest down called `memmove`.
    #[inline(always)]
    fn take_at(&mut self, i: usize) -> Arc<B> {
        debug_assert!(i < self.len && self.len <= RECENT);
        let last = self.len - 1;
        // SAFETY: `i` and `last` are below `len`, which is at most `RECENT` (`push` and
        // `spill` keep it so), so both slots hold a block: `i`'s is moved out, `last`'s moved
        // to `i` (the same when `i == last`), and slot `last` is then past `len`. Unchecked,
        // as in `push`: the bounds' panics are calls.
        let block = unsafe {
            let block = self.recent.get_unchecked(i).assume_init_read();
            *self.ptrs.get_unchecked_mut(i) = *self.ptrs.get_unchecked(last);
            let moved = self.recent.get_unchecked(last).assume_init_read();
            self.recent.get_unchecked_mut(i).write(moved);
            block
        };
        self.len = last;
        block
    }

    /// Where `ptr` is in the stack, newest first.
    #[inline(always)]
    fn position(&self, ptr: HostPtr) -> Option<usize> {
        debug_assert!(self.len <= RECENT);
        // SAFETY: `i < len <= RECENT` (see `take_at`).
        (0..self.len).rev().find(|&i| unsafe { *self.ptrs.get_unchecked(i) } == ptr)
    }

    /// Takes out the block at `ptr` if it is in the stack: handed out lately, and no stream
    /// named for it. The hit path's free.
    #[inline(always)]
    pub(super) fn take_recent(&mut self, ptr: HostPtr) -> Option<Arc<B>> {
        let i = self.position(ptr)?;
        Some(self.take_at(i))
    }

    /// Takes out the block at `ptr`, with the streams named for it, if the set holds it.
    pub(super) fn remove(&mut self, ptr: HostPtr) -> Option<HandedOut<B>> {
        match self.take_recent(ptr) {
            Some(block) => Some(HandedOut { block, streams: Vec::new() }),
            None => self.older.remove(&ptr),
        }
    }

    /// The block at `ptr` with its streams, if the set holds it (moved to the map first: a
    /// caller that names a stream makes it the map's).
    pub(super) fn get_mut(&mut self, ptr: HostPtr) -> Option<&mut HandedOut<B>> {
        match self.position(ptr) {
            Some(i) => Some(self.spill(i)),
            None => self.older.get_mut(&ptr),
        }
    }

    /// The block at `ptr`, if the set holds it.
    pub(super) fn get(&self, ptr: HostPtr) -> Option<&Arc<B>> {
        match self.position(ptr) {
            // SAFETY: `i < len`: the slot holds a block.
            Some(i) => Some(unsafe { self.recent[i].assume_init_ref() }),
            None => self.older.get(&ptr).map(|h| &h.block),
        }
    }

    /// Every block, with its address, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (HostPtr, &Arc<B>)> + '_ {
        let recent = self.ptrs[..self.len].iter().zip(&self.recent[..self.len]);
        recent
            // SAFETY: the first `len` slots hold blocks.
            .map(|(&p, b)| (p, unsafe { b.assume_init_ref() }))
            .chain(self.older.iter().map(|(&p, h)| (p, &h.block)))
    }

    /// Number of blocks.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len + self.older.len()
    }

    /// Whether the map holds the block at `ptr` (a test's look at where a block went).
    #[cfg(test)]
    fn in_older(&self, ptr: HostPtr) -> bool {
        self.older.contains_key(&ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block: its address.
    fn block(ptr: HostPtr) -> Arc<HostPtr> {
        Arc::new(ptr)
    }

    #[test]
    fn every_block_is_found_once_in_any_order() {
        let mut s = HandedOutSet::<HostPtr>::default();
        let n = 3 * RECENT as HostPtr;
        for p in 1..=n {
            s.insert(p * 4096, block(p * 4096));
        }
        assert_eq!(s.len(), n);
        assert!(s.in_older(4096), "the oldest went to the map");
        assert!(!s.in_older(n * 4096), "the newest is in the stack");
        // Out of order: the middle of the stack, the map, then the rest.
        for p in [n - 3, 2, n, 1, n - 1] {
            let h = s.remove(p * 4096).expect("handed out");
            assert_eq!(*h.block, p * 4096);
            assert!(s.remove(p * 4096).is_none(), "removed once");
            assert!(s.get(p * 4096).is_none());
        }
        assert!(s.get(3 * 4096).is_some_and(|b| **b == 3 * 4096));
        // A stream named moves the block to the map, where the hit path's take does not look.
        let newest = (n - 2) * 4096;
        s.get_mut(newest).expect("handed out").streams.push((0x10, 0));
        assert!(s.in_older(newest) && s.take_recent(newest).is_none());
        assert_eq!(s.remove(newest).map(|h| h.streams), Some(vec![(0x10, 0)]));
        s.insert(newest, block(newest));
        let mut left: Vec<HostPtr> = s.iter().map(|(p, b)| (assert_eq!(p, **b), p).1).collect();
        left.sort_unstable();
        let want: Vec<HostPtr> = (1..=n).filter(|p| ![n - 3, 2, n, 1, n - 1].contains(p)).map(|p| p * 4096).collect();
        assert_eq!(left, want);
        for p in want {
            assert!(s.remove(p).is_some());
        }
        assert_eq!(s.len(), 0);
        assert!(s.remove(4096).is_none());
    }

    #[test]
    fn a_loop_of_one_block_stays_in_the_stack() {
        let mut s = HandedOutSet::<HostPtr>::default();
        for _ in 0..100 {
            s.insert(0x1000, block(0x1000));
            assert!(s.take_recent(0x1000).is_some());
        }
        assert_eq!((s.len, s.older.capacity()), (0, 0), "the map was never used");
    }
}
