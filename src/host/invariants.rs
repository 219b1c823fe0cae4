//! The allocator's invariants, checked for tests: where every block is, and the statistics
//! against the blocks.

use super::HostAllocator;
use super::blocks::Block;
use super::classes::{CLASSES, class_size};

/// A block's size is its class's.
fn check_class(b: &Block) {
    assert!(
        b.class < CLASSES && b.size == class_size(b.class),
        "block {:#x}: {} bytes in class {}",
        b.ptr,
        b.size,
        b.class
    );
}

impl HostAllocator {
    /// Checks the allocator's invariants, for tests: every block in the index is in exactly
    /// one place (handed out, a free list, a pending event, deferred or stranded), and is listed
    /// there; its size is its size class's, and the index's entry says the same; the statistics
    /// match the blocks. Panics with what is wrong.
    pub fn check_invariants(&self) {
        let inner = &*self.inner;
        let stripes: Vec<_> = inner.stripes.iter().map(|s| s.0.lock()).collect();
        let slow = inner.slow.lock();
        let mut seen = rustc_hash::FxHashMap::<usize, &str>::default();
        let mut place = |p: usize, what: &'static str| {
            if let Some(other) = seen.insert(p, what) {
                panic!("block {p:#x} is both {other} and {what}");
            }
        };
        let (mut free_blocks, mut free_bytes) = (0i64, 0i64);
        for (s, st) in stripes.iter().enumerate() {
            for (class, list) in st.free.iter().enumerate() {
                for b in list.iter() {
                    assert_eq!(b.class, class, "block {:#x} in the wrong free list", b.ptr);
                    check_class(b);
                    place(b.ptr, "free");
                    free_blocks += 1;
                    free_bytes += b.size as i64;
                }
            }
            let mut pending_blocks = rustc_hash::FxHashMap::<usize, u32>::default();
            for p in &st.pending {
                check_class(&p.block);
                *pending_blocks.entry(p.block.ptr).or_default() += 1;
            }
            assert_eq!(pending_blocks, st.waiting, "pending events and waiting counts differ");
            for &p in pending_blocks.keys() {
                place(p, "pending");
            }
            for (p, b) in st.handed_out.iter() {
                assert_eq!(p, b.ptr);
                check_class(b);
                place(p, "handed out");
                // A free finds a block in its home stripe only (the hit path's stack, or
                // `home_of`).
                let home = b.home.load(std::sync::atomic::Ordering::Relaxed) as usize;
                assert_eq!(home, s, "block {p:#x} is listed in stripe {s}, but its home is {home}");
            }
        }
        for (_, b) in slow.deferred.iter().chain(&slow.stranded) {
            check_class(b);
            place(b.ptr, "deferred or stranded");
        }
        let segments = inner.index.segments();
        let mut bytes = 0i64;
        for &(base, size, _) in &segments {
            bytes += size as i64;
            assert!(seen.contains_key(&(base as usize)), "block {base:#x} is nowhere");
            let owner = inner.index.with_segment(base, |e| e.map(|e| (e.owner.ptr, e.owner.size)));
            assert_eq!(owner, Some((base as usize, size)), "the index's entry at {base:#x} against its block");
        }
        for &p in seen.keys() {
            assert!(segments.iter().any(|s| s.0 as usize == p), "block {p:#x} is cached but not in the index");
        }
        assert_eq!(slow.allocations.current, segments.len() as i64, "allocations against blocks");
        assert_eq!(slow.allocated_bytes.current, bytes, "allocated_bytes against blocks");
        let active: i64 = stripes.iter().map(|s| s.active_requests.current()).sum();
        let active_bytes: i64 = stripes.iter().map(|s| s.active_bytes.current()).sum();
        assert_eq!(active, segments.len() as i64 - free_blocks, "active_requests against free blocks");
        assert_eq!(active_bytes, bytes - free_bytes, "active_bytes against free blocks");
    }
}
