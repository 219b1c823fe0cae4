//! Private pools whose segments come from the program's allocator (PyTorch
//! `torch.cuda.MemPool(allocator)`) on the simulated device: segments from `alloc` and back
//! through `free`, the default pools untouched, out of memory when `alloc` refuses, segment
//! observers told of them, and a pool whose blocks are not split below an alignment.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{MIB, check, sim};
use gpupool::driver::ops::*;
use gpupool::driver::sim::SimDriver;
use gpupool::{Allocator, Error, SegmentEventKind};

/// (address, bytes, device, stream) of each segment given and each given back.
#[derive(Default)]
struct Calls {
    allocs: Vec<(u64, usize, i32, usize)>,
    frees: Vec<(u64, usize, i32, usize)>,
}

/// A pool whose allocator takes its segments from the simulated driver, recording its calls,
/// and refusing while `refuse` is set.
fn pool_over_sim(a: &Allocator, sim: &Arc<SimDriver>) -> (u64, Arc<Mutex<Calls>>, Arc<AtomicBool>) {
    let calls: Arc<Mutex<Calls>> = Arc::default();
    let refuse = Arc::new(AtomicBool::new(false));
    let (c, s, r) = (calls.clone(), sim.clone(), refuse.clone());
    let (c2, s2) = (calls.clone(), sim.clone());
    let pool = a.pool_create_with_allocator(
        move |bytes, device, stream| {
            if r.load(Ordering::SeqCst) {
                return None;
            }
            let p = s.mem_alloc(device, bytes).ok()?;
            c.lock().unwrap().allocs.push((p, bytes, device, stream));
            Some(p)
        },
        move |p, bytes, device, stream| {
            s2.mem_free(device, p).unwrap();
            c2.lock().unwrap().frees.push((p, bytes, device, stream));
        },
    );
    (pool, calls, refuse)
}

#[test]
fn a_pools_segments_come_from_its_allocator_and_go_back_through_it() {
    let (a, sim) = sim(1, 256 * MIB);
    let (pool, calls, _) = pool_over_sim(&a, &sim);
    let told = Arc::new(Mutex::new(Vec::new()));
    let t = told.clone();
    a.attach_segment_observer(move |e| t.lock().unwrap().push((e.kind, e.address, e.bytes, e.pool)));

    a.begin_allocate_to_pool(0, pool, 5).unwrap();
    let p = a.malloc(MIB, 0, 5).unwrap();
    let q = a.malloc(3 * MIB, 0, 5).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    let other = a.malloc(MIB, 0, 6).unwrap();
    {
        let calls = calls.lock().unwrap();
        // PyTorch's sizes: a 2 MiB small segment, a 20 MiB large one; the default pool's
        // segment came from the driver.
        let sizes: Vec<usize> = calls.allocs.iter().map(|c| c.1).collect();
        assert_eq!(sizes, [2 * MIB, 20 * MIB]);
        assert!(calls.allocs.iter().all(|c| c.2 == 0 && c.3 == 5));
        let within = |x: u64| calls.allocs.iter().any(|c| x >= c.0 && x < c.0 + c.1 as u64);
        assert!(within(p) && within(q) && !within(other), "the pool's blocks lie in its allocator's segments");
    }
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current, 22 * MIB as i64);
    // The device's statistics count every pool: the private pool's 22 MiB and the default's 2.
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 24 * MIB as i64);
    // Cached, split and reused as any pool's: freed and allocated again, no new segment.
    a.free(p).unwrap();
    a.begin_allocate_to_pool(0, pool, 5).unwrap();
    let p2 = a.malloc(MIB, 0, 5).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(calls.lock().unwrap().allocs.len(), 2);
    check(&a);

    for x in [p2, q, other] {
        a.free(x).unwrap();
    }
    a.empty_cache(0).unwrap();
    let calls = calls.lock().unwrap();
    let mut given: Vec<_> = calls.allocs.clone();
    let mut back: Vec<_> = calls.frees.clone();
    given.sort();
    back.sort();
    assert_eq!(given, back, "every segment given back once, through the pool's free");
    let told = told.lock().unwrap();
    let pooled: Vec<_> = told.iter().filter(|e| e.3 == pool).collect();
    assert_eq!(pooled.iter().filter(|e| e.0 == SegmentEventKind::Alloc).count(), 2);
    assert_eq!(pooled.iter().filter(|e| e.0 == SegmentEventKind::Free).count(), 2);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    check(&a);
}

