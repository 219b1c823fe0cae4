//! Which shard owns an address: the map from segment ranges to shards that `free` and
//! `record_stream` search, since they are given a pointer and nothing else.
//!
//! Readers load an immutable snapshot (`arc-swap`: no lock and no shared write), search it, and
//! use the shard it names. Writers (a segment obtained or released: a driver call already)
//! copy the snapshot, change it and publish the copy. Threads freeing on different streams so
//! never touch a common cache line here.

//!
//! Generic over the owner it maps to (the allocator stores its shards), so that the index does
//! not depend on what owns the segments.

use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::driver::DevicePtr;

/// One segment and its owner.
#[derive(Clone)]
pub(crate) struct SegmentEntry<T> {
    pub base: DevicePtr,
    pub size: usize,
    pub device: i32,
    pub owner: T,
}

pub(crate) struct SegmentIndex<T> {
    snapshot: ArcSwap<Vec<SegmentEntry<T>>>,
    writer: Mutex<()>,
}

impl<T> Default for SegmentIndex<T> {
    fn default() -> Self {
        SegmentIndex { snapshot: ArcSwap::from_pointee(Vec::new()), writer: Mutex::new(()) }
    }
}

impl<T: Clone> SegmentIndex<T> {
    /// Calls `f` with the segment that contains `ptr`, if any.
    #[inline]
    pub fn with_segment<R>(&self, ptr: DevicePtr, f: impl FnOnce(Option<&SegmentEntry<T>>) -> R) -> R {
        let snap = self.snapshot.load();
        let i = snap.partition_point(|e| e.base <= ptr);
        let hit = i.checked_sub(1).map(|i| &snap[i]).filter(|e| ptr - e.base < e.size as u64);
        f(hit)
    }

    pub fn insert(&self, entry: SegmentEntry<T>) {
        let _w = self.writer.lock();
        let old = self.snapshot.load();
        let mut next: Vec<SegmentEntry<T>> = Vec::with_capacity(old.len() + 1);
        let at = old.partition_point(|e| e.base < entry.base);
        next.extend(old[..at].iter().cloned());
        next.push(entry);
        next.extend(old[at..].iter().cloned());
        self.snapshot.store(Arc::new(next));
    }

    /// Removes the segment at `base`. Call before the segment goes back to the driver: from
    /// then on its addresses may belong to a new segment of another stream, and removing by
    /// base would remove that one too.
    pub fn remove(&self, base: DevicePtr) {
        let _w = self.writer.lock();
        let old = self.snapshot.load();
        let next: Vec<SegmentEntry<T>> = old.iter().filter(|e| e.base != base).cloned().collect();
        self.snapshot.store(Arc::new(next));
    }

    /// Every segment as (base, size, device), in address order.
    pub fn segments(&self) -> Vec<(DevicePtr, usize, i32)> {
        self.snapshot.load().iter().map(|e| (e.base, e.size, e.device)).collect()
    }
}
