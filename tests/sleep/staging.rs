//! Sleep and wake through the pinned staging ring (`caching::sleep::staging`,
//! `caching::sleep::copy`), on the simulated device, whose copies check that their host side
//! is pinned: contents bit for bit with chunk sizes that divide no block, blocks many times
//! the ring's size, many small blocks packed into one buffer, any crew size; the ring pinned
//! once and given back by `empty_cache`; the host copy pageable and unmapped at wake; a fault
//! at any call in the middle of the pipeline leaving everything as it was; two pools of one
//! device sharing the ring from two threads.
use crate::common;

use std::sync::Arc;

use common::sleep::{S, S2, fail, fill, holds, intact, pool_with};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};
use gpupool::{Error, SleepMode};

/// A ring of 3 buffers of 100,003 bytes (which divides no block size), `threads` threads.
fn config(threads: usize) -> Config {
    Config { sleep_chunk: 100_003, sleep_buffers: 3, sleep_threads: threads, ..Config::default() }
}

/// Fills `n` bytes at `p` with a pattern of `seed` that differs at every byte of a chunk.
/// Big blocks (many rings long), odd sizes, and 300 small blocks.
fn sizes() -> Vec<usize> {
    let mut v = vec![5 * MIB + 17, 512, 2 * MIB - 1, 700_001, 21 * MIB + 3];
    v.extend((0..300).map(|i| 512 * (i % 9 + 1) + i));
    v
}

#[test]
fn contents_come_back_bit_for_bit_whatever_the_chunk_the_ring_and_the_crew() {
    for threads in [1, 3, 0] {
        let (a, drv) = sim_with(1, 1 << 30, config(threads));
        let (pool, live) = pool_with(&a, &sizes());
        let allocated = a.pool_stats(0, pool).unwrap().stats.allocated_bytes.all.current as usize;
        for round in 0..3 {
            a.sleep(0, pool, SleepMode::Offload).unwrap();
            check(&a);
            assert_eq!(drv.live_pageable(), (2, allocated), "{threads} threads: one pageable copy per stream");
            assert_eq!(drv.live_host(), (3, 0), "the ring: 3 pinned buffers");
            assert_eq!(a.sleep_staging_bytes(0).unwrap(), 3 * 100_003);
            // The pages are gone: whatever was there is overwritten by the new pages.
            a.wake(0, pool).unwrap();
            check(&a);
            assert!(intact(&live), "{threads} threads, round {round}");
            assert_eq!(drv.live_pageable(), (0, 0), "the host copy unmapped at wake");
        }
        assert_eq!(drv.counts().host_alloc, 3, "the ring pinned once for every sleep and wake");
        assert_eq!(drv.counts().unpinned_copies, 0);
        let summary = a.memory_summary(0).unwrap();
        assert!(summary.contains("pinned staging buffers (host memory, until empty_cache): 292.98 KiB"), "{summary}");
        a.empty_cache(0).unwrap();
        assert_eq!((drv.live_host(), a.sleep_staging_bytes(0).unwrap()), ((0, 0), 0), "empty_cache gives it back");
        assert!(!a.memory_summary(0).unwrap().contains("staging"));
        a.sleep(0, pool, SleepMode::Offload).unwrap();
        a.wake(0, pool).unwrap();
        assert!(intact(&live));
        assert_eq!(drv.counts().host_alloc, 6, "pinned again after empty_cache");
    }
}

#[test]
fn the_default_pools_and_blocks_freed_while_asleep_go_through_the_ring_too() {
    let (a, drv) = sim_with(1, 1 << 30, config(2));
    let live: Vec<_> = sizes()
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = a.malloc(n, 0, if i % 3 == 0 { S } else { S2 }).unwrap();
            fill(p, n, i as u32);
            (p, n)
        })
        .collect();
    a.sleep(0, 0, SleepMode::Offload).unwrap();
    a.free(live[0].0).unwrap();
    a.wake(0, 0).unwrap();
    check(&a);
    assert!(live.iter().enumerate().skip(1).all(|(i, &(p, n))| holds(p, n, i as u32)));
    assert_eq!((drv.live_pageable(), drv.counts().unpinned_copies), ((0, 0), 0));
}

#[test]
fn a_fault_in_the_middle_of_the_offload_leaves_the_pool_awake_and_as_it_was() {
    let ops = [
        (SimOp::MemcpyDtoH, 40),
        (SimOp::EventRecord, 30),
        (SimOp::EventSynchronize, 25),
        (SimOp::HostMap, 1),
        (SimOp::HostAlloc, 2),
        (SimOp::EventCreate, 1),
        (SimOp::StreamCreate, 1),
    ];
    for (op, skip) in ops {
        for fault in [fail(), SimFault::Fail(DriverError::OutOfMemory), SimFault::Panic] {
            let (a, drv) = sim_with(1, 1 << 30, config(3));
            let (pool, live) = pool_with(&a, &sizes());
            let used = drv.used(0);
            drv.inject(op, skip, fault.clone());
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.sleep(0, pool, SleepMode::Offload)));
            assert!(matches!(r, Ok(Err(_)) | Err(_)), "{op:?} {fault:?}: {r:?}");
            if let (Ok(Err(Error::OutOfMemory(m))), SimOp::HostMap) = (&r, op) {
                assert!(m.contains("cannot give") && m.contains("nothing changed"), "{m}");
            }
            assert_eq!(drv.pending_faults(), 0, "{op:?}: the fault fired");
            assert_eq!((drv.used(0), drv.live_pageable()), (used, (0, 0)), "{op:?} {fault:?}: nothing changed");
            check(&a);
            a.sleep(0, pool, SleepMode::Offload).unwrap();
            a.wake(0, pool).unwrap();
            assert!(intact(&live), "{op:?} {fault:?}");
            check(&a);
        }
    }
}

