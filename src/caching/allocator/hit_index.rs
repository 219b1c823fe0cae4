//! The segment index's snapshot as the calling thread last read it, for the free that searches
//! the index (`hit.rs`'s `free_indexed`): while the index publishes no newer one
//! ([`SegmentIndex::version`], one atomic load), the free searches the snapshot it keeps, with no
//! `arc-swap` read (a debt slot taken and paid back: about 55 instructions a free at 1,000
//! streams in rotation, where every free searches the index; callgrind,
//! `examples/stream_rotation.rs`).
//!
//! One strong count of the snapshot, of one allocator's index, kept until the thread's next
//! indexed free finds a newer one (or another allocator's), and given back at the thread's exit
//! with the cache's counts ([`ShardCache::give_back`]); none is kept on a thread whose exit would
//! not give it back. A snapshot kept holds its segments' shards: a shard retired meanwhile is
//! dropped at the next indexed free that takes a newer snapshot. Lent to the call that searches
//! it for the whole call, which may come back here (an out-of-memory observer that frees):
//! while lent, the call back searches it too when it is current, and the index itself when it
//! is not, and nothing is replaced.

use std::cell::Cell;
use std::sync::Arc;

use super::{OWNED, OWNER, ShardCache};
use crate::caching::segment_index::{SegmentEntry, SegmentIndex, Snapshot};
use crate::caching::shard::Shard;
use crate::driver::DevicePtr;

/// The snapshot kept, and the index and version it is of. No destructor, as the cache's (see
/// [`ShardCache`]).
struct KeptSnapshot {
    /// [`SegmentIndex::version`] when the snapshot was taken; the id 0: none kept.
    index: Cell<u64>,
    generation: Cell<u64>,
    /// One strong count (`Arc::into_raw`), owned; null while `index` is 0.
    snapshot: Cell<*const Snapshot<Arc<Shard>>>,
    /// Calls searching the snapshot now.
    lent: Cell<usize>,
}

thread_local! {
    static KEPT: KeptSnapshot = const {
        KeptSnapshot {
            index: Cell::new(0),
            generation: Cell::new(0),
            snapshot: Cell::new(std::ptr::null()),
            lent: Cell::new(0),
        }
    };
}

/// The snapshot lent for one call: the lend ends when this drops, unwinding included.
struct Lent<'a>(&'a KeptSnapshot);

impl Drop for Lent<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.lent.set(self.0.lent.get() - 1);
    }
}

/// [`SegmentIndex::with_segment`] through the snapshot the thread keeps, taken again when the
/// index published a newer one (see the module's doc).
#[inline(always)]
pub(super) fn with_segment<R>(
    index: &SegmentIndex<Arc<Shard>>,
    ptr: DevicePtr,
    f: impl FnOnce(Option<&SegmentEntry<Arc<Shard>>>) -> R,
) -> R {
    KEPT.with(|k| {
        let (id, generation) = index.version();
        if (k.index.get() != id || k.generation.get() != generation) && !k.take_again(index, id, generation) {
            return index.with_segment(ptr, f);
        }
        k.lent.set(k.lent.get() + 1);
        let _lent = Lent(k);
        // SAFETY: `index` is set: a strong count kept, which is not given back while lent.
        let snapshot = unsafe { &*k.snapshot.get() };
        f(snapshot.find(ptr))
    })
}

impl KeptSnapshot {
    /// Keeps the index's current snapshot, of version `generation` (read before it), in place
    /// of the one kept; false, having kept nothing, while lent or when the thread's exit would
    /// not give it back.
    #[cold]
    #[inline(never)]
    fn take_again(&self, index: &SegmentIndex<Arc<Shard>>, id: u64, generation: u64) -> bool {
        if self.lent.get() != 0 || (OWNER.get() != OWNED && !ShardCache::get().owned()) {
            return false;
        }
        let old = self.snapshot.replace(Arc::into_raw(index.current()));
        self.index.set(id);
        self.generation.set(generation);
        if !old.is_null() {
            // SAFETY: the count kept before, now taken out.
            drop(unsafe { Arc::from_raw(old) });
        }
        true
    }
}

/// At the thread's exit (from [`ShardCache::give_back`], which marks the thread's counts given
/// back first, so that none is kept again): the count kept given back, unless lent (a thread
/// ended inside a call, whose count then stays, as the cache's entries do).
pub(super) fn give_back() {
    KEPT.with(|k| {
        if k.lent.get() != 0 {
            return;
        }
        let p = k.snapshot.replace(std::ptr::null());
        k.index.set(0);
        if !p.is_null() {
            // SAFETY: the count kept, now taken out.
            drop(unsafe { Arc::from_raw(p) });
        }
    })
}
