//! CUDA graphs on the simulated device: the capture rules (no call CUDA forbids during capture,
//! the failure of a request the default pools cannot serve, frees deferred until no capture),
//! private pools (reuse within a capture, pools shared by captures, release, `empty_cache` on
//! live pools, a failed capture released to the byte) and their statistics.
//!
//! The simulated driver fails every forbidden call as CUDA does and counts it
//! (`SimCounts::capture_violations`), and `end_capture` says whether the capture survived: each
//! test checks both.
//!
//! Routes by thread and thread-local captures are in `routes.rs`.

use crate::common;

use std::sync::Arc;

use common::{MIB, check, sim};
use gpupool::Error;
use gpupool::driver::sim::SimDriver;
use gpupool::driver::{CaptureMode, CaptureStatus, DriverError};

use crate::support::{S, S2};
use gpupool::driver::ops::*;

/// Prints "ok" when the pickle's segments carry, in order, the `segment_pool_id` pairs of
/// argv[2] ("a,b a,b ...").
const CHECK_POOL_IDS: &str = r#"
import pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
got = " ".join("%d,%d" % tuple(seg["segment_pool_id"]) for seg in snap["segments"])
print("ok" if got == sys.argv[2] else "segment_pool_id: got %r, want %r" % (got, sys.argv[2]))
"#;

fn code(e: DriverError) -> i32 {
    match e {
        DriverError::Cuda { code, .. } => code,
        other => panic!("not a CUDA error: {other:?}"),
    }
}

/// What CUDA forbids during capture fails in the simulated driver, and invalidates the capture;
/// what it allows does not.
#[test]
fn the_simulated_driver_forbids_what_cuda_forbids_during_capture() {
    let sim = Arc::new(SimDriver::new(1, 1 << 30));
    // Global mode: this thread may not allocate or free.
    sim.begin_capture(S, CaptureMode::Global).unwrap();
    assert!(matches!(sim.stream_capture_status(0, S).unwrap(), CaptureStatus::Active(_)));
    assert_eq!(sim.stream_capture_status(0, S2).unwrap(), CaptureStatus::None);
    assert_eq!(code(sim.mem_alloc(0, 4096).unwrap_err()), 900);
    assert_eq!(sim.stream_capture_status(0, S).unwrap(), CaptureStatus::Invalidated);
    assert!(!sim.end_capture(S).unwrap(), "the capture was invalidated");
    assert_eq!(code(sim.end_capture(S).unwrap_err()), 401, "no capture is under way any more");

    // Another thread's global capture forbids this thread's allocations; a thread-local one
    // does not; relaxed mode lifts the restriction.
    for (mode, forbids) in
        [(CaptureMode::Global, true), (CaptureMode::ThreadLocal, false), (CaptureMode::Relaxed, false)]
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let s2 = sim.clone();
        let t = std::thread::spawn(move || {
            s2.begin_capture(S, mode).unwrap();
            tx.send(()).unwrap();
            done_rx.recv().unwrap();
            s2.end_capture(S).unwrap()
        });
        rx.recv().unwrap();
        let r = sim.mem_alloc(0, 4096);
        assert_eq!(r.is_err(), forbids, "{mode:?}");
        if let Ok(p) = r {
            sim.mem_free(0, p).unwrap();
        }
        let old = sim.exchange_capture_mode(CaptureMode::Relaxed).unwrap();
        let p = sim.mem_alloc(0, 4096).expect("relaxed mode may allocate");
        sim.mem_free(0, p).unwrap();
        assert_eq!(sim.exchange_capture_mode(old).unwrap(), CaptureMode::Relaxed);
        done_tx.send(()).unwrap();
        assert_eq!(t.join().unwrap(), !forbids, "{mode:?}");
    }

    // Synchronising the device is forbidden in every mode; recording an event is allowed, but
    // the event cannot be queried or waited for.
    sim.begin_capture(S, CaptureMode::Relaxed).unwrap();
    let p = sim.mem_alloc(0, 4096).expect("the capturing thread of a relaxed capture may allocate");
    sim.mem_free(0, p).unwrap();
    let ev = sim.event_create(0).unwrap();
    sim.event_record(0, ev, S).unwrap();
    assert!(sim.end_capture(S).unwrap(), "recording an event is allowed");
    sim.begin_capture(S, CaptureMode::Relaxed).unwrap();
    sim.event_record(0, ev, S).unwrap();
    assert_eq!(code(sim.event_query(ev).unwrap_err()), 907);
    assert!(!sim.end_capture(S).unwrap());
    sim.begin_capture(S, CaptureMode::ThreadLocal).unwrap();
    assert_eq!(code(sim.device_synchronize(0).unwrap_err()), 900);
    assert!(!sim.end_capture(S).unwrap());
    sim.event_destroy(0, ev);
    assert_eq!(sim.counts().capture_violations, 4);
    assert_eq!((sim.used(0), sim.live_allocations()), (0, 0));
}

