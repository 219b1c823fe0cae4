//! The red team: bad flags, a fault in the fallback pool's driver calls, a fallback pool
//! released while its blocks are in use, an out-of-memory observer that allocates from inside
//! (served by the fallback), and threads allocating while another exhausts the device.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use common::{MIB, check, sim};
use gpupool::driver::DriverError;
use gpupool::driver::sim::SimOp;
use gpupool::{Error, POOL_NO_SPLIT, POOL_USE_ON_OOM};

use crate::rules::{S, allocated, fill, observed, reserved};

#[test]
fn unknown_flag_bits_are_refused_by_name() {
    let (a, _drv) = sim(1, 64 * MIB);
    for bad in [4, 1 << 31, u32::MAX, POOL_USE_ON_OOM | 8] {
        match a.pool_create_ex(bad) {
            Err(Error::InvalidValue(m)) => {
                assert!(m.contains(&format!("{:#x}", bad & !3)) && m.contains("unknown bits"), "{m}");
            }
            other => panic!("flags {bad:#x}: {other:?}"),
        }
    }
    let plain = a.pool_create_ex(0).unwrap();
    let both = a.pool_create_ex(POOL_USE_ON_OOM | POOL_NO_SPLIT).unwrap();
    assert!(plain != 0 && both > plain);
    // Flags make no pool routable twice nor change the checks of the other calls.
    assert!(a.pool_stats(0, both).is_ok());
    a.release_pool(0, both).unwrap();
    assert!(matches!(a.release_pool(0, both), Err(Error::InvalidValue(_))));
}

