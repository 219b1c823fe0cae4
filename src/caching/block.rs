//! Blocks and the arena that owns them.
//!
//! A block is a contiguous range of one segment: allocated to a caller, waiting for the events
//! of the streams that used it, or free in its pool (PyTorch `Block`). The blocks of a segment
//! form a doubly linked list by address (`prev`/`next`); a segment's first block never changes
//! identity, because coalescing always merges a block into its lower neighbour.

use super::rules::PoolKind;
use crate::driver::{DevicePtr, StreamHandle};

/// Index of a block in its shard's [`Arena`].
pub(crate) type BlockId = u32;
/// "No block": the end of a segment's list.
pub(crate) const NIL: BlockId = u32::MAX;

/// Where a block is in its life (PyTorch tracks this with `allocated` and `event_count`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// In its pool's free list, available to a request on the owning stream.
    Free,
    /// Handed to a caller by malloc.
    Allocated,
    /// Freed, and held whole in its shard's front cache (`shard::front`): inactive like a free
    /// block, but in no pool and not merged with its neighbours until the cache is merged.
    /// Blocks of expandable segments only.
    Cached,
    /// Freed by the caller, but streams recorded with `record_stream` may still use it: it
    /// goes back to its pool when the last of its events has completed.
    AwaitingEvents,
    /// Freed with [`crate::Allocator::free_after_device_sync`]: goes back to its pool after
    /// gpupool's next synchronisation of the whole device (what `cudaFree` waits for).
    AwaitingSync,
    /// Address space of an expandable segment with no memory mapped behind it (PyTorch
    /// `Block::mapped == false`): whole pages, in the pool's set of unmapped ranges, never
    /// handed out until mapped.
    Unmapped,
}

/// One block (PyTorch `Block`). Sizes in bytes.
#[derive(Debug)]
pub(crate) struct Block {
    pub addr: DevicePtr,
    pub size: usize,
    /// The size the caller asked for, before rounding (PyTorch `requested_size`).
    pub requested: usize,
    pub prev: BlockId,
    pub next: BlockId,
    pub state: BlockState,
    pub pool: PoolKind,
    /// The block lies in an expandable segment (PyTorch `Block::expandable_segment_`): it is
    /// split down to 512 bytes in either pool, and not counted in `inactive_split`.
    pub expandable: bool,
    /// Events still outstanding for this block (PyTorch `event_count`).
    pub event_count: u32,
    /// Streams other than the owning one that used the block (PyTorch `stream_uses`). A boxed
    /// slice rather than a `Vec`, so that a block takes 64 bytes: `record_stream` is rare, and
    /// grows it by one each time ([`Block::add_stream_use`]).
    pub stream_uses: Box<[StreamHandle]>,
    /// The context of its allocation in the history's table (`crate::history`, module
    /// `stacks`): its tag and its stack (PyTorch `context_when_allocated`), 0 for neither. Set
    /// by each allocation while history is on or tags are in use; its stack only while history
    /// keeps stacks (`HistoryContext::State` or more), and every block's stack (not its tag) is
    /// forgotten when it stops keeping them, so that it is never stale.
    pub ctx: u32,
    /// For a free block: its shard's count of frees when it was freed (PyTorch
    /// `gc_count_base`; see `device::gc_threshold`).
    pub freed_at: u32,
}

impl Block {
    /// A block of `size` bytes at `addr` in `pool`, alone in its segment (no neighbours), in
    /// `state`, with no events, stream uses, context or free stamp.
    pub fn new(addr: DevicePtr, size: usize, state: BlockState, pool: PoolKind, expandable: bool) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            prev: NIL,
            next: NIL,
            state,
            pool,
            expandable,
            event_count: 0,
            stream_uses: Box::default(),
            ctx: 0,
            freed_at: 0,
        }
    }

    /// PyTorch `Block::is_split`: the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    /// Adds `stream` to the streams that used the block.
    pub fn add_stream_use(&mut self, stream: StreamHandle) {
        let mut uses = std::mem::take(&mut self.stream_uses).into_vec();
        uses.push(stream);
        self.stream_uses = uses.into_boxed_slice();
    }
}

/// Storage for a shard's blocks with stable ids and slot reuse.
#[derive(Default, Debug)]
pub(crate) struct Arena {
    slots: Vec<Block>,
    vacant: Vec<BlockId>,
}

impl Arena {
    pub fn insert(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = block;
            id
        } else {
            self.slots.push(block);
            (self.slots.len() - 1) as BlockId
        }
    }

    /// The block in slot `id`, if the arena has that slot (vacant or not).
    #[inline(always)]
    pub fn get(&self, id: BlockId) -> Option<&Block> {
        self.slots.get(id as usize)
    }

    /// Marks a slot reusable. The caller has unlinked the block from its segment and pool.
    /// The slot keeps no allocated state: the shard's hint of the block it handed out last
    /// (`ShardState::allocated`) may name a slot after its block merged away.
    pub fn remove(&mut self, id: BlockId) {
        let b = &mut self.slots[id as usize];
        b.stream_uses = Box::default();
        b.state = BlockState::Free;
        self.vacant.push(id);
    }

    /// Whether every vacant slot is marked free (for the consistency check: see
    /// [`Arena::remove`]).
    pub fn vacant_are_free(&self) -> bool {
        self.vacant.iter().all(|&id| self.slots[id as usize].state == BlockState::Free)
    }
}

impl std::ops::Index<BlockId> for Arena {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        &self.slots[id as usize]
    }
}

impl std::ops::IndexMut<BlockId> for Arena {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.slots[id as usize]
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_block_takes_64_bytes() {
        // Every cached and live block has one: the arena's memory, and the lines a hit touches.
        assert_eq!(std::mem::size_of::<super::Block>(), 64);
    }
}
