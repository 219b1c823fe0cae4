//! Sleep and wake under faults and load, on the simulated device: a fault at each driver call
//! a sleep makes before its memory goes leaves the pool awake and as it was; one while the
//! pages go leaves it asleep and wakeable; a fault at each call of a wake leaves the pool
//! asleep with its host copy; a wake without memory (device or memory fraction) releases the
//! other pools' cache, and otherwise fails all or nothing; threads allocate on other pools
//! throughout.
use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::sleep::{asleep, fail};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};
use gpupool::{Allocator, Error, SleepMode};

const S: usize = 0x10;

/// Pages of 20 MiB in sleepable pools (`GPUPOOL_SLEEP_PAGE`): the blocks below are sized so
/// that a pool spans several pages, and each fault lands on a page that is not the first.
fn config() -> Config {
    Config { expandable_segments: true, sleep_page: 20 * MIB, ..Config::default() }
}

/// `config` with a staging chunk of `chunk` bytes: the fault tests' pools are a quarter or a
/// half of what they were (the simulated device's page faults were most of this binary's CPU
/// time), the chunk cut with them so that each sleep and wake makes as many copies.
fn config_chunk(chunk: usize) -> Config {
    Config { sleep_chunk: chunk, ..config() }
}

/// A sleepable pool with `sizes` allocated on stream `S`, each filled with its own byte.
fn pool_with(a: &Allocator, sizes: &[usize]) -> (u64, Vec<(u64, usize)>) {
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let live = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = a.malloc(n, 0, S).unwrap();
            // SAFETY: a live block of `n` bytes, mapped by the simulated driver.
            unsafe { (p as *mut u8).write_bytes(i as u8 + 1, n) };
            (p, n)
        })
        .collect();
    a.end_allocate_to_pool(0, pool).unwrap();
    (pool, live)
}

/// Whether every block holds its byte.
fn intact(live: &[(u64, usize)]) -> bool {
    live.iter().enumerate().all(|(i, &(p, n))| {
        // A page at a time (`memcmp`): a byte-by-byte `all` does not vectorise.
        let want = [i as u8 + 1; 4096];
        // SAFETY: as in `pool_with`; the pool is awake.
        unsafe { std::slice::from_raw_parts(p as *const u8, n) }.chunks(4096).all(|c| c == &want[..c.len()])
    })
}

#[test]
fn a_fault_before_the_memory_goes_leaves_the_pool_awake_and_as_it_was() {
    let ops = [
        SimOp::EventCreate,
        SimOp::EventRecord,
        SimOp::EventSynchronize,
        SimOp::StreamCreate,
        SimOp::HostAlloc,
        SimOp::HostMap,
        SimOp::MemcpyDtoH,
    ];
    for op in ops {
        for fault in [fail(), SimFault::Fail(DriverError::OutOfMemory), SimFault::Panic] {
            // 24 MiB in 7 MiB chunks: four copies, the last one partial, and two 20 MiB pages,
            // as 103 MiB in the default 32 MiB chunks were.
            let (a, drv) = sim_with(1, 1 << 30, config_chunk(7 * MIB));
            let (pool, live) = pool_with(&a, &[3 * MIB, 21 * MIB]);
            let used = drv.used(0);
            drv.inject(op, 0, fault.clone());
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.sleep(0, pool, SleepMode::Offload)));
            assert!(matches!(r, Ok(Err(_)) | Err(_)), "{op:?} {fault:?}: {r:?}");
            if let (Ok(Err(Error::OutOfMemory(m))), SimOp::HostAlloc) = (&r, op) {
                assert!(m.contains("cannot pin"), "{m}");
            }
            drv.clear_faults();
            assert_eq!((drv.used(0), drv.live_pageable()), (used, (0, 0)), "{op:?} {fault:?}: nothing changed");
            assert!(!asleep(&a, pool), "{op:?} {fault:?}: still awake");
            assert!(intact(&live), "{op:?}");
            check(&a);
            a.sleep(0, pool, SleepMode::Offload).unwrap();
            a.wake(0, pool).unwrap();
            assert!(intact(&live), "{op:?}");
            check(&a);
        }
    }
}

