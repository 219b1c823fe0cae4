//! `Allocator::sleep_prepare` (`caching::sleep::prepare`, `gpupool_sleep_prepare`) on the
//! simulated device: the pinned copies it makes are the ones the first sleep uses (the sleep
//! maps and registers nothing), a pool that grows after it still sleeps and wakes bit for bit,
//! a fault while pinning leaves the pool awake and its kept copies as they were, and bad
//! arguments are refused with nothing changed.
use crate::common;

use common::sleep::{S, asleep, fail, host, intact, pool_with};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};
use gpupool::{Error, SleepMode};

fn config() -> Config {
    Config { sleep_threads: 3, ..Config::default() }
}

fn sizes() -> Vec<usize> {
    vec![3 * MIB, 512, 70 * MIB + 5, 4096, 700 * 1024, 2 * MIB]
}

/// `sizes` with a block of 5 MiB where it has one of 70 MiB, for the fault test: its faults are
/// in the pinning (one map and one registration per stream), which no copy's size changes,
/// and each of its 18 cases copies the pool twice (the simulated device's page faults were
/// most of its CPU time).
fn small_sizes() -> Vec<usize> {
    vec![3 * MIB, 512, 5 * MIB + 5, 4096, 700 * 1024, 2 * MIB]
}

#[test]
fn a_sleep_after_prepare_pins_nothing() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (pool, live) = pool_with(&a, &sizes());
    let bytes = a.stats(0).unwrap().allocated_bytes.all.current as usize;
    let pinned = a.sleep_prepare(0, pool, SleepMode::OffloadPinned).unwrap();
    assert_eq!(pinned, bytes, "a copy of each stream's live bytes");
    assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), bytes, "held while awake");
    assert_eq!(host(&drv), (2, 2), "one registered copy per stream");
    assert!(!asleep(&a, pool), "the pool stays awake");
    check(&a);
    let before = drv.counts();
    assert_eq!(a.sleep_prepare(0, pool, SleepMode::OffloadPinned).unwrap(), bytes, "a second prepare");
    assert_eq!(drv.counts().host_map, before.host_map, "finds the copies kept");
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    let after = drv.counts();
    assert_eq!((after.host_register, after.host_map), (before.host_register, before.host_map), "nothing pinned");
    assert_eq!(after.host_alloc, before.host_alloc, "no staging ring");
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    assert_eq!(drv.counts().unpinned_copies, 0);
    assert_eq!(a.sleep_release_kept(0, pool).unwrap(), bytes);
    assert_eq!(host(&drv), (0, 0));
    check(&a);
}