#[test]
fn a_fault_in_the_middle_of_the_restore_leaves_the_pool_asleep_with_its_copy() {
    let ops = [(SimOp::MemcpyHtoD, 40), (SimOp::EventRecord, 30), (SimOp::EventSynchronize, 25)];
    for (op, skip) in ops {
        for fault in [fail(), SimFault::Panic] {
            let (a, drv) = sim_with(1, 1 << 30, config(3));
            let (pool, live) = pool_with(&a, &sizes());
            a.sleep(0, pool, SleepMode::Offload).unwrap();
            let copy = drv.live_pageable();
            drv.inject(op, skip, fault.clone());
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.wake(0, pool)));
            assert!(matches!(r, Ok(Err(_)) | Err(_)), "{op:?} {fault:?}: {r:?}");
            assert_eq!(drv.pending_faults(), 0, "{op:?}: the fault fired");
            assert_eq!((drv.used(0), drv.live_pageable()), (0, copy), "{op:?} {fault:?}: asleep, copy intact");
            check(&a);
            a.wake(0, pool).unwrap();
            assert!(intact(&live), "{op:?} {fault:?}");
            check(&a);
        }
    }
}

#[test]
fn a_host_copy_the_system_would_not_unmap_is_left_and_the_wake_succeeds() {
    let (a, drv) = sim_with(1, 1 << 30, config(2));
    let (pool, live) = pool_with(&a, &[3 * MIB, 4 * MIB]);
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    drv.inject(SimOp::HostUnmap, 0, fail());
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    assert_eq!(drv.live_pageable().0, 1, "the copy the system refused to unmap leaks");
    check(&a);
}

#[test]
fn two_pools_of_one_device_share_the_ring_from_two_threads() {
    let (a, drv) = sim_with(1, 2 << 30, config(2));
    let a = Arc::new(a);
    let pools: Vec<_> = (0..2).map(|_| pool_with(&a, &sizes())).collect();
    let threads: Vec<_> = pools
        .into_iter()
        .map(|(pool, live)| {
            let a = a.clone();
            std::thread::spawn(move || {
                for _ in 0..10 {
                    a.sleep(0, pool, SleepMode::Offload).unwrap();
                    let _ = a.empty_cache(0);
                    a.wake(0, pool).unwrap();
                    assert!(intact(&live));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    check(&a);
    assert_eq!((drv.live_pageable(), drv.counts().unpinned_copies), ((0, 0), 0));
}

#[test]
fn extreme_settings_still_copy_every_byte() {
    // One byte a buffer, two buffers, one thread; and 64 buffers of a page, 64 threads.
    for (chunk, buffers, threads) in [(1, 2, 1), (4096, 64, 64), (7 << 20, 2, 2)] {
        let config = Config { sleep_chunk: chunk, sleep_buffers: buffers, sleep_threads: threads, ..Config::default() };
        let (a, drv) = sim_with(1, 1 << 30, config);
        let sizes: Vec<usize> = if chunk == 1 { vec![512, 1536, 3000, 700] } else { sizes() };
        let (pool, live) = pool_with(&a, &sizes);
        a.sleep(0, pool, SleepMode::Offload).unwrap();
        a.wake(0, pool).unwrap();
        assert!(intact(&live), "chunk {chunk}, {buffers} buffers, {threads} threads");
        assert_eq!((drv.live_pageable(), drv.counts().unpinned_copies), ((0, 0), 0));
        check(&a);
    }
}

#[test]
fn a_wake_that_cannot_pin_the_ring_again_leaves_the_pool_asleep_with_its_copy() {
    let (a, drv) = sim_with(1, 1 << 30, config(2));
    let (pool, live) = pool_with(&a, &sizes());
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    a.empty_cache(0).unwrap(); // the ring goes back; the host copy stays
    let copy = drv.live_pageable();
    assert_eq!((drv.live_host(), copy.0), ((0, 0), 2));
    // Out of memory is tried twice (the cache released in between).
    for _ in 0..2 {
        drv.inject(SimOp::HostAlloc, 1, SimFault::Fail(DriverError::OutOfMemory));
    }
    match a.wake(0, pool) {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("cannot pin the staging buffers"), "{m}"),
        r => panic!("{r:?}"),
    }
    assert_eq!((drv.used(0), drv.live_pageable(), drv.live_host()), (0, copy, (0, 0)), "asleep, copy intact");
    check(&a);
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    check(&a);
}

#[test]
fn neighbouring_blocks_are_copied_as_one_run() {
    let (a, drv) = sim_with(1, 1 << 30, Config::default());
    let (pool, live) = pool_with(&a, &[MIB; 128]);
    let before = drv.counts().copies;
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    let copies = drv.counts().copies - before;
    // 128 MiB on two streams through 32 MiB buffers: a handful of copies, not 128.
    assert!(copies <= 12, "{copies} copies for 128 blocks of 1 MiB side by side");
    a.wake(0, pool).unwrap();
    assert!(intact(&live));
    check(&a);
}
