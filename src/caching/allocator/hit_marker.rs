//! The thread cache's marker (`hit.rs`'s [`ShardCache`]): after a malloc that missed the
//! cache, an entry with no shard first among its allocator's entries stops that allocator's
//! frees from guessing another stream's shard, until a free the guess would have served.

use std::sync::Arc;

use super::{CachedShard, EMPTY, SHARD_CACHE_SLOTS, ShardCache};
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::Shard;

/// The device of a *marker*, an entry with no shard that stops an allocator's frees from
/// guessing ([`Allocator::free_recent`]) while first of its entries: put in front by a store (a
/// malloc that missed), taken out by the first indexed free the guess would have served
/// ([`ShardCache::guess_again_if_right`]). At 1,000 streams in rotation every guess was wrong,
/// 60 instructions a pair (cachegrind, `examples/stream_rotation.rs`); a flag's test cost the
/// hit pair 2 (callgrind, `tests/c/hit_loop.c`). No call names this device.
pub(super) const MARKER: i32 = i32::MIN;

impl ShardCache {
    /// Puts `allocator`'s [`MARKER`] first in the cache unless it is there already. One
    /// marker an allocator, wherever other allocators' are: an older one is put out (it holds
    /// no count), and the entry made room of is an empty one, else the last (its count given
    /// back). First of the cache, not only of the allocator's entries: `store` then writes
    /// behind it (from the second entry on), where a marker that other allocators' misses had
    /// pushed deeper could be passed, the entry written in front of it. Called by `store`,
    /// which checks the lend.
    pub(super) fn put_marker(&self, allocator: u64, dev: &DeviceAllocator) {
        // SAFETY: as in `clear`; each reference ends before the next is taken.
        let slots = unsafe { &*self.slots.get() };
        if slots[0].allocator == allocator && slots[0].device == MARKER {
            return;
        }
        let j = {
            // SAFETY: as above.
            let slots = unsafe { &mut *self.slots.get() };
            slots.iter_mut().filter(|c| c.allocator == allocator && c.device == MARKER).for_each(|c| c.allocator = 0);
            slots.iter().rposition(|c| c.allocator == 0).unwrap_or(SHARD_CACHE_SLOTS - 1)
        };
        self.clear(j);
        let marker = CachedShard { allocator, device: MARKER, stream: 0, dev, shard: None };
        // SAFETY: as above; entry `j` holds no count any more, so none is lost.
        let slots = unsafe { &mut *self.slots.get() };
        slots[..=j].rotate_right(1);
        slots[0] = marker;
    }

    /// After an indexed free of a block of `owner` on `allocator`: takes the allocator's
    /// [`MARKER`] out if the guess it stops would have named `owner`, so that a thread back on
    /// one stream guesses again after one free. Not while lent.
    pub(super) fn guess_again_if_right(&self, allocator: u64, owner: &Arc<Shard>) {
        if self.lent.get() != 0 {
            return;
        }
        // SAFETY: not lent (as in `clear`); entries are moved, no count taken or given.
        let slots = unsafe { &mut *self.slots.get() };
        let Some(p) = slots.iter().position(|c| c.allocator == allocator) else { return };
        if slots[p].device != MARKER {
            return;
        }
        let guess = slots[p + 1..].iter().find(|c| c.allocator == allocator).and_then(|c| c.shard.as_deref());
        if guess.is_some_and(|s| Arc::ptr_eq(s, owner)) {
            slots[p..].rotate_left(1);
            slots[SHARD_CACHE_SLOTS - 1] = EMPTY;
        }
    }
}

#[cfg(test)]
#[path = "hit_marker_tests.rs"]
mod tests;
