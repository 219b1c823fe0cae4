//! `SleepMode::OffloadPinned` attacked (the red team of issue 23): a fault or a panic at every
//! driver call of a sleep and of a wake, at every skip count, leaks no host copy and leaves
//! the pool awake (sleep) or asleep (wake) with its contents intact; a pool whose streams
//! change between sleeps keeps pinned bytes bounded by twice its live bytes; sleeps, wakes,
//! `sleep_release_kept`, `release_pool` and other modes racing from several threads leave
//! every account right and nothing leaked.
use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::sleep::{asleep, fail, fill, holds, host};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SIM_PANIC_MARK, SimFault, SimOp};
use gpupool::{Allocator, SleepMode};

fn config() -> Config {
    Config { sleep_threads: 3, ..Config::default() }
}

/// One block of `n` bytes from `pool` on `stream`, filled with `seed`'s pattern.
fn block(a: &Allocator, pool: u64, stream: usize, n: usize, seed: u32) -> (u64, usize, u32) {
    a.begin_allocate_to_pool(0, pool, stream).unwrap();
    let p = a.malloc(n, 0, stream).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    fill(p, n, seed);
    (p, n, seed)
}

/// Whether every block holds the pattern it was filled with.
fn intact(live: &[(u64, usize, u32)]) -> bool {
    live.iter().all(|&(p, n, s)| holds(p, n, s))
}

/// Keeps the injected panics out of the test's output.
fn quiet_panics() {
    let old = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info.payload().downcast_ref::<String>().map(String::as_str).unwrap_or("");
        if !msg.contains(SIM_PANIC_MARK) {
            old(info);
        }
    }));
}

/// The live bytes of `pool` (the blocks' rounded sizes).
fn live_bytes(a: &Allocator, pool: u64) -> usize {
    a.pool_stats(0, pool).unwrap().stats.allocated_bytes.all.current as usize
}

#[test]
fn kept_bytes_stay_within_twice_the_live_bytes_as_streams_change() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let pool = a.pool_create_sleepable();
    // Each round a new stream holds the big block and the earlier ones keep a small one: a
    // copy kept for a big stream must not go to a small one while the big one pins anew.
    let mut big = block(&a, pool, 0x100, 16 * MIB, 0);
    let mut small = Vec::new();
    for round in 1..6u32 {
        a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
        a.wake(0, pool).unwrap();
        check(&a);
        let (live, kept) = (live_bytes(&a, pool), a.sleep_kept_bytes(0, Some(pool)).unwrap());
        assert!(kept <= 2 * live, "round {round}: {kept} bytes kept for {live} live");
        assert!(intact(&small) && intact(&[big]));
        // The big block's stream keeps a small one; a new stream gets the big one.
        let stream = 0x100 * round as usize;
        small.push(block(&a, pool, stream, MIB, round));
        a.free(big.0).unwrap();
        big = block(&a, pool, stream + 0x100, 16 * MIB, 100 + round);
    }
    a.sleep_release_kept(0, pool).unwrap();
    assert_eq!(host(&drv), (0, 0));
}

/// The driver calls a pinned sleep or wake makes, each faulted at every skip count.
const OPS: [SimOp; 14] = [
    SimOp::HostMap,
    SimOp::HostRegister,
    SimOp::HostUnregister,
    SimOp::HostUnmap,
    SimOp::MemcpyDtoH,
    SimOp::MemcpyHtoD,
    SimOp::StreamCreate,
    SimOp::StreamSynchronize,
    SimOp::StreamDestroy,
    SimOp::MemMap,
    SimOp::MemCreate,
    SimOp::MemUnmap,
    SimOp::MemRelease,
    SimOp::EventSynchronize,
];

/// Two streams of a sleepable pool, one with a run of blocks longer than a direct copy's
/// piece (64 MiB) cut short to keep the sweep quick: small blocks, and a block freed.
fn small_pool(a: &Allocator) -> (u64, Vec<(u64, usize, u32)>) {
    let pool = a.pool_create_sleepable();
    let mut live = Vec::new();
    for (i, &n) in [3 * MIB, 512, 5 * MIB + 5, 4096, 700 * 1024].iter().enumerate() {
        live.push(block(a, pool, if i % 2 == 0 { 0x10 } else { 0x20 }, n, i as u32));
    }
    let gone = block(a, pool, 0x10, 2 * MIB, 99);
    a.free(gone.0).unwrap();
    (pool, live)
}

#[test]
fn a_fault_at_every_call_of_a_pinned_sleep_leaks_nothing() {
    quiet_panics();
    for kept in [false, true] {
        for op in OPS {
            for fault in [fail(), SimFault::Panic] {
                for skip in 0..64 {
                    let (a, drv) = sim_with(1, 1 << 30, config());
                    let (pool, live) = small_pool(&a);
                    if kept {
                        a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                        a.wake(0, pool).unwrap();
                    }
                    let used = drv.used(0);
                    drv.inject(op, skip, fault.clone());
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        a.sleep(0, pool, SleepMode::OffloadPinned)
                    }));
                    let fired = drv.pending_faults() == 0;
                    drv.clear_faults();
                    let what = format!("kept {kept} {op:?} skip {skip} {fault:?}: {r:?}");
                    check(&a);
                    let now = drv.used(0);
                    // Once every copy is done the pool sleeps whatever fails.
                    if asleep(&a, pool) {
                        assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), 0, "{what}");
                        a.wake(0, pool).unwrap();
                    } else {
                        assert!(!matches!(r, Ok(Ok(()))), "{what}");
                        assert_eq!(now, used, "{what}: awake, every page mapped");
                    }
                    check(&a);
                    assert!(intact(&live), "{what}");
                    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                    a.wake(0, pool).unwrap();
                    assert!(intact(&live), "{what}");
                    a.sleep_release_kept(0, pool).unwrap();
                    assert_eq!(host(&drv), (0, 0), "{what}: a host copy leaked");
                    check(&a);
                    if !fired {
                        break;
                    }
                }
            }
        }
    }
}

