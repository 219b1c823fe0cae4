//! The front cache (`src/caching/shard/front.rs`) on the simulated device: blocks of expandable
//! segments freed whole and handed out again by exact size, and every rule that keeps it
//! invisible: statistics exact at each step, the merged view wherever one is needed (a request
//! of another size, snapshots, `empty_cache`), its bounds, bad pointers, and frees from threads
//! and streams the hit path's guess does not cover.
use crate::common;

use std::sync::Arc;

use common::{MIB, check, sim_with};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::error::Error;
use gpupool::history::BlockState as SnapshotBlockState;

fn expandable() -> Config {
    Config { expandable_segments: true, expandable_large_pages: false, ..Config::default() }
}

/// (allocated bytes, active bytes, requested bytes, allocations, inactive split blocks) now.
fn counts(a: &Allocator) -> (i64, i64, i64, i64, i64) {
    let s = a.stats(0).unwrap();
    (
        s.allocated_bytes.all.current,
        s.active_bytes.all.current,
        s.requested_bytes.all.current,
        s.allocation.all.current,
        s.inactive_split.all.current,
    )
}

#[test]
fn a_freed_block_serves_the_next_request_of_its_size_with_exact_statistics() {
    let (a, _drv) = sim_with(1, 256 * MIB, expandable());
    let keep = a.malloc(4096, 0, 0x10).unwrap();
    let p = a.malloc(1000, 0, 0x10).unwrap();
    a.free(p).unwrap();
    check(&a);
    // Inactive at once, as PyTorch counts a block freed with no other stream's use.
    assert_eq!(counts(&a), (4096, 4096, 4096, 1, 0));
    let before = a.stats(0).unwrap();
    for _ in 0..100 {
        let q = a.malloc(1024, 0, 0x10).unwrap();
        assert_eq!(q, p, "the cached block of the rounded size");
        assert_eq!(counts(&a), (4096 + 1024, 4096 + 1024, 4096 + 1024, 2, 0));
        a.free(q).unwrap();
    }
    check(&a);
    let after = a.stats(0).unwrap();
    assert_eq!(after.allocation.all.allocated, before.allocation.all.allocated + 100);
    assert_eq!(after.allocated_bytes.all.peak, 4096 + 1024);
    assert_eq!(after.reserved_bytes.all.current, before.reserved_bytes.all.current, "nothing grew");
    a.free(keep).unwrap();
}

#[test]
fn another_size_is_served_from_the_merged_pools_as_pytorch_would() {
    let (a, _drv) = sim_with(1, 256 * MIB, expandable());
    let x = a.malloc(3 * MIB, 0, 0x10).unwrap();
    let y = a.malloc(3 * MIB, 0, 0x10).unwrap();
    let z = a.malloc(3 * MIB, 0, 0x10).unwrap();
    let reserved = a.stats(0).unwrap().reserved_bytes.all.current;
    a.free(x).unwrap();
    a.free(y).unwrap();
    check(&a);
    // Neither cached block fits 6 MiB alone; merged, they do: no growth, PyTorch's address.
    let w = a.malloc(6 * MIB, 0, 0x10).unwrap();
    assert_eq!(w, x);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, reserved);
    // A smaller size than any cached block: the best fit of the merged pools, split.
    a.free(w).unwrap();
    let v = a.malloc(MIB + 512, 0, 0x10).unwrap();
    assert_eq!(v, x, "lowest address of the smallest fitting merged block");
    check(&a);
    for p in [v, z] {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    check(&a);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0, "every page given back");
}

#[test]
fn a_snapshot_shows_the_merged_blocks() {
    let (a, _drv) = sim_with(1, 256 * MIB, expandable());
    let ps: Vec<u64> = (0..4).map(|_| a.malloc(MIB, 0, 0x10).unwrap()).collect();
    let last = a.malloc(MIB, 0, 0x10).unwrap();
    for &p in &ps {
        a.free(p).unwrap();
    }
    let snap = a.snapshot().unwrap();
    let seg = snap.segments.iter().find(|s| s.address <= ps[0] && ps[0] < s.address + s.total_size as u64).unwrap();
    let inactive: Vec<_> = seg.blocks.iter().filter(|b| b.state == SnapshotBlockState::Inactive).collect();
    assert_eq!(inactive[0].address, ps[0], "the four freed blocks are one inactive block");
    assert_eq!(inactive[0].size, 4 * MIB);
    check(&a);
    a.free(last).unwrap();
}

