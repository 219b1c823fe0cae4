//! Routes into private pools on the simulated device: a route by thread takes only that
//! thread's allocations and costs the hit path nothing when absent, and a thread-local capture
//! on one thread leaves the others free to allocate.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{MIB, check, sim};
use gpupool::driver::CaptureMode;

use crate::support::{S, S2};

/// Routes by thread take only that thread's allocations; a filter is asked only while a route
/// is active; without routes, the hit path asks the driver nothing about capture.
#[test]
fn routes_take_what_they_name_and_cost_nothing_when_absent() {
    let (a, sim) = sim(1, 1 << 30);
    let a = Arc::new(a);
    for _ in 0..2 {
        let p = a.malloc(MIB, 0, S).unwrap();
        a.free(p).unwrap();
    }
    let asked = sim.counts().capture_info;
    for _ in 0..1000 {
        let p = a.malloc(MIB, 0, S).unwrap();
        a.free(p).unwrap();
    }
    assert_eq!(sim.counts().capture_info, asked, "the hit path asks nothing");

    let pool = a.pool_create();
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let mine = a.malloc(MIB, 0, S).unwrap();
    let a2 = a.clone();
    let theirs = std::thread::spawn(move || a2.malloc(MIB, 0, S).unwrap()).join().unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocation.all.current, 1, "only this thread's");
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(mine).unwrap();
    a.free(theirs).unwrap();

    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    a.begin_allocate_to_pool_filter(0, pool, move |s| {
        c.fetch_add(1, Ordering::Relaxed);
        s == S2
    })
    .unwrap();
    let in_pool = a.malloc(MIB, 0, S2).unwrap();
    let outside = a.malloc(MIB, 0, S).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocation.all.current, 1);
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(in_pool).unwrap();
    a.free(outside).unwrap();
    let p = a.malloc(MIB, 0, S2).unwrap();
    a.free(p).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 2, "no filter call once the route ended");
    check(&a);
}

/// A thread-local capture on one thread does not restrict another: that thread's default-pool
/// requests still grow the cache, and the capture survives.
#[test]
fn a_thread_local_capture_leaves_other_threads_free_to_allocate() {
    let (a, sim) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let pool = a.pool_create();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (a2, sim2) = (a.clone(), sim.clone());
    let capturer = std::thread::spawn(move || {
        sim2.begin_capture(S, CaptureMode::ThreadLocal).unwrap();
        let p = a2.malloc(8 * MIB, 0, S).unwrap();
        tx.send(()).unwrap();
        go_rx.recv().unwrap();
        a2.free(p).unwrap();
        sim2.end_capture(S).unwrap()
    });
    rx.recv().unwrap();
    let other = a.malloc(16 * MIB, 0, S2).expect("another thread grows the default pools");
    go_tx.send(()).unwrap();
    assert!(capturer.join().unwrap(), "the capture survived");
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(other).unwrap();
    assert_eq!(sim.counts().capture_violations, 0);
    a.release_pool(0, pool).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(sim.used(0), 0);
    check(&a);
}