#[test]
fn a_fault_at_every_call_of_a_pinned_wake_leaves_it_asleep_with_its_copy() {
    quiet_panics();
    for op in OPS {
        for fault in [fail(), SimFault::Fail(DriverError::OutOfMemory), SimFault::Panic] {
            for skip in 0..64 {
                let (a, drv) = sim_with(1, 1 << 30, config());
                let (pool, live) = small_pool(&a);
                a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                let copy = host(&drv);
                drv.inject(op, skip, fault.clone());
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.wake(0, pool)));
                let fired = drv.pending_faults() == 0;
                drv.clear_faults();
                let what = format!("{op:?} skip {skip} {fault:?}: {r:?}");
                check(&a);
                if matches!(r, Ok(Ok(()))) {
                    assert!(!asleep(&a, pool), "{what}");
                } else {
                    assert!(asleep(&a, pool), "{what}");
                    assert_eq!(host(&drv), copy, "{what}: the host copy intact");
                    assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), 0, "{what}");
                    a.wake(0, pool).unwrap();
                }
                check(&a);
                assert!(intact(&live), "{what}");
                a.sleep_release_kept(0, pool).unwrap();
                assert_eq!(host(&drv), (0, 0), "{what}: a host copy leaked");
                if !fired {
                    break;
                }
            }
        }
    }
}

#[test]
fn two_pools_sleep_pinned_and_offload_from_threads_beside_releases_and_reads() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (p1, l1) = small_pool(&a);
    let (p2, l2) = small_pool(&a);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (a, stop) = (&a, &stop);
        let checker = s.spawn(move || {
            // The invariant checker is not run here: it reads a sleep under way as broken.
            while !stop.load(Ordering::Relaxed) {
                for pool in [p1, p2] {
                    a.sleep_release_kept(0, pool).unwrap();
                    a.sleep_kept_bytes(0, None).unwrap();
                    std::thread::yield_now();
                }
            }
        });
        let sleepers: Vec<_> = [(p1, &l1, SleepMode::OffloadPinned), (p2, &l2, SleepMode::Offload)]
            .into_iter()
            .map(|(pool, live, other)| {
                s.spawn(move || {
                    for i in 0..40 {
                        let mode = if i % 3 == 2 { other } else { SleepMode::OffloadPinned };
                        a.sleep(0, pool, mode).unwrap();
                        a.wake(0, pool).unwrap();
                        assert!(intact(live));
                    }
                })
            })
            .collect();
        let r: Vec<_> = sleepers.into_iter().map(|h| h.join()).collect();
        stop.store(true, Ordering::Relaxed);
        checker.join().unwrap();
        for x in r {
            x.unwrap();
        }
    });
    check(&a);
    a.sleep_release_kept(0, p1).unwrap();
    a.sleep_release_kept(0, p2).unwrap();
    assert_eq!(host(&drv), (0, 0));
}

#[test]
fn a_release_pool_racing_a_pinned_wake_leaves_no_copy_pinned() {
    for round in 0..20 {
        let (a, drv) = sim_with(1, 1 << 30, config());
        let (pool, live) = small_pool(&a);
        a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
        std::thread::scope(|s| {
            let a = &a;
            // Refused while the pool sleeps; goes through the moment the wake marks it awake.
            s.spawn(move || while a.release_pool(0, pool).is_err() {});
            a.wake(0, pool).unwrap();
        });
        assert!(intact(&live), "round {round}");
        assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), 0, "round {round}: a released pool keeps nothing");
        assert_eq!(host(&drv), (0, 0), "round {round}: a copy stayed pinned for a released pool");
        check(&a);
        for &(p, _, _) in &live {
            a.free(p).unwrap();
        }
        check(&a);
    }
}

#[test]
fn a_sleep_in_another_mode_racing_a_pinned_wake_keeps_no_copy() {
    for round in 0..20 {
        let (a, drv) = sim_with(1, 1 << 30, config());
        let (pool, live) = small_pool(&a);
        a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
        std::thread::scope(|s| {
            let a = &a;
            // Refused while the pool sleeps or wakes; goes through once it is awake.
            s.spawn(move || while a.sleep(0, pool, SleepMode::Discard).is_err() {});
            a.wake(0, pool).unwrap();
        });
        // Asleep in discard mode: the pinned copy went back with that sleep.
        assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), 0, "round {round}");
        assert_eq!(host(&drv), (0, 0), "round {round}");
        check(&a);
        a.wake(0, pool).unwrap();
        drop(live);
    }
}

#[test]
fn a_pool_released_while_its_sleep_begins_keeps_no_copy_after_its_wake() {
    // `release_pool` checks that the pool is awake, then marks it released; a sleep that
    // checked it was not released in between goes on. Its copy must not stay pinned.
    for round in 0..50 {
        let (a, drv) = sim_with(1, 1 << 30, config());
        let (pool, live) = small_pool(&a);
        let slept = std::thread::scope(|s| {
            let a = &a;
            let t = s.spawn(move || a.sleep(0, pool, SleepMode::OffloadPinned).is_ok());
            let _ = a.release_pool(0, pool);
            t.join().unwrap()
        });
        if slept {
            let _ = a.wake(0, pool);
        }
        drop(live);
        // Released by now, or here.
        let _ = a.release_pool(0, pool);
        assert_eq!(host(&drv), (0, 0), "round {round}: slept {slept}");
        check(&a);
    }
}