#[test]
fn a_pool_grown_after_prepare_sleeps_and_wakes_whole() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (pool, mut live) = pool_with(&a, &sizes());
    a.sleep_prepare(0, pool, SleepMode::OffloadPinned).unwrap();
    let registered = drv.counts().host_register;
    // Stream S grows past its prepared copy; the other stream's copy still fits.
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let more = a.malloc(90 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    common::sleep::fill(more, 90 * MIB, live.len() as u32);
    live.push((more, 90 * MIB));
    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
    assert_eq!(drv.counts().host_register, registered + 1, "only the grown stream pins again");
    assert_eq!(host(&drv), (2, 2), "the copy it did not use went back");
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    assert_eq!(drv.counts().unpinned_copies, 0);
    for &(p, _) in &live {
        a.free(p).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    assert_eq!(host(&drv), (0, 0));
    check(&a);
}

#[test]
fn a_fault_while_pinning_leaves_the_pool_awake_and_what_it_kept() {
    for kept in [false, true] {
        // With a kept copy, one stream finds its copy and the grown one pins: one pin only.
        let ops: &[(SimOp, u32)] = match kept {
            false => &[(SimOp::HostMap, 0), (SimOp::HostMap, 1), (SimOp::HostRegister, 0), (SimOp::HostRegister, 1)],
            true => &[(SimOp::HostMap, 0), (SimOp::HostRegister, 0)],
        };
        for &(op, skip) in ops {
            for fault in [fail(), SimFault::Fail(DriverError::OutOfMemory), SimFault::Panic] {
                let (a, drv) = sim_with(1, 1 << 30, config());
                let (pool, mut live) = pool_with(&a, &small_sizes());
                if kept {
                    a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                    a.wake(0, pool).unwrap();
                    // More than stream S's kept copy (under 9 MiB): that stream pins again.
                    a.begin_allocate_to_pool(0, pool, S).unwrap();
                    let more = a.malloc(9 * MIB, 0, S).unwrap();
                    a.end_allocate_to_pool(0, pool).unwrap();
                    common::sleep::fill(more, 9 * MIB, live.len() as u32);
                    live.push((more, 9 * MIB));
                }
                let kept_before = a.sleep_kept_bytes(0, Some(pool)).unwrap();
                let live_host = host(&drv);
                drv.inject(op, skip, fault.clone());
                let what = format!("{op:?} {skip} {fault:?} kept {kept}");
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    a.sleep_prepare(0, pool, SleepMode::OffloadPinned)
                }));
                match (&fault, r) {
                    (SimFault::Panic, Err(_)) => {}
                    (SimFault::Fail(DriverError::OutOfMemory), Ok(Err(Error::OutOfMemory(m)))) => {
                        assert!(m.contains("gpupool_sleep_prepare"), "{what}: {m}")
                    }
                    (SimFault::Fail(DriverError::Cuda { .. }), Ok(Err(Error::OutOfMemory(_) | Error::Cuda(_)))) => {}
                    (_, r) => panic!("{what}: {:?}", r.map_err(|_| "panic")),
                }
                drv.clear_faults();
                assert_eq!(host(&drv), live_host, "{what}: nothing pinned or mapped is left");
                assert_eq!(a.sleep_kept_bytes(0, Some(pool)).unwrap(), kept_before, "{what}");
                assert!(!asleep(&a, pool), "{what}: awake");
                assert!(intact(&live), "{what}");
                check(&a);
                a.sleep(0, pool, SleepMode::OffloadPinned).unwrap();
                a.wake(0, pool).unwrap();
                assert!(intact(&live), "{what}");
            }
        }
    }
}

#[test]
fn bad_arguments_are_refused_with_nothing_changed() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let (pool, _live) = pool_with(&a, &sizes());
    let invalid = |r: Result<usize, Error>, what: &str| match r {
        Err(Error::InvalidValue(m)) => m,
        r => panic!("{what}: {r:?}"),
    };
    invalid(a.sleep_prepare(0, 0x4000_0000_0000_0777, SleepMode::OffloadPinned), "a pool never made");
    invalid(a.sleep_prepare(3, pool, SleepMode::OffloadPinned), "a device out of range");
    let plain = a.pool_create();
    let m = invalid(a.sleep_prepare(0, plain, SleepMode::OffloadPinned), "a pool that cannot sleep");
    assert!(m.contains("gpupool_pool_create_sleepable"), "{m}");
    a.sleep(0, pool, SleepMode::Discard).unwrap();
    let m = invalid(a.sleep_prepare(0, pool, SleepMode::OffloadPinned), "a sleeping pool");
    assert!(m.contains("sleep"), "{m}");
    a.wake(0, pool).unwrap();
    assert_eq!(host(&drv), (0, 0), "nothing pinned by a refused call");
    assert_eq!(a.sleep_prepare(0, pool, SleepMode::Discard).unwrap(), 0, "discard needs nothing");
    assert_eq!(drv.live_host(), (0, 0));
    let ring = a.sleep_prepare(0, pool, SleepMode::Offload).unwrap();
    assert!(ring > 0 && ring == a.sleep_staging_bytes(0).unwrap(), "offload pins the staging ring");
    let other = a.pool_create_sleepable();
    assert_eq!(a.sleep_prepare(0, other, SleepMode::OffloadPinned).unwrap(), 0, "an empty pool pins nothing");
    a.release_pool(0, other).unwrap();
    invalid(a.sleep_prepare(0, other, SleepMode::OffloadPinned), "a released pool");
    check(&a);
}
