//! The mapped range of ordinary and expandable segments: the whole segment, or the run of
//! pages mapped side by side, checked against the simulated driver's own map; its dma-buf's
//! size; growth and shrink as the segment observers tell them; a hole cutting a segment into
//! two runs; a sleeping pool refused.

use std::sync::{Arc, Mutex};

use crate::common::{MIB, check, sim, sim_with};
use crate::{driver_run, fd_size};
use gpupool::config::Config;
use gpupool::{Error, MappedRange, SegmentEventKind, SleepMode};

#[test]
fn an_ordinary_segment_is_one_range_from_any_byte_of_its_blocks() {
    let (a, drv) = sim(1, 256 * MIB);
    // Two blocks split from one 20 MiB segment (PyTorch's kLargeBuffer for 1-10 MiB requests).
    let p = a.malloc(3 * MIB, 0, 0).unwrap();
    let q = a.malloc(5 * MIB, 0, 0).unwrap();
    let r = a.mapped_range(p).unwrap();
    assert!(!r.expandable && r.device == 0 && r.stream == 0 && r.pool == 0, "{r:?}");
    assert_eq!((r.base, r.bytes), (r.segment_base, r.segment_bytes), "an ordinary segment is one run");
    assert_eq!(r.bytes, 20 * MIB);
    assert!(r.base <= p && q + 5 * MIB as u64 <= r.base + r.bytes as u64, "{r:?} holds both blocks");
    for ptr in [p + 1, q, q + 5 * MIB as u64 - 1] {
        assert_eq!(a.mapped_range(ptr).unwrap(), r, "an interior pointer names the same range");
    }
    let (r2, fd) = a.mapped_range_dmabuf(q + 4096).unwrap();
    assert_eq!(r2, r);
    assert_eq!(fd_size(&fd), r.bytes as u64, "the descriptor's size is the range's");
    assert_eq!(drv.counts().dmabufs, 1);
    a.free(p).unwrap();
    a.free(q).unwrap();
    check(&a);
}

/// The run of `ptr` agrees with the driver's map, and its descriptor's size with the run.
fn run_agrees(a: &gpupool::Allocator, drv: &gpupool::driver::sim::SimDriver, ptr: u64) -> MappedRange {
    let (r, fd) = a.mapped_range_dmabuf(ptr).unwrap();
    assert!(r.expandable, "{r:?}");
    assert_eq!(Some((r.base, r.bytes)), driver_run(drv, 0, ptr), "the run is what the driver has mapped");
    assert_eq!(fd_size(&fd), r.bytes as u64);
    assert!(r.segment_base <= r.base && r.base + r.bytes as u64 <= r.segment_base + r.segment_bytes as u64);
    r
}

#[test]
fn an_expandable_segment_grows_and_shrinks_as_the_observers_tell() {
    let (a, drv) = sim_with(1, 512 * MIB, Config::default());
    let told = Arc::new(Mutex::new(Vec::new()));
    let t = told.clone();
    a.attach_segment_observer(move |e| t.lock().unwrap().push((e.kind, e.address, e.bytes)));
    let p = a.malloc(6 * MIB, 0, 0).unwrap();
    let first = run_agrees(&a, &drv, p);
    assert_eq!(first.bytes, 6 * MIB, "three 2 MiB pages");
    assert_eq!(*told.lock().unwrap(), [(SegmentEventKind::Map, first.base, 6 * MIB)]);
    // Growth: the segment maps pages after the first three, and the run is all of them.
    let q = a.malloc(8 * MIB, 0, 0).unwrap();
    let grown = run_agrees(&a, &drv, q);
    assert_eq!((grown.base, grown.bytes), (first.base, 14 * MIB), "one run over both blocks");
    assert_eq!(a.mapped_range(p).unwrap(), grown, "the first block's run grew with it");
    assert_eq!(told.lock().unwrap()[1], (SegmentEventKind::Map, first.base + 6 * MIB as u64, 8 * MIB));
    // Shrink: the second block freed and its pages unmapped, told before they go.
    a.free(q).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(told.lock().unwrap()[2], (SegmentEventKind::Unmap, first.base + 6 * MIB as u64, 8 * MIB));
    assert_eq!(run_agrees(&a, &drv, p), first, "back to the first three pages");
    assert!(matches!(a.mapped_range(q), Err(Error::InvalidPointer(_))), "the unmapped block is refused");
    a.free(p).unwrap();
    check(&a);
}