#[test]
fn a_fault_while_the_pages_go_leaves_the_pool_asleep_and_wakeable() {
    for op in [SimOp::MemUnmap, SimOp::MemRelease] {
        let (a, drv) = sim_with(1, 1 << 30, config());
        // Pages of 20 MiB in a sleepable pool: 45 MiB spans several, so that some go.
        let (pool, live) = pool_with(&a, &[3 * MIB, 45 * MIB]);
        drv.inject(op, 1, fail());
        match a.sleep(0, pool, SleepMode::Offload) {
            Err(Error::Cuda(m)) => assert!(m.contains("sleeps all the same"), "{m}"),
            r => panic!("{op:?}: {r:?}"),
        }
        assert!(asleep(&a, pool), "{op:?}");
        check(&a);
        assert!(drv.used(0) > 0, "{op:?}: the driver kept a page");
        a.wake(0, pool).unwrap();
        assert!(intact(&live), "{op:?}");
        check(&a);
        for (p, _) in live {
            a.free(p).unwrap();
        }
        a.release_pool(0, pool).unwrap();
        a.empty_cache(0).unwrap();
        assert_eq!((drv.used(0), drv.live_vmm()), (0, (0, 0)), "{op:?}: everything back in the end");
    }
}

#[test]
fn a_fault_at_any_call_of_a_wake_leaves_the_pool_asleep_with_its_host_copy() {
    let ops = [
        (SimOp::MemCreate, 2),
        (SimOp::MemMap, 1),
        (SimOp::MemSetAccess, 0),
        (SimOp::StreamCreate, 1),
        (SimOp::MemcpyHtoD, 1),
        (SimOp::EventRecord, 0),
        (SimOp::EventSynchronize, 0),
    ];
    for (op, skip) in ops {
        for fault in [fail(), SimFault::Fail(DriverError::OutOfMemory)] {
            // 42 MiB: three 20 MiB pages (a fault at the third `cuMemCreate`), three copies of
            // 16 MiB chunks, the last one partial (as 82 MiB in the default 32 MiB chunks).
            let (a, drv) = sim_with(1, 1 << 30, config_chunk(16 * MIB));
            let (pool, live) = pool_with(&a, &[3 * MIB, 9 * MIB, 30 * MIB]);
            a.sleep(0, pool, SleepMode::Offload).unwrap();
            // Out of memory is tried twice (the cache released in between); a failed copy's
            // streams are waited for once more as they go: enough faults for every attempt.
            for _ in 0..8 {
                drv.inject(op, skip, fault.clone());
            }
            assert!(a.wake(0, pool).is_err(), "{op:?} {fault:?}");
            drv.clear_faults();
            assert!(asleep(&a, pool), "{op:?} {fault:?}");
            assert_eq!((drv.used(0), drv.live_pageable().0), (0, 1), "{op:?} {fault:?}: pages back, copy intact");
            check(&a);
            a.wake(0, pool).unwrap();
            assert!(intact(&live), "{op:?} {fault:?}");
            check(&a);
        }
    }
}

#[test]
fn a_wake_without_memory_releases_the_other_pools_cache_then_fails_all_or_nothing() {
    let cap = 128 * MIB;
    let (a, drv) = sim_with(1, cap, config());
    let (pool, live) = pool_with(&a, &[40 * MIB]);
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    // The default pools take the room: their cache is given back for the wake.
    let big = a.malloc(100 * MIB, 0, 0x40).unwrap();
    a.free(big).unwrap();
    assert!(drv.used(0) >= 100 * MIB);
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    check(&a);
    // Live blocks take the room: the wake fails, all or nothing, and succeeds once they go.
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    let held = a.malloc(100 * MIB, 0, 0x40).unwrap();
    match a.wake(0, pool) {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("still sleeps") && m.contains("host copy intact"), "{m}"),
        r => panic!("{r:?}"),
    }
    assert!(asleep(&a, pool));
    assert_eq!(drv.live_pageable().0, 1);
    check(&a);
    a.free(held).unwrap();
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    // A memory fraction below what the pool needs refuses the wake before any driver call.
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    a.set_memory_fraction(16.0 / 128.0, 0).unwrap();
    let creates = drv.counts().mem_create;
    assert!(matches!(a.wake(0, pool), Err(Error::OutOfMemory(_))));
    assert_eq!(drv.counts().mem_create, creates);
    a.set_memory_fraction(1.0, 0).unwrap();
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    check(&a);
}

