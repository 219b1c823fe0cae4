//! The segment index's snapshot as the calling thread last read it, for the free that searches
//! the index (`hit.rs`'s `free_indexed`): while the index publishes no newer one
//! ([`SegmentIndex::version`], one atomic load), the free searches that snapshot, lent by a
//! weak reference made strong for the search, with no `arc-swap` read (a debt slot taken and
//! paid back: about 55 instructions a free at 1,000 streams in rotation, where every free
//! searches the index; callgrind, `examples/stream_rotation.rs`).
//!
//! A weak reference, so that what a snapshot holds (its chunks, and its segments' shards,
//! retired ones included) is dropped once the index replaced it, whatever the threads that read
//! it do next: a strong count kept 57 MB of shards after 10,000 streams were freed and the
//! cache emptied (`tests/core/streams.rs`). It keeps the snapshot's allocation alone (its
//! counts and two vectors' headers), until the thread's next indexed free of a newer one, or
//! the thread's exit, with the cache's counts ([`ShardCache::give_back`]); none is kept on a
//! thread whose exit would not give it back.

use std::cell::Cell;
use std::sync::{Arc, Weak};

use super::{OWNED, OWNER, ShardCache};
use crate::caching::segment_index::{SegmentEntry, SegmentIndex, Snapshot};
use crate::caching::shard::Shard;
use crate::driver::DevicePtr;

/// The snapshot kept, and the index and version it is of. No destructor, as the cache's (see
/// [`ShardCache`]).
struct KeptSnapshot {
    /// [`SegmentIndex::version`] when the snapshot was read; the id 0: none kept.
    index: Cell<u64>,
    generation: Cell<u64>,
    /// One weak count (`Weak::into_raw`), owned; null while `index` is 0.
    snapshot: Cell<*const Snapshot<Arc<Shard>>>,
}

thread_local! {
    static KEPT: KeptSnapshot = const {
        KeptSnapshot { index: Cell::new(0), generation: Cell::new(0), snapshot: Cell::new(std::ptr::null()) }
    };
}

/// [`SegmentIndex::with_segment`] through the snapshot the thread keeps, read again when the
/// index published a newer one (see the module's doc).
#[inline(always)]
pub(super) fn with_segment<R>(
    index: &SegmentIndex<Arc<Shard>>,
    ptr: DevicePtr,
    f: impl FnOnce(Option<&SegmentEntry<Arc<Shard>>>) -> R,
) -> R {
    let (id, generation) = index.version();
    let kept = KEPT.with(|k| {
        if k.index.get() != id || k.generation.get() != generation {
            return k.read_again(index, id, generation);
        }
        // SAFETY: `index` is set: a weak count kept. Made strong for the search, it is not
        // taken out: a call back from `f` finds it as it is.
        let weak = std::mem::ManuallyDrop::new(unsafe { Weak::from_raw(k.snapshot.get()) });
        weak.upgrade()
    });
    // `f` called once: called on each way, it was not inlined (15 instructions, callgrind).
    // None kept (or replaced since the version was read): the index read as before.
    let guard;
    let snapshot: &Snapshot<Arc<Shard>> = match &kept {
        Some(s) => s,
        None => {
            guard = index.load();
            &guard
        }
    };
    f(snapshot.find(ptr))
}

impl KeptSnapshot {
    /// Keeps a weak count of the index's current snapshot, of version `generation` (read
    /// before it), in place of the one kept, and returns it; `None`, having kept nothing, when
    /// the thread's exit would not give it back.
    #[cold]
    #[inline(never)]
    fn read_again(
        &self,
        index: &SegmentIndex<Arc<Shard>>,
        id: u64,
        generation: u64,
    ) -> Option<Arc<Snapshot<Arc<Shard>>>> {
        if OWNER.get() != OWNED && !ShardCache::get().owned() {
            return None;
        }
        let current = index.current();
        let old = self.snapshot.replace(Weak::into_raw(Arc::downgrade(&current)));
        self.index.set(id);
        self.generation.set(generation);
        if !old.is_null() {
            // SAFETY: the weak count kept before, now taken out.
            drop(unsafe { Weak::from_raw(old) });
        }
        Some(current)
    }
}

/// At the thread's exit (from [`ShardCache::give_back`], which marks the thread's counts given
/// back first, so that none is kept again): the weak count kept given back.
pub(super) fn give_back() {
    KEPT.with(|k| {
        let p = k.snapshot.replace(std::ptr::null());
        k.index.set(0);
        if !p.is_null() {
            // SAFETY: the weak count kept, now taken out.
            drop(unsafe { Weak::from_raw(p) });
        }
    })
}
