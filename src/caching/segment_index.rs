//! Which shard owns an address: the map from segment ranges to shards that `free` and
//! `record_stream` search, since they are given a pointer and nothing else.
//!
//! Readers load an immutable snapshot (`arc-swap`: no lock and no shared write), search it, and
//! use the owner it names. Writers (a segment obtained or released: a driver call already)
//! copy what changes, and publish a new snapshot. Threads freeing on different streams so never
//! touch a common cache line here.
//!
//! The snapshot is a sorted list of chunks of at most [`CHUNK_MAX`] segments each, so that a
//! writer copies one chunk and the list of chunk pointers, not every segment: a new segment
//! costs O(segments / CHUNK + CHUNK) however many streams hold segments, where one flat sorted
//! list cost O(segments), 100 µs a segment at 10,000 streams. A lookup is two binary searches.
//!
//! Each level keeps its keys apart from what they lead to, in a sorted array padded with
//! `DevicePtr::MAX` to a power of two, and is searched in a fixed number of branch-free halving
//! steps: the chunk's bases in exactly 7 (a chunk holds at most 128), the chunks' first bases
//! in log2 of their count. Searching the entries themselves (`partition_point` over the chunks'
//! first entries, then over a chunk's entries, 32 bytes apart) cost a free about 140
//! instructions at 1,000 segments (callgrind, `examples/stream_rotation.rs`).
//!
//! Generic over the owner it maps to (the allocator stores its shards), so that the index does
//! not depend on what owns the segments.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::driver::DevicePtr;

/// Most segments in a chunk after a split; a chunk that grows past twice this is split in two.
const CHUNK: usize = 64;
/// Most segments a chunk holds: the length of its array of bases.
const CHUNK_MAX: usize = 2 * CHUNK;

/// One segment and its owner.
#[derive(Clone)]
pub(crate) struct SegmentEntry<T> {
    pub base: DevicePtr,
    pub size: usize,
    pub device: i32,
    pub owner: T,
}

/// Segments in address order, at least one and at most [`CHUNK_MAX`].
struct Chunk<T> {
    /// `entries`' bases, then `DevicePtr::MAX` (see the module's doc).
    bases: Box<[DevicePtr; CHUNK_MAX]>,
    entries: Vec<SegmentEntry<T>>,
}

impl<T> Chunk<T> {
    fn new(entries: Vec<SegmentEntry<T>>) -> Arc<Chunk<T>> {
        debug_assert!(!entries.is_empty() && entries.len() <= CHUNK_MAX);
        let mut bases = Box::new([DevicePtr::MAX; CHUNK_MAX]);
        for (b, e) in bases.iter_mut().zip(&entries) {
            *b = e.base;
        }
        Arc::new(Chunk { bases, entries })
    }

    /// The last entry whose base is at most `ptr`, for a `ptr` at or above the first base (the
    /// chunk's search found it so). Seven steps, each a comparison and a conditional move.
    #[inline(always)]
    fn at_or_below(&self, ptr: DevicePtr) -> Option<&SegmentEntry<T>> {
        let mut i = 0;
        let mut step = CHUNK_MAX / 2;
        while step > 0 {
            // `i + step` stays below CHUNK_MAX: `i` is a sum of larger steps, each half the one
            // before.
            let j = (i + step) % CHUNK_MAX;
            i = if self.bases[j] <= ptr { j } else { i };
            step /= 2;
        }
        // A padding key (`ptr` is `DevicePtr::MAX`) names no entry.
        self.entries.get(i)
    }
}

/// The chunks in address order, none empty, and their first bases (see the module's doc).
pub(crate) struct Snapshot<T> {
    /// `chunks`' first bases, then `DevicePtr::MAX` up to a power of two (at least one key).
    firsts: Vec<DevicePtr>,
    chunks: Vec<Arc<Chunk<T>>>,
}

impl<T> Snapshot<T> {
    fn new(chunks: Vec<Arc<Chunk<T>>>) -> Snapshot<T> {
        let mut firsts: Vec<DevicePtr> = chunks.iter().map(|c| c.bases[0]).collect();
        firsts.resize(chunks.len().next_power_of_two(), DevicePtr::MAX);
        Snapshot { firsts, chunks }
    }

    /// The chunk whose range holds `ptr`: the last whose first base is at most `ptr`.
    #[inline(always)]
    fn chunk_of(&self, ptr: DevicePtr) -> Option<&Chunk<T>> {
        let f = &self.firsts[..];
        let mut c = 0;
        let mut step = f.len() / 2;
        while step > 0 {
            let j = c + step;
            // SAFETY: `j < f.len()`, a power of two: `c` is a sum of larger steps, each half the
            // one before, the first half the length. (Checked, the compiler branched on each
            // step instead of a conditional move: 3 instructions more a step, callgrind.)
            let key = unsafe { *f.get_unchecked(j) };
            c = if key <= ptr { j } else { c };
            step /= 2;
        }
        if f[0] > ptr {
            return None;
        }
        self.chunks.get(c).map(|c| &**c)
    }

