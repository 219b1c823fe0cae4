//! The shard of the block a thread freed last through the segment index (`hit.rs`'s
//! `free_indexed`), which a malloc that missed the thread's cache of recent shards
//! ([`ShardCache`]) takes instead of looking its stream up in the device's table of shards.
//!
//! A thread that serves more streams than its cache holds (1,000 streams in rotation, each
//! freeing a block and allocating one again) finds none of them cached: each free searches the
//! segment index, which names the block's shard, and the malloc after it on the same stream
//! looked the shard up again in the table, a hash probe under the table's lock (`get_or_create`,
//! 71 instructions of a pair, callgrind, `examples/stream_rotation.rs`).
//!
//! The shard is the one the table holds for the stream unless it was retired since (`empty_cache`
//! took it out, `shard_table`): the malloc then looks in the table, as for a shard of its cache
//! retired. Only shards of the default pools are kept (the malloc wants its stream's default
//! shard: a route to a private pool is looked for first). One strong count, given back when the
//! next indexed free replaces it, and at the thread's exit with the cache's
//! ([`ShardCache::give_back`]); none is kept on a thread whose counts were given back.

use std::cell::Cell;
use std::sync::Arc;

use super::{OWNED, OWNER, ShardCache};
use crate::caching::shard::Shard;
use crate::driver::StreamHandle;

/// The shard kept, and the allocator and device it is of. No destructor, as the cache's (see
/// [`ShardCache`]).
struct FreedShard {
    /// The id of the allocator the shard is of; 0: none kept.
    allocator: Cell<u64>,
    device: Cell<i32>,
    /// One strong count (`Arc::into_raw`), owned; null while `allocator` is 0.
    shard: Cell<*const Shard>,
}

thread_local! {
    static FREED: FreedShard = const {
        FreedShard { allocator: Cell::new(0), device: Cell::new(0), shard: Cell::new(std::ptr::null()) }
    };
}

impl FreedShard {
    /// Empties it, returning the count it kept.
    fn take(&self) -> Option<Arc<Shard>> {
        let p = self.shard.replace(std::ptr::null());
        self.allocator.set(0);
        // SAFETY: a non-null pointer is a strong count this thread owns (`remember`), now
        // taken out.
        (!p.is_null()).then(|| unsafe { Arc::from_raw(p) })
    }
}

/// After an indexed free of a block of `shard` on `allocator`'s `device`: keeps `shard` for the
/// malloc after it (see the module's doc), giving back the one kept before.
#[inline]
pub(super) fn remember(allocator: u64, device: i32, shard: &Arc<Shard>) {
    if shard.pool != 0 {
        return;
    }
    FREED.with(|f| {
        if f.shard.get() == Arc::as_ptr(shard) {
            return;
        }
        if OWNER.get() != OWNED && !ShardCache::get().owned() {
            return;
        }
        let old = f.shard.replace(Arc::into_raw(shard.clone()));
        f.allocator.set(allocator);
        f.device.set(device);
        // Given back once this thread's entry is whole again: dropping a shard may run code
        // (its state's destructors), none of which comes back here.
        if !old.is_null() {
            // SAFETY: the count kept before (see `FreedShard::shard`), now taken out.
            drop(unsafe { Arc::from_raw(old) });
        }
    })
}

/// The shard kept, taken out, if it is `allocator`'s shard of `stream` on `device` and not
/// retired; else `None`, leaving it kept.
#[inline]
pub(super) fn take(allocator: u64, device: i32, stream: StreamHandle) -> Option<Arc<Shard>> {
    FREED.with(|f| {
        if f.allocator.get() != allocator || f.device.get() != device {
            return None;
        }
        // SAFETY: non-null while `allocator` is set (`remember`): a strong count this thread
        // owns, alive while kept.
        let shard = unsafe { &*f.shard.get() };
        if shard.stream != stream || shard.is_retired() {
            return None;
        }
        f.take()
    })
}

/// At the thread's exit (from [`ShardCache::give_back`], which marks the thread's counts given
/// back first, so that none is kept again): the count kept given back.
pub(super) fn give_back() {
    drop(FREED.with(FreedShard::take));
}