#[test]
fn a_hole_cuts_an_expandable_segment_into_two_runs_each_its_own_descriptor() {
    let (a, drv) = sim_with(1, 512 * MIB, Config::default());
    let blocks: Vec<u64> = (0..3).map(|_| a.malloc(4 * MIB, 0, 0).unwrap()).collect();
    let whole = run_agrees(&a, &drv, blocks[0]);
    assert_eq!(whole.bytes, 12 * MIB);
    a.free(blocks[1]).unwrap();
    a.empty_cache(0).unwrap();
    let (lo, hi) = (run_agrees(&a, &drv, blocks[0]), run_agrees(&a, &drv, blocks[2]));
    assert_eq!((lo.base, lo.bytes), (whole.base, 4 * MIB), "{lo:?}");
    assert_eq!((hi.base, hi.bytes), (whole.base + 8 * MIB as u64, 4 * MIB), "{hi:?}");
    assert_eq!((lo.segment_base, lo.segment_bytes), (hi.segment_base, hi.segment_bytes), "one segment");
    // The driver refuses a descriptor over the hole, as CUDA does for a range not wholly
    // mapped: why the runs are registered apart.
    use gpupool::driver::ops::*;
    assert!(drv.mem_range_dmabuf(0, whole.base, whole.bytes).is_err());
    for p in [blocks[0], blocks[2]] {
        a.free(p).unwrap();
    }
    check(&a);
}

#[test]
fn freed_cached_and_foreign_pointers_are_refused_and_change_nothing() {
    for config in [Config::pytorch(), Config::default()] {
        let (a, drv) = sim_with(1, 256 * MIB, config);
        let p = a.malloc(MIB, 0, 0).unwrap();
        let q = a.malloc(MIB, 0, 0).unwrap();
        a.free(q).unwrap();
        let before = (drv.counts(), a.stats(0).unwrap().reserved_bytes.all.current);
        for (ptr, what) in [(0, "not allocated by gpupool"), (8, "not allocated by gpupool"), (q, "not allocated")] {
            for dmabuf in [false, true] {
                let e = if dmabuf { a.mapped_range_dmabuf(ptr).map(|r| r.0) } else { a.mapped_range(ptr) };
                match e {
                    Err(Error::InvalidPointer(m)) => assert!(m.contains(what) && m.contains("pointer"), "{m}"),
                    other => panic!("{ptr:#x}: {other:?}"),
                }
            }
        }
        assert_eq!(
            (drv.counts(), a.stats(0).unwrap().reserved_bytes.all.current),
            before,
            "nothing asked of the driver"
        );
        a.mapped_range(p).unwrap();
        a.free(p).unwrap();
        check(&a);
    }
}

#[test]
fn a_sleeping_pool_is_refused_until_it_wakes() {
    let (a, _drv) = sim_with(1, 256 * MIB, Config::default());
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, 5).unwrap();
    let p = a.malloc(4 * MIB, 0, 5).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    let awake = a.mapped_range(p).unwrap();
    assert_eq!((awake.pool, awake.stream), (pool, 5));
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    match a.mapped_range_dmabuf(p) {
        Err(Error::InvalidValue(m)) => assert!(m.contains("sleeps") && m.contains("gpupool_wake"), "{m}"),
        other => panic!("{:?}", other.map(|r| r.0)),
    }
    a.wake(0, pool).unwrap();
    assert_eq!(a.mapped_range(p).unwrap(), awake);
    a.free(p).unwrap();
    check(&a);
}

#[test]
fn an_observer_that_asks_is_refused_rather_than_deadlocked() {
    let (a, _drv) = sim_with(1, 256 * MIB, Config::default());
    let a = Arc::new(a);
    let answers = Arc::new(Mutex::new(Vec::new()));
    let (w, ans) = (Arc::downgrade(&a), answers.clone());
    a.attach_segment_observer(move |e| {
        if let Some(a) = w.upgrade() {
            ans.lock().unwrap().push((e.kind, a.mapped_range(e.address).map(|r| r.bytes)));
        }
    });
    let p = a.malloc(4 * MIB, 0, 0).unwrap();
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    let answers = answers.lock().unwrap();
    assert_eq!(answers.len(), 2, "{answers:?}");
    for (kind, r) in answers.iter() {
        match r {
            Err(Error::InvalidValue(m)) => assert!(m.contains("inside a segment observer"), "{kind:?}: {m}"),
            other => panic!("{kind:?}: {other:?}"),
        }
    }
}

#[test]
fn a_pool_over_the_programs_allocator_has_each_of_its_segments_as_one_range() {
    // As a pool over ncclMemAlloc: segments from the program, ordinary to gpupool even where
    // the device pools use expandable segments.
    let (a, drv) = sim_with(1, 256 * MIB, Config::default());
    let (s, s2) = (drv.clone(), drv.clone());
    use gpupool::driver::ops::*;
    let pool = a.pool_create_with_allocator(
        move |bytes, device, _| s.mem_alloc(device, bytes).ok(),
        move |p, _, device, _| s2.mem_free(device, p).unwrap(),
    );
    a.begin_allocate_to_pool(0, pool, 3).unwrap();
    let p = a.malloc(5 * MIB, 0, 3).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    let (r, fd) = a.mapped_range_dmabuf(p + 12345).unwrap();
    assert!(!r.expandable && r.pool == pool && r.stream == 3, "{r:?}");
    assert_eq!((r.base, r.bytes), (r.segment_base, r.segment_bytes));
    assert_eq!(fd_size(&fd), r.bytes as u64);
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    assert!(matches!(a.mapped_range(p), Err(Error::InvalidPointer(_))), "its segment went back");
    check(&a);
}
