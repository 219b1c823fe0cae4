//! Sleep with `SleepMode::OffloadPinned` (`caching::sleep::pinned_copies`,
//! `caching::sleep::copy_direct`) on the simulated device, whose copies check that their host
//! side is pinned: the copies go straight between the device and a registered host copy (no
//! staging ring, no copy from unpinned memory), bit for bit; the copy is kept at wake and used
//! again by the next sleep with no new mapping or registration; it is given back by
//! `sleep_release_kept`, `release_pool`, and a sleep in another mode, and grows with the pool;
//! a fault at any call leaves the pool awake (sleep) or asleep with its copy (wake), leaking
//! nothing.
use crate::common;

use common::sleep::{S, fail, fill, holds, host, intact, pool_with};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};
use gpupool::{Error, SleepMode};

/// Pages of 20 MiB in sleepable pools (`GPUPOOL_SLEEP_PAGE`): the faults below land on the
/// fourth map of a wake, which `sizes` spans.
fn config() -> Config {
    Config { sleep_threads: 3, sleep_page: 20 * MIB, ..Config::default() }
}

/// Block sizes of both pools, a run of blocks beside each other, one larger than a piece.
fn sizes() -> Vec<usize> {
    vec![3 * MIB, 512, 70 * MIB + 5, 4096, 700 * 1024, 2 * MIB]
}

#[test]
fn the_copy_goes_direct_is_kept_at_wake_and_used_again() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (pool, live) = pool_with(&a, &sizes());
    let used = drv.used(0);
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    check(&a);
    assert_eq!(drv.used(0), 0, "every page given back");
    assert_eq!(host(&drv), (2, 2), "one registered copy per stream");
    assert_eq!(drv.live_host().0, 0, "no staging ring");
    assert_eq!(a.sleep_staging_bytes(0).unwrap(), 0);
    assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), 0, "in use while asleep");
    a.wake(0, pool).unwrap();
    check(&a);
    assert_eq!(drv.used(0), used);
    assert!(intact(&live));
    // The blocks' bytes, rounded as allocated: one copy holds each stream's.
    let bytes = a.stats(0).unwrap().allocated_bytes.all.current as usize;
    assert!(bytes >= live.iter().map(|l| l.1).sum::<usize>());
    assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), bytes, "kept for the next sleep");
    assert_eq!(a.sleep_kept_bytes(0, None).unwrap(), bytes);
    assert_eq!(host(&drv), (2, 2));
    let counts = drv.counts();
    for round in 0..3 {
        fill(live[0].0, live[0].1, 0);
        a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
        check(&a);
        a.wake(0, pool).unwrap();
        assert!(intact(&live), "round {round}");
    }
    let now = drv.counts();
    assert_eq!((now.host_register, now.host_map), (counts.host_register, counts.host_map), "nothing pinned again");
    assert_eq!(now.unpinned_copies, 0, "every copy from or to pinned memory");
    assert_eq!(a.sleep_release_kept(0, pool).unwrap(), bytes);
    assert_eq!(host(&drv), (0, 0), "host memory back where it was");
    assert_eq!(a.sleep_kept_bytes(0, None).unwrap(), 0);
    assert_eq!(a.sleep_release_kept(0, pool).unwrap(), 0, "a second release gives nothing");
    check(&a);
}