#[test]
fn an_allocator_that_refuses_is_out_of_memory_and_changes_nothing() {
    let (a, sim) = sim(1, 256 * MIB);
    let (pool, calls, refuse) = pool_over_sim(&a, &sim);
    refuse.store(true, Ordering::SeqCst);
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let r = a.malloc(MIB, 0, 0);
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    refuse.store(false, Ordering::SeqCst);
    let p = a.malloc(MIB, 0, 0).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    let calls = calls.lock().unwrap();
    assert_eq!((calls.allocs.len(), calls.frees.len()), (1, 1), "release_pool gave the segment back");
    assert_eq!(sim.used(0), 0);
    check(&a);
}

#[test]
fn an_aligned_pool_never_splits_below_its_alignment() {
    let (a, sim) = sim(1, 512 * MIB);
    let align = 2 * MIB;
    let segments: Arc<Mutex<Vec<(u64, usize)>>> = Arc::default();
    let (g, s, s2) = (segments.clone(), sim.clone(), sim.clone());
    let pool = a
        .pool_create_with_allocator_aligned(
            move |bytes, device, _| {
                let p = s.mem_alloc(device, bytes).ok()?;
                g.lock().unwrap().push((p, bytes));
                Some(p)
            },
            move |p, _, device, _| s2.mem_free(device, p).unwrap(),
            align,
        )
        .unwrap();
    // Sizes below, at and above the alignment, some freed and others served from what they
    // leave, so that blocks are split and merged.
    a.begin_allocate_to_pool(0, pool, 5).unwrap();
    let mut live = Vec::new();
    for (i, size) in [512, MIB, 3 * MIB + 1, 5 * MIB, 2 * MIB, 700 << 10, 9 * MIB].into_iter().enumerate() {
        live.push(a.malloc(size, 0, 5).unwrap());
        if i % 2 == 1 {
            a.free(live.remove(0)).unwrap();
        }
    }
    a.end_allocate_to_pool(0, pool).unwrap();
    let segments = segments.lock().unwrap().clone();
    assert!(segments.iter().all(|&(_, bytes)| bytes % align == 0), "segments of multiples: {segments:?}");
    for &p in &live {
        let &(base, _) = segments.iter().find(|&&(b, n)| p >= b && p < b + n as u64).expect("in a segment");
        assert_eq!((p - base) % align as u64, 0, "block {p:#x} of segment {base:#x}");
    }
    // Rounded up, the rounding counted as allocated: 512 bytes take a whole 2 MiB.
    let before = a.pool_stats(0, pool).unwrap().stats.allocated_bytes.all.current;
    a.begin_allocate_to_pool(0, pool, 5).unwrap();
    let small = a.malloc(512, 0, 5).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocated_bytes.all.current - before, align as i64);
    check(&a);
    for p in live.into_iter().chain([small]) {
        a.free(p).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    check(&a);
}

#[test]
fn a_bad_split_alignment_makes_no_pool() {
    let (a, _sim) = sim(1, 64 * MIB);
    for bad in [1000, 513, (1 << 40) + 512] {
        let e = a.pool_create_with_allocator_aligned(|_, _, _| None, |_, _, _, _| {}, bad).unwrap_err();
        assert!(matches!(e, Error::InvalidValue(ref m) if m.contains("multiple of 512")), "{bad}: {e}");
    }
    assert!(a.pool_create_with_allocator_aligned(|_, _, _| None, |_, _, _, _| {}, 0).unwrap() != 0);
}