#[test]
fn other_pools_allocate_and_free_while_a_pool_sleeps_and_wakes() {
    let (a, drv) = sim_with(1, 4 << 30, config());
    let a = Arc::new(a);
    // Two 20 MiB pages, as 38 MiB were; the workers spin for as long as the rounds take.
    let (pool, live) = pool_with(&a, &[5 * MIB, 17 * MIB]);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                let stream = 0x100 + t;
                while !stop.load(Ordering::Relaxed) {
                    let size = (n as usize % 7 + 1) * 300 * 1024;
                    let p = a.malloc(size, 0, stream).unwrap();
                    // SAFETY: a live block of `size` bytes.
                    unsafe { (p as *mut u8).write_bytes(7, size) };
                    a.free(p).unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    for round in 0..30 {
        let mode = if round % 3 == 0 { SleepMode::Discard } else { SleepMode::Offload };
        a.sleep(0, pool, mode).unwrap();
        a.wake(0, pool).unwrap();
        if mode == SleepMode::Offload {
            assert!(intact(&live), "round {round}");
        } else {
            for (i, &(p, n)) in live.iter().enumerate() {
                // SAFETY: the pool is awake; refill what discard dropped.
                unsafe { (p as *mut u8).write_bytes(i as u8 + 1, n) };
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let done: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(done > 0);
    check(&a);
    let _ = drv;
}

#[test]
fn a_sleeping_pool_survives_the_out_of_memory_path_of_another() {
    let cap = 64 * MIB;
    let (a, drv): (Allocator, Arc<SimDriver>) = sim_with(1, cap, config());
    let (pool, live) = pool_with(&a, &[20 * MIB]);
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    assert!(matches!(a.malloc(80 * MIB, 0, S), Err(Error::OutOfMemory(_))));
    assert_eq!(drv.live_pageable().0, 1, "the out-of-memory path left the host copy alone");
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    check(&a);
}

#[test]
fn sleeps_and_wakes_of_one_pool_from_two_threads_never_interleave() {
    let (a, drv) = sim_with(1, 4 << 30, config());
    let a = Arc::new(a);
    // Two 20 MiB pages and a chunk of the default 32 MiB: each sleep long enough for the other
    // thread to try meanwhile.
    let (pool, live) = pool_with(&a, &[21 * MIB, 3 * MIB]);
    let racers: Vec<_> = (0..2)
        .map(|_| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut done = 0;
                for i in 0..100 {
                    let r = if i % 2 == 0 { a.sleep(0, pool, SleepMode::Offload) } else { a.wake(0, pool) };
                    match r {
                        Ok(()) => done += 1,
                        Err(Error::InvalidValue(_)) => {}
                        Err(e) => panic!("{e:?}"),
                    }
                }
                done
            })
        })
        .collect();
    let done: i32 = racers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(done > 0);
    let _ = a.wake(0, pool);
    assert!(intact(&live));
    assert_eq!(drv.live_pageable(), (0, 0));
    check(&a);
}

/// Found by `tests/invariants/sequences.rs` (proptest; its shrunk case, step for step): a wake that
/// failed gave its spare handles back before it counted the pages asleep again, so a release
/// that unwound left the sleeping bytes statistic behind the pages (6 MiB slept, 4 MiB counted).
#[test]
fn a_failed_wake_whose_handles_unwind_as_they_go_back_counts_the_pages_asleep() {
    let config = Config { expandable_segments: true, expandable_large_pages: true, ..Config::default() };
    let (a, drv) = sim_with(1, 160 * MIB, config);
    a.set_memory_fraction(0.75, 0).unwrap();
    a.malloc(1, 0, 0x2000).unwrap();
    a.malloc(1, 0, 0x1000).unwrap();
    drv.inject(SimOp::EventSynchronize, 3, fail());
    drv.inject(SimOp::MemcpyHtoD, 0, fail());
    a.malloc(1, 0, 0).unwrap();
    a.sleep(0, 0, SleepMode::Discard).unwrap();
    a.wake(0, 0).unwrap();
    // The event fault ends the next sleep before the pages go; the unmap fault waits for the
    // one after, which leaves a page mapped; the copy fault fails the wake after that, whose
    // spare handles then go back, the third release unwinding.
    drv.inject(SimOp::MemUnmap, 0, fail());
    assert!(matches!(a.sleep(0, 0, SleepMode::Offload), Err(Error::Cuda(_))));
    check(&a);
    drv.inject(SimOp::MemRelease, 2, SimFault::Panic);
    a.malloc(1, 0, 0).unwrap();
    assert!(matches!(a.sleep(0, 0, SleepMode::Offload), Err(Error::Cuda(m)) if m.contains("sleeps all the same")));
    check(&a);
    let woke = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.wake(0, 0)));
    assert!(woke.is_err(), "the injected panic went through");
    check(&a);
    drv.clear_faults();
    a.wake(0, 0).unwrap();
    check(&a);
}
