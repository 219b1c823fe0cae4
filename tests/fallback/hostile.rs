//! The outside red team (issue 43, second pass): bad pool ids and devices for the calls that
//! name a fallback pool or a budget, a failed default request that must leave every pool as it
//! was, frees of fallback blocks from other threads and streams, unsplit fallback pools under
//! contention on several streams, a fallback pool released while eight threads fall back into
//! it, driver faults on the way, and the fallback seen by the history.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use common::history::{record_all, snapshot_agrees};
use common::{MIB, check, sim};
use gpupool::driver::DriverError;
use gpupool::driver::sim::SimOp;
use gpupool::history::{Action, HistoryContext};
use gpupool::{Error, POOL_NO_SPLIT, POOL_USE_ON_OOM};

use crate::rules::{S, allocated, fill_on, observed, reserved};

#[test]
fn calls_naming_pools_refuse_ids_never_made_the_default_pool_and_bad_devices() {
    let (a, _drv) = sim(2, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM | POOL_NO_SPLIT).unwrap();
    let never = fb + 1_000_000;
    for pool in [0, never, u64::MAX, 1 << 62] {
        assert!(matches!(a.begin_allocate_to_pool_thread(0, pool), Err(Error::InvalidValue(_))), "{pool:#x}");
        assert!(matches!(a.release_pool(0, pool), Err(Error::InvalidValue(_))), "{pool:#x}");
        assert!(matches!(a.pool_stats(0, pool), Err(Error::InvalidValue(_))), "{pool:#x}");
    }
    for pool in [never, u64::MAX, 1 << 62] {
        assert!(matches!(a.pool_set_limit(0, pool, Some(MIB as u64)), Err(Error::InvalidValue(_))), "{pool:#x}");
        assert!(matches!(a.pool_limit(0, pool), Err(Error::InvalidValue(_))), "{pool:#x}");
    }
    for dev in [2, 99, i32::MAX, -2, i32::MIN] {
        assert!(a.pool_set_limit(dev, fb, Some(MIB as u64)).is_err(), "device {dev}");
        assert!(a.pool_limit(dev, 0).is_err(), "device {dev}");
        assert!(a.begin_allocate_to_pool_thread(dev, fb).is_err(), "device {dev}");
    }
    // -1 is the current device (0): set there, read there.
    a.pool_set_limit(-1, fb, Some(3 * MIB as u64)).unwrap();
    assert_eq!(a.pool_limit(0, fb).unwrap(), Some(3 * MIB as u64));
    assert_eq!(a.pool_limit(1, fb).unwrap(), None, "a limit is per device");
    // A negative number cast to unsigned is refused; UINT64_MAX removes the limit.
    for bad in [1u64 << 63, u64::MAX - 1] {
        assert!(matches!(a.pool_set_limit(0, fb, Some(bad)), Err(Error::InvalidValue(_))));
        assert_eq!(a.pool_limit(0, fb).unwrap(), Some(3 * MIB as u64), "a refused limit changes nothing");
    }
    a.pool_set_limit(0, fb, Some(u64::MAX)).unwrap();
    assert_eq!(a.pool_limit(0, fb).unwrap(), None);
    // Released (and, holding nothing, forgotten): no limit may be set, its flags serve nothing.
    a.release_pool(0, fb).unwrap();
    assert!(a.all_pool_stats(0).unwrap().iter().all(|s| s.pool != fb), "forgotten");
    assert!(matches!(a.pool_set_limit(0, fb, Some(0)), Err(Error::InvalidValue(_))));
    assert!(matches!(a.begin_allocate_to_pool_thread(0, fb), Err(Error::InvalidValue(_))));
    assert!(matches!(a.release_pool(0, fb), Err(Error::InvalidValue(_))));
    // On the other device it was never released.
    a.pool_set_limit(1, fb, Some(0)).unwrap();
    check(&a);
}