/// A request on a capturing stream is served from the default pools' cache; one that would need
/// a new segment fails with the capture status and a message, and the capture survives.
#[test]
fn a_default_pool_request_that_needs_the_driver_fails_without_breaking_the_capture() {
    let (a, sim) = sim(1, 1 << 30);
    let warm = a.malloc(MIB, 0, S).unwrap();
    a.free(warm).unwrap();
    let allocs = sim.counts().mem_alloc;
    sim.begin_capture(S, CaptureMode::Global).unwrap();
    let p = a.malloc(MIB, 0, S).expect("a warm-up left the block cached");
    assert_eq!(p, warm);
    let e = a.malloc(64 * MIB, 0, S).unwrap_err();
    match &e {
        Error::Capture(m) => {
            assert!(m.contains("private pool") && m.contains("warm-up") && m.contains("captures a CUDA graph"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    a.free(p).unwrap();
    assert!(sim.end_capture(S).unwrap(), "the capture is intact");
    assert_eq!(sim.counts().capture_violations, 0);
    assert_eq!(sim.counts().mem_alloc, allocs, "no cuMemAlloc during capture");
    // After the capture, the same request is served.
    let big = a.malloc(64 * MIB, 0, S).unwrap();
    a.free(big).unwrap();
    check(&a);
}

/// The eager run and the captured run of one "forward pass" take the same memory in a private
/// pool: blocks freed during the capture are reused within it. The pool grows during capture
/// without breaking it.
#[test]
fn a_captured_forward_pass_takes_no_more_memory_than_an_eager_one() {
    let (a, sim) = sim(1, 1 << 30);
    let forward = |stream: usize| {
        let mut prev = a.malloc(8 * MIB, 0, stream).unwrap();
        for layer in 0..6 {
            let next = a.malloc((4 + layer % 3) * MIB, 0, stream).unwrap();
            a.free(prev).unwrap();
            prev = next;
        }
        prev
    };
    let eager_pool = a.pool_create();
    a.begin_allocate_to_pool(0, eager_pool, S2).unwrap();
    let out = forward(S2);
    a.end_allocate_to_pool(0, eager_pool).unwrap();
    let eager = a.pool_stats(0, eager_pool).unwrap().stats;

    let pool = a.pool_create();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    sim.begin_capture(S, CaptureMode::Global).unwrap();
    let captured_out = forward(S);
    assert!(sim.end_capture(S).unwrap(), "the pool grew without breaking the capture");
    a.end_allocate_to_pool(0, pool).unwrap();
    let graph = a.pool_stats(0, pool).unwrap().stats;
    assert_eq!(sim.counts().capture_violations, 0);
    assert_eq!(graph.reserved_bytes.all.peak, eager.reserved_bytes.all.peak);
    assert_eq!(graph.allocated_bytes.all.peak, eager.allocated_bytes.all.peak);
    assert!(graph.reserved_bytes.all.current > 0);
    // The default pools were not touched, and the device totals include both pools.
    let dev = a.stats(0).unwrap();
    assert_eq!(dev.reserved_bytes.all.current, eager.reserved_bytes.all.current + graph.reserved_bytes.all.current);
    a.free(out).unwrap();
    a.free(captured_out).unwrap();
    check(&a);
}

/// A block used on another stream and freed during a capture gets no event then (recording
/// one into the capture and querying it later is illegal): it waits, active, until the routes
/// end, then waits for its event as usual.
#[test]
fn frees_with_stream_uses_wait_until_no_capture() {
    let (a, sim) = sim(1, 1 << 30);
    let pool = a.pool_create();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let p = a.malloc(MIB, 0, S).unwrap();
    a.record_stream(p, S2).unwrap();
    sim.hold_stream(S2);
    sim.begin_capture(S, CaptureMode::Global).unwrap();
    let records = sim.counts().event_record;
    a.free(p).unwrap();
    assert_eq!(sim.counts().event_record, records, "no event recorded during capture");
    let q = a.malloc(MIB, 0, S).unwrap();
    assert_ne!(q, p, "the block awaits the end of the capture");
    let s = a.pool_stats(0, pool).unwrap().stats;
    assert_eq!(s.active.all.current, 2, "the deferred block is still active");
    a.free(q).unwrap();
    assert!(sim.end_capture(S).unwrap());
    check(&a);
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(sim.counts().event_record, records + 1, "the event is recorded once no capture is under way");
    check(&a);
    sim.release_stream(S2);
    // A pool's events are processed when no route is active (PyTorch queries no event while
    // `captures_underway`): here, when the next route ends.
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.active.all.current, 0);
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let r = a.malloc(MIB, 0, S).unwrap();
    assert_eq!(r, p, "once its event completed, the block is reused");
    a.free(r).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(sim.counts().capture_violations, 0);
    check(&a);
}

/// Segments a capture used stay reserved through `empty_cache` while the pool lives (the graph
/// replays into them); a live pool that no capture used gives its free segments back; a live
/// pool reuses its freed blocks.
#[test]
fn empty_cache_keeps_graph_segments_and_releases_the_rest_of_live_pools() {
    let (a, sim) = sim(1, 1 << 30);
    let graph_pool = a.pool_create();
    a.begin_allocate_to_pool(0, graph_pool, S).unwrap();
    sim.begin_capture(S, CaptureMode::Global).unwrap();
    let x = a.malloc(4 * MIB, 0, S).unwrap();
    a.free(x).unwrap();
    assert!(sim.end_capture(S).unwrap());
    a.end_allocate_to_pool(0, graph_pool).unwrap();

    let mem_pool = a.pool_create();
    a.begin_allocate_to_pool_thread(0, mem_pool).unwrap();
    let y = a.malloc(4 * MIB, 0, S2).unwrap();
    a.free(y).unwrap();
    let y2 = a.malloc(4 * MIB, 0, S2).unwrap();
    assert_eq!(y2, y, "a live pool reuses its freed blocks");
    a.free(y2).unwrap();
    a.end_allocate_to_pool(0, mem_pool).unwrap();

    let graph_reserved = a.pool_stats(0, graph_pool).unwrap().stats.reserved_bytes.all.current;
    assert!(graph_reserved > 0);
    assert!(a.pool_stats(0, mem_pool).unwrap().stats.reserved_bytes.all.current > 0);
    a.empty_cache(0).unwrap();
    assert_eq!(a.pool_stats(0, graph_pool).unwrap().stats.reserved_bytes.all.current, graph_reserved);
    assert_eq!(a.pool_stats(0, mem_pool).unwrap().stats.reserved_bytes.all.current, 0);
    assert_eq!(sim.used(0), graph_reserved as usize);
    a.release_pool(0, graph_pool).unwrap();
    assert_eq!(a.pool_stats(0, graph_pool).unwrap().stats.reserved_bytes.all.current, 0);
    assert_eq!(sim.used(0), 0);
    check(&a);
}

/// Two graphs captured into one pool, one after the other: the second reuses what the first
/// freed, so the pool does not grow.
#[test]
fn captures_that_share_a_pool_reuse_its_blocks() {
    let (a, sim) = sim(1, 1 << 30);
    let pool = a.pool_create();
    let capture = |sizes: &[usize]| {
        a.begin_allocate_to_pool(0, pool, S).unwrap();
        sim.begin_capture(S, CaptureMode::Global).unwrap();
        let ptrs: Vec<u64> = sizes.iter().map(|&s| a.malloc(s, 0, S).unwrap()).collect();
        for p in &ptrs {
            a.free(*p).unwrap();
        }
        assert!(sim.end_capture(S).unwrap());
        a.end_allocate_to_pool(0, pool).unwrap();
        ptrs
    };
    let first = capture(&[3 * MIB, 5 * MIB]);
    let reserved = a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current;
    let allocs = sim.counts().mem_alloc;
    let second = capture(&[3 * MIB, 5 * MIB]);
    assert_eq!(second[0], first[0]);
    assert_eq!(sim.counts().mem_alloc, allocs, "the second graph made no segment");
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current, reserved);
    a.release_pool(0, pool).unwrap();
    assert_eq!(sim.used(0), 0);
    check(&a);
}

/// A capture broken by a forbidden call: its pool is released with blocks still allocated, and
/// once they are freed the device has every byte back.
#[test]
fn a_failed_capture_releases_its_pool_to_the_byte() {
    let (a, sim) = sim(1, 1 << 30);
    let keep = a.malloc(2 * MIB, 0, S2).unwrap();
    let (used, reserved) = (sim.used(0), a.stats(0).unwrap().reserved_bytes.all.current);
    let pool = a.pool_create();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    sim.begin_capture(S, CaptureMode::Global).unwrap();
    let live: Vec<u64> = [MIB, 6 * MIB, 30 * MIB].iter().map(|&s| a.malloc(s, 0, S).unwrap()).collect();
    let t = a.malloc(12 * MIB, 0, S).unwrap();
    a.free(t).unwrap();
    // The program's own forbidden call breaks the capture.
    assert!(sim.device_synchronize(0).is_err());
    assert!(!sim.end_capture(S).unwrap());
    assert!(sim.used(0) > used);
    // The RAII scope releases the pool on failure, blocks still allocated.
    a.release_pool(0, pool).unwrap();
    let after_release = a.pool_stats(0, pool).unwrap();
    assert!(after_release.released);
    for p in live {
        a.free(p).unwrap();
    }
    let s = a.pool_stats(0, pool).unwrap().stats;
    assert_eq!((s.reserved_bytes.all.current, s.segment.all.current, s.allocated_bytes.all.current), (0, 0, 0));
    assert_eq!(sim.used(0), used, "the device has every byte back");
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, reserved);
    // Holding nothing, the released pool leaves the summary; its id stays known as released.
    assert!(!a.memory_summary(0).unwrap().contains("Private pools"));
    assert!(a.pool_stats(0, pool).unwrap().released);
    // The pool's id is refused on this device from now on; allocations go to the default pools.
    assert!(matches!(a.begin_allocate_to_pool(0, pool, S), Err(Error::InvalidValue(m)) if m.contains("released")));
    a.free(keep).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(sim.used(0), 0);
    check(&a);
}

/// Every bad argument gets an error naming it, and changes nothing.
#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let (a, _sim) = sim(2, 1 << 30);
    let pool = a.pool_create();
    let other = a.pool_create();
    assert_ne!(pool, 0);
    let invalid = |r: Result<(), Error>, what: &str| match r {
        Err(Error::InvalidValue(m)) => assert!(m.contains(what), "{m:?} should say {what:?}"),
        other => panic!("{other:?}"),
    };
    invalid(a.begin_allocate_to_pool(0, 0, S), "default pools");
    invalid(a.begin_allocate_to_pool(0, u64::MAX, S), "never created");
    invalid(a.begin_allocate_to_pool(7, pool, S), "out of range");
    invalid(a.end_allocate_to_pool(0, pool), "no allocation is routed");
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    invalid(a.begin_allocate_to_pool(0, other, S), &format!("already allocates to pool {pool}"));
    a.begin_allocate_to_pool(1, other, S).expect("another device is another route");
    a.begin_allocate_to_pool_thread(0, other).unwrap();
    invalid(a.begin_allocate_to_pool_thread(0, pool), "the calling thread already allocates");
    // The first route still holds: allocations on S go to `pool`.
    let p = a.malloc(MIB, 0, S).unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocation.all.current, 1);
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    invalid(a.release_pool(0, pool), "already");
    invalid(a.begin_allocate_to_pool_thread(0, pool), "released");
    invalid(a.pool_stats(0, 0).map(|_| ()), "default pools");
    a.end_allocate_to_pool(0, other).unwrap();
    a.end_allocate_to_pool(1, other).unwrap();
    a.release_pool(1, pool).expect("released on device 0 only");
    check(&a);
}

