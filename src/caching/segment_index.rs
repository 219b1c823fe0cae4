//! Which shard owns an address: the map from segment ranges to shards that `free` and
//! `record_stream` search, since they are given a pointer and nothing else.
//!
//! Readers load an immutable snapshot (`arc-swap`: no lock and no shared write), search it, and
//! use the owner it names. Writers (a segment obtained or released: a driver call already)
//! copy what changes, and publish a new snapshot. Threads freeing on different streams so never
//! touch a common cache line here.
//!
//! The snapshot is a sorted list of chunks of at most [`CHUNK`] segments each, so that a
//! writer copies one chunk and the list of chunk pointers, not every segment: a new segment
//! costs O(segments / CHUNK + CHUNK) however many streams hold segments, where one flat sorted
//! list cost O(segments), 100 µs a segment at 10,000 streams. A lookup is two binary searches.
//!
//! Generic over the owner it maps to (the allocator stores its shards), so that the index does
//! not depend on what owns the segments.

use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::driver::DevicePtr;

/// Most segments in a chunk; a chunk that grows past it is split in two.
const CHUNK: usize = 64;

/// One segment and its owner.
#[derive(Clone)]
pub(crate) struct SegmentEntry<T> {
    pub base: DevicePtr,
    pub size: usize,
    pub device: i32,
    pub owner: T,
}

/// Segments in address order, at least one.
type Chunk<T> = Arc<Vec<SegmentEntry<T>>>;

pub(crate) struct SegmentIndex<T> {
    /// Chunks in address order, none empty.
    snapshot: ArcSwap<Vec<Chunk<T>>>,
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
        let c = snap.partition_point(|c| c[0].base <= ptr);
        let hit = c.checked_sub(1).and_then(|c| {
            let chunk = &snap[c];
            let i = chunk.partition_point(|e| e.base <= ptr);
            i.checked_sub(1).map(|i| &chunk[i]).filter(|e| ptr - e.base < e.size as u64)
        });
        f(hit)
    }

    /// Adds a segment (a new one from the driver, or one put back after a failed release).
    pub fn insert(&self, entry: SegmentEntry<T>) {
        let _w = self.writer.lock();
        let old = self.snapshot.load();
        let mut next: Vec<Chunk<T>> = Vec::with_capacity(old.len() + 1);
        // The chunk whose range the new base falls in: the last that starts at or below it
        // (or the first chunk, for a base below every segment).
        let at = old.partition_point(|c| c[0].base <= entry.base).saturating_sub(1);
        next.extend(old[..at.min(old.len())].iter().cloned());
        let mut chunk: Vec<SegmentEntry<T>> = old.get(at).map(|c| c.as_ref().clone()).unwrap_or_default();
        let i = chunk.partition_point(|e| e.base < entry.base);
        chunk.insert(i, entry);
        if chunk.len() > 2 * CHUNK {
            let upper = chunk.split_off(CHUNK);
            next.push(Arc::new(chunk));
            next.push(Arc::new(upper));
        } else {
            next.push(Arc::new(chunk));
        }
        if at < old.len() {
            next.extend(old[at + 1..].iter().cloned());
        }
        self.snapshot.store(Arc::new(next));
    }

    /// Removes the segment at `base`. Call before the segment goes back to the driver: from
    /// then on its addresses may belong to a new segment of another stream, and removing by
    /// base would remove that one too.
    pub fn remove(&self, base: DevicePtr) {
        let _w = self.writer.lock();
        let old = self.snapshot.load();
        let Some(at) = old.partition_point(|c| c[0].base <= base).checked_sub(1) else { return };
        let chunk: Vec<SegmentEntry<T>> = old[at].iter().filter(|e| e.base != base).cloned().collect();
        if chunk.len() == old[at].len() {
            return;
        }
        let mut next: Vec<Chunk<T>> = Vec::with_capacity(old.len());
        next.extend(old[..at].iter().cloned());
        if !chunk.is_empty() {
            next.push(Arc::new(chunk));
        }
        next.extend(old[at + 1..].iter().cloned());
        self.snapshot.store(Arc::new(next));
    }

    /// Every segment as (base, size, device), in address order.
    pub fn segments(&self) -> Vec<(DevicePtr, usize, i32)> {
        self.snapshot.load().iter().flat_map(|c| c.iter().map(|e| (e.base, e.size, e.device))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_find_the_containing_segment_through_splits_and_removals() {
        let index = SegmentIndex::<u32>::default();
        // Inserted out of order, enough to split chunks several times.
        let bases: Vec<u64> = (0..1000u64).map(|i| (i * 7919 % 1000) * 0x1000 + 0x10_0000).collect();
        for (n, &b) in bases.iter().enumerate() {
            index.insert(SegmentEntry { base: b, size: 0x800, device: 0, owner: n as u32 });
        }
        let all = index.segments();
        assert_eq!(all.len(), 1000);
        assert!(all.windows(2).all(|w| w[0].0 < w[1].0), "in address order");
        for (n, &b) in bases.iter().enumerate() {
            assert_eq!(index.with_segment(b + 0x7ff, |e| e.map(|e| e.owner)), Some(n as u32));
            assert_eq!(index.with_segment(b + 0x800, |e| e.map(|e| e.owner)), None, "past the end");
        }
        assert!(!index.with_segment(0x10, |e| e.is_some()), "below every segment");
        for &b in bases.iter().step_by(2) {
            index.remove(b);
        }
        for (n, &b) in bases.iter().enumerate() {
            let found = index.with_segment(b, |e| e.map(|e| e.owner));
            assert_eq!(found, (n % 2 == 1).then_some(n as u32));
        }
        for &b in bases.iter().skip(1).step_by(2) {
            index.remove(b);
        }
        assert!(index.segments().is_empty());
        index.insert(SegmentEntry { base: 0x5000, size: 0x1000, device: 1, owner: 7 });
        assert_eq!(index.with_segment(0x5fff, |e| e.map(|e| (e.owner, e.device))), Some((7, 1)));
    }
}
