//! A block freed while its pool goes to sleep, and its pages released meanwhile (issue 40's
//! first defect: the pool could never wake again and its live blocks were lost). The free and
//! the release are put between the sleep's copies and its unmapping by a hook of the simulated
//! driver at the copies' synchronisation, so that each run hits the window; the release is
//! each of the three that unmap free pages: `empty_cache`, another pool's out-of-memory path,
//! and a default-pool growth under the high-water rule.
use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::sleep::{fill, holds};
use common::{MIB, check, sim_with};
use gpupool::SleepMode;
use gpupool::config::Config;
use gpupool::driver::sim::SimOp;

const S: usize = 0x10;
const OTHER: usize = 0x30;

#[derive(Clone, Copy, Debug)]
enum Release {
    EmptyCache,
    OtherPoolOutOfMemory,
    HighWaterRule,
}

fn race(mode: SleepMode, release: Release) {
    let config = Config {
        expandable_segments: true,
        expandable_reclaim: matches!(release, Release::HighWaterRule),
        ..Config::default()
    };
    let (a, sim) = sim_with(1, 512 * MIB, config);
    let a = Arc::new(a);
    // Three neighbouring blocks of one segment, whose copy is one run; the middle one spans
    // whole 20 MiB pages of the sleepable layout.
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let blocks: Vec<(u64, usize)> =
        [30 * MIB, 90 * MIB, 10 * MIB].iter().map(|&n| (a.malloc(n, 0, S).unwrap(), n)).collect();
    a.end_allocate_to_pool(0, pool).unwrap();
    for (i, &(p, n)) in blocks.iter().enumerate() {
        fill(p, n, i as u32);
    }
    if matches!(release, Release::HighWaterRule) {
        // The device's high-water mark where it is now: the growth below passes it.
        a.empty_cache(0).unwrap();
    }
    let ran = Arc::new(AtomicBool::new(false));
    let (a2, ran2, middle) = (a.clone(), ran.clone(), blocks[1].0);
    // The sleep's copies are all queued and being waited for: its live blocks are read from
    // their pages until this returns, and it unmaps the pages it saw right after.
    sim.on_call(SimOp::StreamSynchronize, 0, move || {
        a2.free(middle).unwrap();
        match release {
            Release::EmptyCache => a2.empty_cache(0).unwrap(),
            Release::OtherPoolOutOfMemory => {
                // Past the device: the out-of-memory path releases every pool's cache first.
                assert!(a2.malloc(1 << 30, 0, OTHER).is_err());
            }
            Release::HighWaterRule => {
                let p = a2.malloc(200 * MIB, 0, OTHER).unwrap();
                a2.free(p).unwrap();
            }
        }
        ran2.store(true, Ordering::Relaxed);
    });
    a.sleep(0, pool, mode).unwrap();
    assert!(ran.load(Ordering::Relaxed), "the hook ran inside the sleep");
    check(&a);
    a.wake(0, pool).unwrap_or_else(|e| panic!("{mode:?}, {release:?}: the pool could not wake: {e}"));
    for (i, &(p, n)) in blocks.iter().enumerate() {
        if i != 1 {
            assert!(holds(p, n, i as u32), "{mode:?}, {release:?}: block {i} lost its contents");
        }
    }
    check(&a);
    // Awake, the pool's free pages can go back as usual.
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let q = a.malloc(MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(q).unwrap();
    for &(p, _) in [blocks[0], blocks[2]].iter() {
        a.free(p).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    a.empty_cache(0).unwrap();
    check(&a);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0, "{mode:?}, {release:?}: everything given back");
}

#[test]
fn a_free_and_empty_cache_during_a_sleep_lose_nothing() {
    for mode in [SleepMode::Offload, SleepMode::OffloadPinned] {
        race(mode, Release::EmptyCache);
    }
}

#[test]
fn a_free_and_another_pools_out_of_memory_during_a_sleep_lose_nothing() {
    for mode in [SleepMode::Offload, SleepMode::OffloadPinned] {
        race(mode, Release::OtherPoolOutOfMemory);
    }
}

#[test]
fn a_free_and_the_high_water_rule_during_a_sleep_lose_nothing() {
    for mode in [SleepMode::Offload, SleepMode::OffloadPinned] {
        race(mode, Release::HighWaterRule);
    }
}