/// The fallback pools' caches too small, a default request fails with PyTorch's message,
/// counted once, observed once; every fallback pool (each segment holding a live block, so
/// that release-and-retry may give none back) is exactly as it was.
#[test]
fn a_request_the_fallback_pools_cannot_serve_fails_and_changes_no_pool() {
    let (a, _drv) = sim(1, 64 * MIB);
    let f1 = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    let f2 = a.pool_create_ex(POOL_USE_ON_OOM | POOL_NO_SPLIT).unwrap();
    let held1 = fill_on(&a, f1, S, &[4 * MIB, 4 * MIB], 1);
    let held2 = fill_on(&a, f2, S, &[MIB], 1);
    let hog = a.malloc(40 * MIB, 0, S + 3).unwrap();
    let before = (a.pool_stats(0, f1).unwrap(), a.pool_stats(0, f2).unwrap(), a.stats(0).unwrap());
    let calls = observed(&a);
    for size in [17 * MIB, 30 * MIB, 1 << 40] {
        let r = a.malloc(size, 0, S);
        match &r {
            Err(Error::OutOfMemory(m)) => assert!(m.starts_with("CUDA out of memory. Tried to allocate"), "{m}"),
            other => panic!("{size}: {other:?}"),
        }
        assert_eq!(a.pool_stats(0, f1).unwrap(), before.0, "{size}: pool {f1}");
        assert_eq!(a.pool_stats(0, f2).unwrap(), before.1, "{size}: pool {f2}");
        let d = a.stats(0).unwrap();
        assert_eq!(
            (d.allocated_bytes, d.active_bytes, d.allocation),
            (before.2.allocated_bytes, before.2.active_bytes, before.2.allocation)
        );
        check(&a);
    }
    assert_eq!((calls.load(Ordering::SeqCst), a.stats(0).unwrap().num_ooms), (3, 3));
    for p in held1.into_iter().chain(held2).chain([hog]) {
        a.free(p).unwrap();
    }
    check(&a);
}

/// A fallback block freed from another thread, after `record_stream` on another stream: it
/// waits for its event, then goes back to the fallback pool's cache, never to the default
/// pools'; the device and the pool end at zero allocated.
#[test]
fn a_fallback_block_freed_elsewhere_goes_back_to_its_pool() {
    let (a, _drv) = sim(1, 64 * MIB);
    let a = Arc::new(a);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill_on(&a, fb, S, &[40 * MIB], 0);
    let p = a.malloc(30 * MIB, 0, S).expect("the fallback");
    assert_eq!(allocated(&a, fb), 30 * MIB as i64);
    a.record_stream(p, S + 5).unwrap();
    let a2 = a.clone();
    std::thread::spawn(move || a2.free(p).unwrap()).join().unwrap();
    check(&a);
    // The pool's block serves the next fallback once its event completed.
    let q = a.malloc(40 * MIB, 0, S).expect("the whole segment again, from the fallback pool");
    assert_eq!((allocated(&a, fb), reserved(&a, fb)), (40 * MIB as i64, 40 * MIB as i64));
    let d = a.stats(0).unwrap();
    assert_eq!((d.num_ooms, d.reserved_bytes.all.current), (0, 40 * MIB as i64));
    a.free(q).unwrap();
    assert_eq!(a.stats(0).unwrap().allocated_bytes.all.current, 0);
    check(&a);
}