#[test]
fn another_mode_release_pool_and_a_grown_pool_give_the_kept_copy_back() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (pool, live) = pool_with(&a, &sizes());
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    a.wake(0, pool).unwrap();
    assert_eq!(host(&drv), (2, 2));
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    assert_eq!(drv.live_host().1, 0, "a sleep in another mode keeps no pinned copy");
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    a.wake(0, pool).unwrap();
    // One stream grows beyond its kept copy: it gets a new one, the old one goes.
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let more = a.malloc(9 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    assert_eq!(host(&drv), (2, 2), "one copy per stream still");
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    let bytes: usize = live.iter().map(|l| l.1).sum::<usize>() + 9 * MIB;
    assert!(a.sleep_kept_bytes(0, Some(pool)).unwrap() >= bytes, "the kept copies hold the grown pool");
    a.sleep(0, pool, SleepMode::Discard).unwrap();
    assert_eq!(drv.live_host().1, 0, "discard keeps no pinned copy");
    a.wake(0, pool).unwrap();
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    a.wake(0, pool).unwrap();
    assert_eq!(host(&drv).0, 2);
    a.free(more).unwrap();
    for &(p, _) in &live {
        a.free(p).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    assert_eq!(host(&drv), (0, 0), "release_pool gives the kept copy back");
    check(&a);
}

#[test]
fn the_default_pools_and_blocks_freed_while_asleep() {
    let (a, drv) = sim_with(1, 1 << 30, Config { expandable_segments: true, ..config() });
    let x = a.malloc(5 * MIB, 0, S).unwrap();
    let y = a.malloc(3000, 0, S).unwrap();
    fill(x, 5 * MIB, 1);
    fill(y, 3000, 2);
    a.sleep(0, 0, SleepMode::OffloadPinned).unwrap();
    a.free(y).unwrap();
    check(&a);
    a.wake(0, 0).unwrap();
    assert!(holds(x, 5 * MIB, 1));
    check(&a);
    a.sleep(0, 0, SleepMode::OffloadPinned).unwrap();
    a.wake(0, 0).unwrap();
    assert!(holds(x, 5 * MIB, 1));
    assert_eq!(drv.counts().unpinned_copies, 0);
    a.empty_cache(0).unwrap();
    assert!(a.sleep_kept_bytes(0, Some(0)).unwrap() >= 5 * MIB, "empty_cache keeps the copy");
    check(&a);
}

#[test]
fn a_fault_in_a_pinned_sleep_leaves_the_pool_awake_and_leaks_nothing() {
    let ops = [
        (SimOp::HostMap, 1),
        (SimOp::HostRegister, 0),
        (SimOp::HostRegister, 1),
        (SimOp::MemcpyDtoH, 2),
        (SimOp::StreamCreate, 1),
        (SimOp::StreamSynchronize, 0),
    ];
    for kept in [false, true] {
        for (op, skip) in ops {
            for fault in [fail(), SimFault::Fail(DriverError::OutOfMemory), SimFault::Panic] {
                let (a, drv) = sim_with(1, 1 << 30, config());
                let (pool, live) = pool_with(&a, &sizes());
                if kept {
                    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                    a.wake(0, pool).unwrap();
                }
                let (used, before) = (drv.used(0), host(&drv));
                drv.inject(op, skip, fault.clone());
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    a.sleep(0, pool, SleepMode::OffloadPinned)
                }));
                let fired = drv.pending_faults() == 0;
                if !fired {
                    // A kept copy needs no mapping or registration: the sleep went through.
                    assert!(kept && matches!(op, SimOp::HostMap | SimOp::HostRegister), "{op:?}");
                    assert!(matches!(r, Ok(Ok(()))));
                    a.wake(0, pool).unwrap();
                    continue;
                }
                assert!(matches!(r, Ok(Err(_)) | Err(_)), "{op:?} {fault:?}: {r:?}");
                if let (Ok(Err(Error::OutOfMemory(m))), SimOp::HostMap) = (&r, op) {
                    assert!(m.contains("nothing changed"), "{m}");
                }
                assert_eq!(drv.used(0), used, "{op:?} {fault:?}: the pool is awake");
                let after = host(&drv);
                // A copy pinned by the failed sleep is kept for the next; none is leaked.
                assert!(
                    after.0 <= 2 && after.0 >= before.0 && after.0 == after.1,
                    "{op:?} {fault:?} kept {kept}: {after:?}"
                );
                assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap() != 0, after.0 != 0);
                check(&a);
                a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                a.wake(0, pool).unwrap();
                assert!(intact(&live), "{op:?} {fault:?}");
                a.sleep_release_kept(0, pool).unwrap();
                assert_eq!(host(&drv), (0, 0), "{op:?} {fault:?}");
                check(&a);
            }
        }
    }
}

#[test]
fn a_fault_in_a_pinned_wake_leaves_the_pool_asleep_with_its_copy() {
    let ops = [(SimOp::MemcpyHtoD, 1), (SimOp::StreamCreate, 0), (SimOp::StreamSynchronize, 0), (SimOp::MemMap, 3)];
    for mode in [SleepMode::Offload, SleepMode::OffloadPinned] {
        for (op, skip) in ops {
            if mode == SleepMode::Offload && op == SimOp::StreamSynchronize {
                continue; // the staging ring waits by events
            }
            for fault in [fail(), SimFault::Panic] {
                let (a, drv) = sim_with(1, 1 << 30, config());
                let (pool, live) = pool_with(&a, &sizes());
                let used = drv.used(0);
                a.sleep(0, pool, mode).unwrap();
                let copy = host(&drv);
                drv.inject(op, skip, fault.clone());
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.wake(0, pool)));
                assert!(matches!(r, Ok(Err(_)) | Err(_)), "{op:?} {fault:?}: {r:?}");
                assert_eq!(drv.pending_faults(), 0, "{op:?}: the fault fired");
                // A map that unwinds leaves its new handle to the expandable segment's orphans,
                // released by the next map of that range (`Expandable::map`).
                let orphans = if matches!((op, &fault), (SimOp::MemMap, SimFault::Panic)) { drv.used(0) } else { 0 };
                assert_eq!(
                    (drv.used(0), host(&drv)),
                    (orphans, copy),
                    "{mode:?} {op:?} {fault:?}: asleep, copy intact"
                );
                check(&a);
                a.wake(0, pool).unwrap();
                assert_eq!(drv.used(0), used, "{mode:?} {op:?} {fault:?}");
                assert!(intact(&live), "{op:?} {fault:?}");
                check(&a);
            }
        }
    }
}

#[test]
fn a_copy_the_driver_would_not_unregister_leaks_and_nothing_else() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (pool, live) = pool_with(&a, &sizes());
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    a.wake(0, pool).unwrap();
    let kept = a.sleep_kept_bytes(0, Some(pool)).unwrap();
    drv.inject(SimOp::HostUnregister, 0, fail());
    let released = a.sleep_release_kept(0, pool).unwrap();
    assert!(released > 0 && released < kept, "only what was unpinned is counted: {released} of {kept}");
    assert_eq!(host(&drv), (1, 1), "the copy the driver refused stays registered and mapped");
    assert!(intact(&live));
    check(&a);
}

#[test]
fn bad_pools_are_refused() {
    let (a, _drv) = sim_with(1, 1 << 30, config());
    assert!(matches!(a.sleep_release_kept(0, 12345), Err(Error::InvalidValue(_))));
    assert!(matches!(a.sleep_kept_bytes(0, Some(12345)), Err(Error::InvalidValue(_))));
    assert!(matches!(a.sleep_kept_bytes(7, None), Err(Error::InvalidValue(_))));
    assert_eq!(a.sleep_kept_bytes(0, Some(0)).unwrap(), 0);
}