/// Per pool and in the device totals; the summary lists the pools; snapshots carry the pool.
#[test]
fn statistics_summary_and_snapshot_know_the_pools() {
    let (a, _sim) = sim(1, 1 << 30);
    let d = a.malloc(MIB, 0, S2).unwrap();
    let pool = a.pool_create();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let p = a.malloc(3 * MIB, 0, S).unwrap();
    let q = a.malloc(512, 0, S).unwrap();
    let s = a.pool_stats(0, pool).unwrap();
    assert_eq!((s.pool, s.routes, s.released), (pool, 1, false));
    assert_eq!(s.stats.allocation.all.current, 2);
    assert_eq!(s.stats.allocated_bytes.all.current, (3 * MIB + 512) as i64);
    assert_eq!(s.stats.segment.all.current, 2, "a small and a large segment");
    a.free(p).unwrap();
    let s = a.pool_stats(0, pool).unwrap().stats;
    assert_eq!(s.allocated_bytes.all.peak, (3 * MIB + 512) as i64);
    assert_eq!(s.allocated_bytes.all.current, 512);
    assert_eq!(s.allocated_bytes.all.freed, (3 * MIB) as i64);
    let dev = a.stats(0).unwrap();
    assert_eq!(dev.allocated_bytes.all.current, (MIB + 512) as i64);
    assert_eq!(dev.reserved_bytes.all.current, s.reserved_bytes.all.current + (2 * MIB) as i64);
    let summary = a.memory_summary(0).unwrap();
    assert!(summary.contains("Private pools"), "{summary}");
    assert!(summary.lines().any(|l| l.contains(&format!(" {pool} 1 route"))), "{summary}");
    let snap = a.snapshot().unwrap();
    let pools: Vec<u64> = snap.segments.iter().map(|g| g.pool).collect();
    assert_eq!(pools.iter().filter(|&&p| p == pool).count(), 2);
    assert_eq!(pools.iter().filter(|&&p| p == 0).count(), 1);
    // PyTorch's `segment_pool_id`, read back by CPython: (0, pool), and (0, 0) for the default
    // pools, in address order as the snapshot lists them.
    let want: Vec<String> = pools.iter().map(|p| format!("0,{p}")).collect();
    common::history::python_reads(&snap.to_pickle(), CHECK_POOL_IDS, &[&want.join(" ")]);
    a.reset_peak_stats(0).unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocated_bytes.all.peak, 512);
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(q).unwrap();
    a.free(d).unwrap();
    check(&a);
}