    /// The segment that contains `ptr`, if any.
    #[inline(always)]
    pub fn find(&self, ptr: DevicePtr) -> Option<&SegmentEntry<T>> {
        self.chunk_of(ptr).and_then(|c| c.at_or_below(ptr)).filter(|e| ptr - e.base < e.size as u64)
    }

    /// The chunk whose range holds `base`: the last that starts at or below it; `None` below
    /// every chunk (a writer's search: [`Snapshot::chunk_of`] is the readers').
    fn chunk_at(&self, base: DevicePtr) -> Option<usize> {
        self.chunks.partition_point(|c| c.bases[0] <= base).checked_sub(1)
    }
}

/// Ids of indexes ([`SegmentIndex::version`]), 0 being none's.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct SegmentIndex<T> {
    snapshot: ArcSwap<Snapshot<T>>,
    /// This index's, unique in the process.
    id: u64,
    /// Moved on by each writer once it published its snapshot (see [`SegmentIndex::version`]).
    generation: AtomicU64,
    writer: Mutex<()>,
}

impl<T> Default for SegmentIndex<T> {
    fn default() -> Self {
        SegmentIndex {
            snapshot: ArcSwap::from_pointee(Snapshot::new(Vec::new())),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            generation: AtomicU64::new(0),
            writer: Mutex::new(()),
        }
    }
}

impl<T: Clone> SegmentIndex<T> {
    /// Calls `f` with the segment that contains `ptr`, if any.
    #[inline]
    pub fn with_segment<R>(&self, ptr: DevicePtr, f: impl FnOnce(Option<&SegmentEntry<T>>) -> R) -> R {
        let snap = self.snapshot.load();
        f(snap.find(ptr))
    }

    /// The index's id and the count of snapshots published so far. A reader that keeps the
    /// snapshot of [`SegmentIndex::current`], taken after this was read, may search it for as
    /// long as this reads the same: each writer publishes its snapshot before it moves the count
    /// on (with release ordering, read here with acquire), so a segment inserted before the
    /// call that reads this (the malloc that handed out a block of it, say) is in it.
    #[inline(always)]
    pub fn version(&self) -> (u64, u64) {
        (self.id, self.generation.load(Ordering::Acquire))
    }

    /// The snapshot published last, for a search (as [`SegmentIndex::with_segment`]'s).
    #[inline(always)]
    pub fn load(&self) -> arc_swap::Guard<Arc<Snapshot<T>>> {
        self.snapshot.load()
    }

    /// The snapshot published last, kept by the caller (see [`SegmentIndex::version`]).
    pub fn current(&self) -> Arc<Snapshot<T>> {
        self.snapshot.load_full()
    }

    /// Publishes `next` (writers, under the writer's lock).
    fn publish(&self, next: Vec<Arc<Chunk<T>>>) {
        self.snapshot.store(Arc::new(Snapshot::new(next)));
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Adds a segment (a new one from the driver, or one put back after a failed release).
    pub fn insert(&self, entry: SegmentEntry<T>) {
        let _w = self.writer.lock();
        let snap = self.snapshot.load();
        let old = &snap.chunks;
        let mut next: Vec<Arc<Chunk<T>>> = Vec::with_capacity(old.len() + 1);
        // The chunk whose range the new base falls in (or the first chunk, for a base below
        // every segment).
        let at = snap.chunk_at(entry.base).unwrap_or(0);
        next.extend(old[..at.min(old.len())].iter().cloned());
        let mut chunk: Vec<SegmentEntry<T>> = old.get(at).map(|c| c.entries.clone()).unwrap_or_default();
        let i = chunk.partition_point(|e| e.base < entry.base);
        chunk.insert(i, entry);
        if chunk.len() > CHUNK_MAX {
            let upper = chunk.split_off(CHUNK);
            next.push(Chunk::new(chunk));
            next.push(Chunk::new(upper));
        } else {
            next.push(Chunk::new(chunk));
        }
        if at < old.len() {
            next.extend(old[at + 1..].iter().cloned());
        }
        self.publish(next);
    }

    /// Removes the segment at `base`. Call before the segment goes back to the driver: from
    /// then on its addresses may belong to a new segment of another stream, and removing by
    /// base would remove that one too.
    pub fn remove(&self, base: DevicePtr) {
        let _w = self.writer.lock();
        let snap = self.snapshot.load();
        let old = &snap.chunks;
        let Some(at) = snap.chunk_at(base) else { return };
        let chunk: Vec<SegmentEntry<T>> = old[at].entries.iter().filter(|e| e.base != base).cloned().collect();
        if chunk.len() == old[at].entries.len() {
            return;
        }
        let mut next: Vec<Arc<Chunk<T>>> = Vec::with_capacity(old.len());
        next.extend(old[..at].iter().cloned());
        if !chunk.is_empty() {
            next.push(Chunk::new(chunk));
        }
        next.extend(old[at + 1..].iter().cloned());
        self.publish(next);
    }

    /// Every segment as (base, size, device), in address order.
    pub fn segments(&self) -> Vec<(DevicePtr, usize, i32)> {
        self.snapshot.load().chunks.iter().flat_map(|c| c.entries.iter().map(|e| (e.base, e.size, e.device))).collect()
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
        assert!(!index.with_segment(u64::MAX, |e| e.is_some()), "the padding's key");
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