#[test]
fn bounded_the_oldest_merged_first() {
    let (a, _drv) = sim_with(1, 512 * MIB, expandable());
    // Every other block stays allocated, so that no two freed blocks would merge.
    let ps: Vec<u64> = (0..80).map(|i| a.malloc(4096 * (1 + i % 40), 0, 0x10).unwrap()).collect();
    for &p in ps.iter().step_by(2) {
        a.free(p).unwrap();
        check(&a);
    }
    // The 256 MiB bound: blocks of 100 MiB, two at most cached.
    let big: Vec<u64> = (0..3).map(|_| a.malloc(100 * MIB, 0, 0x20).unwrap()).collect();
    for &p in &big {
        a.free(p).unwrap();
        check(&a);
    }
    for &p in ps.iter().skip(1).step_by(2) {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    check(&a);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
}

#[test]
fn a_cached_block_is_not_allocated_to_any_call() {
    let (a, _drv) = sim_with(1, 64 * MIB, expandable());
    let p = a.malloc(512, 0, 0x10).unwrap();
    let keep = a.malloc(512, 0, 0x10).unwrap();
    a.free(p).unwrap();
    let before = counts(&a);
    let double = a.free(p).unwrap_err();
    assert!(matches!(&double, Error::InvalidPointer(m) if m.contains("double free")), "{double}");
    assert!(matches!(a.record_stream(p, 0x20), Err(Error::InvalidPointer(_))));
    assert!(matches!(a.free_after_device_sync(p), Err(Error::InvalidPointer(_))));
    assert!(matches!(a.free(p + 256), Err(Error::InvalidPointer(_))));
    assert_eq!(a.block_info(p), None);
    assert_eq!(counts(&a), before, "nothing changed");
    check(&a);
    // Still served again, once.
    assert_eq!(a.malloc(512, 0, 0x10).unwrap(), p);
    a.free(p).unwrap();
    a.free(keep).unwrap();
    check(&a);
}

/// The shard remembers the block it handed out last (`ShardState::allocated`'s hint): a
/// second free of it, or a free after its segment went back to the driver, is still refused.
#[test]
fn the_block_handed_out_last_is_freed_once() {
    let (a, _drv) = sim_with(1, 64 * MIB, expandable());
    for _ in 0..3 {
        let p = a.malloc(512, 0, 0x10).unwrap();
        a.free(p).unwrap();
        let before = counts(&a);
        let double = a.free(p).unwrap_err();
        assert!(matches!(&double, Error::InvalidPointer(m) if m.contains("double free")), "{double}");
        assert_eq!(counts(&a), before, "nothing changed");
        check(&a);
    }
    let p = a.malloc(512, 0, 0x10).unwrap();
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    assert!(matches!(a.free(p), Err(Error::InvalidPointer(_))), "its segment was released");
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    // Another block at the same address is the one freed.
    let q = a.malloc(512, 0, 0x10).unwrap();
    let r = a.malloc(512, 0, 0x10).unwrap();
    a.free(q).unwrap();
    assert_eq!(counts(&a).3, 1);
    a.free(r).unwrap();
    assert_eq!(counts(&a).3, 0);
    check(&a);
}

#[test]
fn frees_from_other_threads_and_streams_and_after_record_stream() {
    let (a, drv) = sim_with(1, 256 * MIB, expandable());
    let a = Arc::new(a);
    // This thread's last shard is stream 0x10's; blocks of 0x20 and of another thread's
    // stream are found through the segment index.
    let other = a.malloc(8192, 0, 0x20).unwrap();
    let mine = a.malloc(8192, 0, 0x10).unwrap();
    a.free(other).unwrap();
    let theirs = {
        let a = a.clone();
        std::thread::spawn(move || a.malloc(8192, 0, 0x30).unwrap()).join().unwrap()
    };
    a.free(theirs).unwrap();
    let given = {
        let a = a.clone();
        std::thread::spawn(move || a.free(mine)).join().unwrap()
    };
    given.unwrap();
    check(&a);
    assert_eq!(counts(&a).0, 0);
    // A block another stream used waits for its event, never entering the front cache early.
    let p = a.malloc(8192, 0, 0x10).unwrap();
    a.record_stream(p, 0x40).unwrap();
    drv.hold_stream(0x40);
    a.free(p).unwrap();
    let q = a.malloc(8192, 0, 0x10).unwrap();
    assert_ne!(q, p, "the event has not completed");
    drv.release_stream(0x40);
    a.free(q).unwrap();
    check(&a);
    let r = a.malloc(8192, 0, 0x10).unwrap();
    assert!(r == p || r == q);
    a.free(r).unwrap();
    check(&a);
}

#[test]
fn threads_churning_their_own_streams_keep_every_invariant() {
    let (a, _drv) = sim_with(1, 1 << 30, expandable());
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let stream = 0x100 + t as usize;
                let mut live = Vec::new();
                for i in 0..20_000u64 {
                    let size = 512 << ((i * 7 + t) % 12);
                    if live.len() < 16 && i % 3 != 2 {
                        live.push(a.malloc(size as usize, 0, stream).unwrap());
                    } else if let Some(p) = live.pop() {
                        a.free(p).unwrap();
                    }
                    if i % 4096 == 0 {
                        a.stats(0).unwrap();
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    check(&a);
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocated_bytes.all.current, s.active_bytes.all.current), (0, 0));
    a.empty_cache(0).unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
}

#[test]
fn ordinary_segments_merge_at_every_free_as_pytorch() {
    let (a, _drv) = sim_with(1, 64 * MIB, Config::pytorch());
    let p = a.malloc(512, 0, 0x10).unwrap();
    let q = a.malloc(512, 0, 0x10).unwrap();
    a.free(p).unwrap();
    // p's block is an inactive split block of its segment at once.
    assert_eq!(counts(&a).4, 2, "p and the rest after q");
    a.free(q).unwrap();
    assert_eq!(counts(&a).4, 0, "one whole free segment");
    check(&a);
}