/// Eight threads on four streams, the device full: every default request is served whole by
/// its stream's unsplit fallback pool (two cached blocks a stream, two threads a stream, one
/// block each at a time), never split, counted in that pool; nothing is out of memory.
#[test]
fn unsplit_fallback_pools_serve_eight_threads_on_four_streams_whole() {
    const STREAMS: usize = 4;
    let (a, _drv) = sim(1, 256 * MIB);
    let a = Arc::new(a);
    // 96 MiB for the default pools on a stream of their own, 4 x 2 x 20 MiB for the pools:
    // the device is full.
    let hog = a.malloc(96 * MIB, 0, S + 100).unwrap();
    let pools: Vec<u64> = (0..STREAMS)
        .map(|i| {
            let p = a.pool_create_ex(POOL_USE_ON_OOM | POOL_NO_SPLIT).unwrap();
            fill_on(&a, p, S + i, &[4 * MIB, 3 * MIB], 0);
            p
        })
        .collect();
    let start = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (a, start) = (a.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let stream = S + t % STREAMS;
                for i in 0..300 {
                    // Large requests: a small one looks at the pool's small blocks (PyTorch).
                    let size = MIB + 1 + (i * 7919 + t * 104_729) % (3 * MIB);
                    let p = a.malloc(size, 0, stream).unwrap_or_else(|e| panic!("{t}/{i}: {size}: {e}"));
                    let info = a.block_info(p).unwrap();
                    assert_eq!((info.size, info.stream), (20 * MIB, stream), "a whole block of the pool");
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for &p in &pools {
        let s = a.pool_stats(0, p).unwrap().stats;
        assert_eq!((s.allocated_bytes.all.current, s.reserved_bytes.all.current), (0, 40 * MIB as i64));
        assert_eq!(s.inactive_split.all.current, 0);
        assert!(s.allocation.all.allocated >= 2 + 600, "pool {p}: {}", s.allocation.all.allocated);
    }
    let snap = a.snapshot().unwrap();
    assert!(snap.segments.iter().filter(|g| g.pool != 0).all(|g| g.blocks.len() == 1));
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    a.free(hog).unwrap();
    check(&a);
}

/// A fallback pool released while eight threads on two streams fall back into it: each request
/// is served or refused with out of memory, nothing deadlocks, and once all is freed the pool
/// holds nothing, is forgotten, and the invariants hold.
#[test]
fn a_fallback_pool_released_while_eight_threads_fall_back_into_it() {
    let (a, _drv) = sim(1, 128 * MIB);
    let a = Arc::new(a);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill_on(&a, fb, S, &[20 * MIB, 20 * MIB], 0);
    fill_on(&a, fb, S + 1, &[20 * MIB], 0);
    let hog = a.malloc(68 * MIB, 0, S + 100).unwrap();
    let start = Arc::new(Barrier::new(9));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (a, start) = (a.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let (mut served, mut refused) = (0, 0);
                for i in 0..400usize {
                    match a.malloc((1 + (i + t) % 6) * MIB, 0, S + t % 2) {
                        Ok(p) => {
                            served += 1;
                            a.free(p).unwrap();
                        }
                        Err(Error::OutOfMemory(_)) => refused += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                (served, refused)
            })
        })
        .collect();
    start.wait();
    std::thread::sleep(std::time::Duration::from_millis(2));
    a.release_pool(0, fb).unwrap();
    let counts: Vec<(i32, i32)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!("served, refused per thread: {counts:?}");
    let s = a.pool_stats(0, fb).unwrap();
    assert!(s.released);
    assert_eq!((s.stats.allocated_bytes.all.current, s.stats.reserved_bytes.all.current), (0, 0));
    assert!(a.all_pool_stats(0).unwrap().iter().all(|p| p.pool != fb), "forgotten once empty");
    assert!(matches!(a.begin_allocate_to_pool_thread(0, fb), Err(Error::InvalidValue(_))));
    a.free(hog).unwrap();
    check(&a);
}

/// Driver faults around the fallback: a default request whose new segment fails with a CUDA
/// error (not out of memory) fails with it and takes nothing from the fallback pool; one whose
/// new segment fails with out of memory falls back. The pool is as it was after the error.
#[test]
fn a_cuda_error_on_the_default_pools_growth_is_no_out_of_memory_to_fall_back_on() {
    let (a, drv) = sim(1, 1 << 30);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill_on(&a, fb, S, &[40 * MIB], 0);
    let before = a.pool_stats(0, fb).unwrap();
    let calls = observed(&a);
    drv.inject_fault(
        SimOp::MemAlloc,
        0,
        DriverError::Cuda { call: "cuMemAlloc", code: 999, name: "CUDA_ERROR_UNKNOWN".into() },
    );
    let r = a.malloc(30 * MIB, 0, S);
    assert!(matches!(&r, Err(Error::Cuda(m)) if m.contains("cuMemAlloc")), "{r:?}");
    drv.clear_faults();
    assert_eq!(a.pool_stats(0, fb).unwrap(), before, "nothing taken from the fallback pool");
    assert_eq!((a.stats(0).unwrap().num_ooms, calls.load(Ordering::SeqCst)), (0, 0));
    check(&a);
    // Twice: the default pools try their stream's current shard again before the fallback.
    drv.inject_fault(SimOp::MemAlloc, 0, DriverError::OutOfMemory);
    drv.inject_fault(SimOp::MemAlloc, 0, DriverError::OutOfMemory);
    let p = a.malloc(30 * MIB, 0, S).expect("an out-of-memory growth falls back");
    drv.clear_faults();
    assert_eq!(allocated(&a, fb), 30 * MIB as i64);
    assert_eq!((a.stats(0).unwrap().num_ooms, calls.load(Ordering::SeqCst)), (0, 0));
    a.free(p).unwrap();
    check(&a);
}

/// With history on, a request served by the fallback records one `alloc` on its stream and no
/// `oom`, no segment event of its own; the trace replays to the snapshot's state.
#[test]
fn the_history_sees_a_fallback_as_an_allocation_of_the_pools_segment() {
    let (a, _drv) = sim(1, 64 * MIB);
    record_all(&a, HistoryContext::Alloc);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill_on(&a, fb, S, &[40 * MIB], 0);
    let mark = a.snapshot().unwrap().device_traces[0].len();
    let p = a.malloc(30 * MIB, 0, S).unwrap();
    a.free(p).unwrap();
    let snap = snapshot_agrees(&a, true);
    let new = &snap.device_traces[0][mark..];
    let actions: Vec<Action> = new.iter().map(|e| e.action).collect();
    assert_eq!(actions, [Action::Alloc, Action::FreeRequested, Action::FreeCompleted, Action::Snapshot]);
    assert!(new[..3].iter().all(|e| e.stream == S && e.addr == p), "{new:?}");
    check(&a);
}

/// Expandable default pools (gpupool's default configuration) limited by a budget: a request
/// the budget refuses falls back; one too large for the fallback fails with the budget's
/// message, counted once, and leaves the fallback pool exactly as it was (the budget's path
/// releases the default pools' cache only). The budgets' counts stay exact throughout.
#[test]
fn a_budget_refusal_of_expandable_default_pools_falls_back_and_touches_no_other_pool() {
    let (a, _drv) = common::sim_with(1, 256 * MIB, gpupool::config::Config::default());
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    let held = fill_on(&a, fb, S, &[8 * MIB, 40 * MIB], 1);
    let small = a.malloc(4 * MIB, 0, S + 1).unwrap();
    a.pool_set_limit(0, 0, Some(16 * MIB as u64)).unwrap();
    let calls = observed(&a);
    let p = a.malloc(30 * MIB, 0, S).expect("the default pools' budget refused, the fallback served");
    assert_eq!((allocated(&a, fb), a.stats(0).unwrap().num_ooms), (38 * MIB as i64, 0));
    check(&a);
    a.free(p).unwrap();
    let before = a.pool_stats(0, fb).unwrap();
    let r = a.malloc(100 * MIB, 0, S);
    assert!(matches!(&r, Err(Error::OutOfMemory(m)) if m.contains("the default pools (pool 0)")), "{r:?}");
    assert_eq!((a.stats(0).unwrap().num_ooms, calls.load(Ordering::SeqCst)), (1, 1));
    assert_eq!(a.pool_stats(0, fb).unwrap(), before, "the fallback pool untouched by the budget's path");
    check(&a);
    for q in held.into_iter().chain([small]) {
        a.free(q).unwrap();
    }
    check(&a);
}

/// A fallback pool released on device 0 serves no fallback there, but still does on device 1,
/// where it was not released.
#[test]
fn a_fallback_pool_released_on_one_device_still_serves_on_another() {
    let (a, _drv) = sim(2, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    for dev in [0, 1] {
        a.begin_allocate_to_pool_thread(dev, fb).unwrap();
        let p = a.malloc(40 * MIB, dev, S).unwrap();
        a.end_allocate_to_pool(dev, fb).unwrap();
        a.free(p).unwrap();
    }
    // A held block keeps device 0's segment after the release.
    a.begin_allocate_to_pool_thread(0, fb).unwrap();
    let keep = a.malloc(4 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, fb).unwrap();
    a.release_pool(0, fb).unwrap();
    assert!(matches!(a.malloc(30 * MIB, 0, S), Err(Error::OutOfMemory(_))), "released on device 0");
    let q = a.malloc(30 * MIB, 1, S).expect("device 1's fallback");
    assert_eq!(a.pool_stats(1, fb).unwrap().stats.allocated_bytes.all.current, 30 * MIB as i64);
    assert_eq!(a.stats(1).unwrap().num_ooms, 0);
    for p in [q, keep] {
        a.free(p).unwrap();
    }
    check(&a);
}

/// A request served by the fallback counts once: what the device's statistics gained is what
/// the fallback pool's gained (allocation, active, allocated, requested bytes), no device
/// allocation or retry is counted for the failed growth, and the free takes back exactly that.
#[test]
fn a_fallback_counts_once_in_the_device_and_in_its_pool() {
    let (a, _drv) = sim(1, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill_on(&a, fb, S, &[40 * MIB], 0);
    let other = a.malloc(20 * MIB, 0, S + 1).unwrap();
    let key = |s: &gpupool::stats::DeviceStats| {
        [
            s.allocation.all.current,
            s.allocation.all.allocated,
            s.active.all.current,
            s.allocated_bytes.all.current,
            s.requested_bytes.all.current,
            s.active_bytes.large_pool.current,
            s.segment.all.current,
        ]
    };
    let (d0, p0) = (a.stats(0).unwrap(), a.pool_stats(0, fb).unwrap().stats);
    let p = a.malloc(30 * MIB - 123, 0, S).unwrap();
    let (d1, p1) = (a.stats(0).unwrap(), a.pool_stats(0, fb).unwrap().stats);
    let delta = |x: [i64; 7], y: [i64; 7]| -> Vec<i64> { x.iter().zip(y).map(|(a, b)| b - a).collect() };
    assert_eq!(delta(key(&d0), key(&d1)), delta(key(&p0), key(&p1)), "the device gained what the pool gained");
    assert_eq!(delta(key(&p0), key(&p1)), [1, 1, 1, 30 * MIB as i64, 30 * MIB as i64 - 123, 30 * MIB as i64, 0]);
    assert_eq!(
        (d1.num_device_alloc, d1.num_alloc_retries, d1.num_ooms),
        (d0.num_device_alloc, d0.num_alloc_retries, d0.num_ooms),
        "a failed growth is no device allocation, and the fallback no retry"
    );
    a.free(p).unwrap();
    let (d2, p2) = (a.stats(0).unwrap(), a.pool_stats(0, fb).unwrap().stats);
    assert_eq!(key(&d2)[2..], key(&d0)[2..]);
    assert_eq!(key(&p2)[2..], key(&p0)[2..]);
    a.free(other).unwrap();
    check(&a);
}

/// `empty_cache` and refills of a fallback pool racing four threads that fall back into it on
/// two streams (shards retired under them): every request is served or refused with out of
/// memory, and once all is freed nothing is allocated and the invariants hold.
#[test]
fn empty_cache_and_refills_race_the_fallback() {
    let (a, _drv) = sim(1, 128 * MIB);
    let a = Arc::new(a);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    let hog = a.malloc(64 * MIB, 0, S + 100).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                a.begin_allocate_to_pool_thread(0, fb).unwrap();
                let got = a.malloc(20 * MIB, 0, S + i % 2);
                a.end_allocate_to_pool(0, fb).unwrap();
                if let Ok(p) = got {
                    a.free(p).unwrap();
                }
                if i % 3 == 0 {
                    let _ = a.empty_cache(0);
                }
                i += 1;
            }
        })
    };
    let threads: Vec<_> = (0..4usize)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..500usize {
                    match a.malloc((2 + (i + t) % 12) * MIB, 0, S + t % 2) {
                        Ok(p) => a.free(p).unwrap(),
                        Err(Error::OutOfMemory(_)) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    assert_eq!(allocated(&a, fb), 0);
    a.free(hog).unwrap();
    assert_eq!(a.stats(0).unwrap().allocated_bytes.all.current, 0);
    check(&a);
}