/// A driver call of the fallback (the pool's events processed first) fails: the request fails
/// with that error, nothing handed out; once the fault is gone the fallback serves.
#[test]
fn a_fault_in_the_fallback_pools_event_query_fails_the_request_and_leaves_everything_intact() {
    let (a, drv) = sim(1, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    a.begin_allocate_to_pool_thread(0, fb).unwrap();
    let p = a.malloc(40 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, fb).unwrap();
    // Used on another stream: its free waits for an event, queried by the fallback.
    a.record_stream(p, S + 9).unwrap();
    a.free(p).unwrap();
    let before = a.stats(0).unwrap();
    drv.inject_fault(
        SimOp::EventQuery,
        0,
        DriverError::Cuda { call: "cuEventQuery", code: 999, name: "CUDA_ERROR_UNKNOWN".into() },
    );
    let r = a.malloc(30 * MIB, 0, S);
    assert!(matches!(&r, Err(Error::Cuda(m)) if m.contains("cuEventQuery")), "{r:?}");
    drv.clear_faults();
    let after = a.stats(0).unwrap();
    assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert_eq!((after.num_ooms, reserved(&a, fb)), (0, 40 * MIB as i64));
    check(&a);
    let q = a.malloc(30 * MIB, 0, S).expect("served once the fault is gone");
    assert_eq!(allocated(&a, fb), 30 * MIB as i64);
    a.free(q).unwrap();
    check(&a);
}

/// A fallback pool released while a block it served is in use: it serves no more, its segment
/// stays until that block is freed, then goes back to the driver; the statistics end at zero.
#[test]
fn a_fallback_pool_released_while_in_use_serves_no_more_and_gives_back_on_the_last_free() {
    let (a, _drv) = sim(1, 24 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill(&a, fb, &[4 * MIB]);
    assert_eq!(reserved(&a, fb), 20 * MIB as i64);
    let p = a.malloc(10 * MIB, 0, S).expect("the fallback");
    assert_eq!(allocated(&a, fb), 10 * MIB as i64);
    a.release_pool(0, fb).unwrap();
    assert_eq!(reserved(&a, fb), 20 * MIB as i64, "in use: kept");
    let calls = observed(&a);
    // The pool's 10 free MiB would fit: a released pool serves nothing.
    assert!(matches!(a.malloc(8 * MIB, 0, S), Err(Error::OutOfMemory(_))));
    assert_eq!((calls.load(Ordering::SeqCst), a.stats(0).unwrap().num_ooms), (1, 1));
    check(&a);
    a.free(p).unwrap();
    let s = a.pool_stats(0, fb).unwrap();
    assert!(s.released);
    assert_eq!((s.stats.reserved_bytes.all.current, s.stats.allocated_bytes.all.current), (0, 0));
    let q = a.malloc(8 * MIB, 0, S).expect("room again");
    a.free(q).unwrap();
    check(&a);
}

/// An out-of-memory observer that allocates from the default pools is served by the fallback
/// (a request of its own, counted as none, calling no observer again); the outer request, too
/// large for anything, still fails once.
#[test]
fn an_observer_allocating_from_inside_is_served_by_the_fallback() {
    let (a, _drv) = sim(1, 32 * MIB);
    let a = Arc::new(a);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    a.begin_allocate_to_pool_thread(0, fb).unwrap();
    let held = a.malloc(4 * MIB, 0, S).unwrap();
    let spare = a.malloc(4 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, fb).unwrap();
    a.free(spare).unwrap();
    // fb: a 20 MiB segment, 4 MiB held (so never released), 16 MiB free; 12 MiB left on the device.
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Weak: an observer holding the allocator it observes would keep it alive for good.
    let (weak, c2) = (Arc::downgrade(&a), calls.clone());
    a.attach_oom_observer(move |_| {
        let a2 = weak.upgrade().expect("the test holds the allocator");
        c2.fetch_add(1, Ordering::SeqCst);
        let inner = a2.malloc(14 * MIB, 0, S).expect("the observer's request, served by the fallback");
        assert_eq!(allocated(&a2, fb), 18 * MIB as i64);
        a2.free(inner).unwrap();
        true
    });
    let r = a.malloc(40 * MIB, 0, S);
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    assert_eq!((calls.load(Ordering::SeqCst), a.stats(0).unwrap().num_ooms), (1, 1));
    assert_eq!(allocated(&a, fb), 4 * MIB as i64);
    a.free(held).unwrap();
    check(&a);
}

/// Threads allocating and freeing on the fallback pool's stream while another exhausts the
/// device: every request is served or refused with out of memory, nothing deadlocks, the
/// fallback served some, and everything freed leaves the statistics at zero, the invariants
/// whole.
#[test]
fn threads_allocate_while_another_exhausts_the_device() {
    let (a, _drv) = sim(1, 256 * MIB);
    let a = Arc::new(a);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill(&a, fb, &[64 * MIB]);
    let start = Arc::new(Barrier::new(5));
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let (a, start) = (a.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            start.wait();
            let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ t;
            for _ in 0..500 {
                let size = (2 + (common::xorshift(&mut state) % 5) as usize) * MIB;
                match a.malloc(size, 0, S) {
                    Ok(p) => a.free(p).unwrap(),
                    Err(Error::OutOfMemory(_)) => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
        }));
    }
    let exhaust = {
        let (a, start) = (a.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            for _ in 0..5 {
                let mut held = Vec::new();
                loop {
                    match a.malloc(20 * MIB, 0, S) {
                        Ok(p) => held.push(p),
                        Err(Error::OutOfMemory(_)) => break,
                        Err(e) => panic!("{e:?}"),
                    }
                }
                for p in held {
                    a.free(p).unwrap();
                }
            }
        })
    };
    for t in threads.into_iter().chain([exhaust]) {
        t.join().unwrap();
    }
    let s = a.pool_stats(0, fb).unwrap().stats;
    assert!(s.allocation.all.allocated > 1, "the fallback served: {}", s.allocation.all.allocated);
    assert_eq!((s.allocated_bytes.all.current, a.stats(0).unwrap().allocated_bytes.all.current), (0, 0));
    check(&a);
}

/// A fallback pool that keeps a segment for a CUDA graph (a block allocated while its stream
/// captured) serves no fallback on that stream: the graph replays into the segment's free
/// blocks too. gpupool's rule; PyTorch hands them out.
#[test]
fn a_fallback_pools_segment_kept_for_a_graph_serves_no_fallback() {
    let (a, drv) = sim(1, 48 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    a.begin_allocate_to_pool(0, fb, S).unwrap();
    drv.begin_capture(S, gpupool::driver::CaptureMode::Global).unwrap();
    let p = a.malloc(30 * MIB, 0, S).unwrap();
    a.free(p).unwrap();
    assert!(drv.end_capture(S).unwrap(), "the capture survived");
    a.end_allocate_to_pool(0, fb).unwrap();
    assert_eq!((reserved(&a, fb), allocated(&a, fb)), (30 * MIB as i64, 0));
    let r = a.malloc(20 * MIB, 0, S);
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    assert_eq!((allocated(&a, fb), reserved(&a, fb)), (0, 30 * MIB as i64), "the graph's segment untouched");
    // Released (the graph destroyed), the segment goes back and the request fits.
    a.release_pool(0, fb).unwrap();
    let q = a.malloc(20 * MIB, 0, S).unwrap();
    a.free(q).unwrap();
    check(&a);
}
