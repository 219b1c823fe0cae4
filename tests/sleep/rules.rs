//! Sleep and wake (`caching::sleep`) on the simulated device, one test per rule of
//! docs/sleep.md: memory given back to the byte and the contents restored bit for bit at the
//! same addresses; discard; allocations refused while asleep, frees allowed; a second sleep
//! or wake refused; memory that is not on the virtual memory API refused with its reason;
//! events honoured without a device synchronisation; `empty_cache` and `release_pool`
//! leaving a sleeping pool alone; graphs captured into a sleepable pool; statistics. Faults and
//! threads are in `faults.rs`.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::CaptureMode;
use gpupool::{Allocator, Error, SleepMode};

const S: usize = 0x10;
const S2: usize = 0x20;

/// Fills `len` bytes at `ptr` with a pattern of `seed`.
fn fill(ptr: u64, len: usize, seed: u8) {
    // SAFETY: `ptr` is a live block of at least `len` bytes, mapped by the simulated driver.
    let b = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// Whether `len` bytes at `ptr` hold the pattern of `seed`.
fn holds(ptr: u64, len: usize, seed: u8) -> bool {
    // SAFETY: as in `fill`.
    let b = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    b.iter().enumerate().all(|(i, &x)| x == (i as u8).wrapping_mul(31).wrapping_add(seed))
}

fn default_config() -> Config {
    Config { expandable_segments: true, ..Config::default() }
}

/// The live blocks of a model: (pointer, bytes), each filled with its own pattern.
fn weights(a: &Allocator, stream: usize, sizes: &[usize]) -> Vec<(u64, usize)> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = a.malloc(n, 0, stream).unwrap();
            fill(p, n, i as u8);
            (p, n)
        })
        .collect()
}

#[test]
fn offload_gives_the_memory_back_to_the_byte_and_restores_it_bit_for_bit() {
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    // 39 MiB + 17 B: in 2 MiB pages as many bytes as in 20 MiB ones, so a range of large pages
    // of its own (the page by rounding), apart from the others: a copy each.
    let live = weights(&a, S, &[3 * MIB, 512, 39 * MIB + 17, 700 * 1024]);
    let cached = a.malloc(5 * MIB, 0, S).unwrap();
    a.free(cached).unwrap();
    let before = a.stats(0).unwrap();
    let reserved = before.reserved_bytes.all.current as usize;
    let used = drv.used(0);
    assert_eq!(used, reserved, "the device holds what is reserved");
    a.sleep(0, 0, SleepMode::Offload).unwrap();
    check(&a);
    assert_eq!(drv.used(0), 0, "every page given back, the cached ones included");
    let asleep = a.stats(0).unwrap();
    assert_eq!(asleep.sleeping_bytes.current as usize, reserved);
    assert_eq!(asleep.reserved_bytes.all.current as usize, reserved, "reserved still counts the pages");
    assert_eq!(asleep.allocated_bytes.all.current, before.allocated_bytes.all.current);
    let bytes = before.allocated_bytes.all.current as usize;
    assert_eq!(drv.live_pageable(), (1, bytes), "one pageable host copy of the live blocks");
    assert_eq!(drv.live_host(), (4, 0), "the staging ring: pinned once");
    assert_eq!(a.sleep_staging_bytes(0).unwrap(), 4 * 32 * MIB);
    a.wake(0, 0).unwrap();
    check(&a);
    assert_eq!(drv.used(0), used, "the same pages mapped again");
    for (i, &(p, n)) in live.iter().enumerate() {
        assert!(holds(p, n, i as u8), "block {i} restored bit for bit at its address");
    }
    assert_eq!(drv.live_pageable(), (0, 0), "host memory back where it was");
    assert_eq!(drv.live_host(), (4, 0), "the staging ring is kept for the next sleep");
    let after = a.stats(0).unwrap();
    assert_eq!((after.sleeping_bytes.current, after.sleeping_bytes.allocated), (0, reserved as i64));
    assert_eq!(after.reserved_bytes.all.current, before.reserved_bytes.all.current);
    // The pool works as before: the cached block serves again, at its old address.
    assert_eq!(a.malloc(5 * MIB, 0, S).unwrap(), cached);
    assert!(drv.counts().copies >= 8, "each direction copied every block");
}

#[test]
fn discard_copies_nothing_and_the_blocks_keep_their_addresses() {
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    let live = weights(&a, S, &[8 * MIB, 4096]);
    a.sleep(0, 0, SleepMode::Discard).unwrap();
    check(&a);
    assert_eq!((drv.used(0), drv.live_host(), drv.counts().copies), (0, (0, 0), 0));
    a.wake(0, 0).unwrap();
    check(&a);
    // The simulated device's new pages are zero: the contents were dropped.
    assert!(!holds(live[0].0, live[0].1, 0));
    fill(live[0].0, live[0].1, 9);
    assert!(holds(live[0].0, live[0].1, 9), "the address is usable again");
    assert_eq!(drv.counts().copies, 0);
}

#[test]
fn a_sleeping_pool_refuses_allocations_and_other_pools_allocate() {
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    let private = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, private, S2).unwrap();
    let p = a.malloc(MIB, 0, S2).unwrap();
    a.end_allocate_to_pool(0, private).unwrap();
    let d = a.malloc(MIB, 0, S).unwrap();
    // The default pools sleep: every allocation that no route takes is refused, on any stream.
    a.sleep(0, 0, SleepMode::Discard).unwrap();
    for stream in [S, 0x999] {
        match a.malloc(MIB, 0, stream) {
            Err(Error::InvalidValue(m)) => assert!(m.contains("default pools of device 0 sleep"), "{m}"),
            r => panic!("allocated from sleeping default pools: {r:?}"),
        }
    }
    // A route to the private pool still allocates there.
    a.begin_allocate_to_pool(0, private, S2).unwrap();
    let q = a.malloc(MIB, 0, S2).unwrap();
    a.end_allocate_to_pool(0, private).unwrap();
    a.wake(0, 0).unwrap();
    // The private pool sleeps: routed allocations are refused, the default pools allocate.
    a.sleep(0, private, SleepMode::Offload).unwrap();
    a.begin_allocate_to_pool(0, private, S2).unwrap();
    assert!(matches!(a.malloc(MIB, 0, S2), Err(Error::InvalidValue(_))));
    a.end_allocate_to_pool(0, private).unwrap();
    let e = a.malloc(MIB, 0, S).unwrap();
    check(&a);
    a.wake(0, private).unwrap();
    for x in [p, q, d, e] {
        a.free(x).unwrap();
    }
    check(&a);
    a.empty_cache(0).unwrap();
    assert_eq!(drv.used(0), 0);
}

#[test]
fn frees_during_sleep_are_allowed_and_the_block_is_cache_after_wake() {
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    let live = weights(&a, S, &[6 * MIB, 6 * MIB]);
    a.sleep(0, 0, SleepMode::Offload).unwrap();
    a.free(live[0].0).unwrap();
    assert!(matches!(a.free(live[0].0), Err(Error::InvalidPointer(_))), "a double free is still one");
    check(&a);
    assert_eq!(a.stats(0).unwrap().allocated_bytes.all.current as usize, 6 * MIB);
    // empty_cache and the out-of-memory path leave a sleeping pool and its copy alone.
    a.empty_cache(0).unwrap();
    assert_eq!((drv.used(0), drv.live_pageable().0), (0, 1));
    a.wake(0, 0).unwrap();
    assert!(holds(live[1].0, live[1].1, 1));
    check(&a);
    // The freed block's pages came back as cache, and go back at the next empty_cache.
    assert_eq!(a.malloc(6 * MIB, 0, S).unwrap(), live[0].0);
    a.free(live[0].0).unwrap();
    a.free(live[1].0).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(drv.used(0), 0);
}

#[test]
fn a_second_sleep_or_wake_is_refused_and_changes_nothing() {
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    let live = weights(&a, S, &[4 * MIB]);
    assert!(matches!(a.wake(0, 0), Err(Error::InvalidValue(m)) if m.contains("do not sleep")));
    a.sleep(0, 0, SleepMode::Offload).unwrap();
    let counts = drv.counts();
    let stats = a.stats(0).unwrap();
    match a.sleep(0, 0, SleepMode::Discard) {
        Err(Error::InvalidValue(m)) => assert!(m.contains("sleep already"), "{m}"),
        r => panic!("{r:?}"),
    }
    assert_eq!((drv.counts(), a.stats(0).unwrap()), (counts, stats), "nothing done");
    a.wake(0, 0).unwrap();
    assert!(matches!(a.wake(0, 0), Err(Error::InvalidValue(_))));
    assert!(holds(live[0].0, live[0].1, 0), "the first sleep's mode held: offload");
    check(&a);
}

#[test]
fn memory_not_on_the_virtual_memory_api_cannot_sleep_and_says_why() {
    // A private pool made by pool_create has ordinary segments.
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    let plain = a.pool_create();
    a.begin_allocate_to_pool(0, plain, S).unwrap();
    let p = a.malloc(MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, plain).unwrap();
    let used = drv.used(0);
    match a.sleep(0, plain, SleepMode::Offload) {
        Err(Error::InvalidValue(m)) => assert!(m.contains("gpupool_pool_create_sleepable"), "{m}"),
        r => panic!("{r:?}"),
    }
    assert_eq!(drv.used(0), used);
    a.begin_allocate_to_pool(0, plain, S).unwrap();
    a.free(a.malloc(MIB, 0, S).unwrap()).unwrap();
    a.end_allocate_to_pool(0, plain).unwrap();
    a.free(p).unwrap();
    // Pools never made, devices out of range.
    assert!(matches!(a.sleep(0, 1 << 40, SleepMode::Offload), Err(Error::InvalidValue(_))));
    assert!(matches!(a.sleep(3, 0, SleepMode::Offload), Err(Error::InvalidValue(m)) if m.contains("out of range")));
    assert!(matches!(a.wake(0, u64::MAX), Err(Error::InvalidValue(_))));
    // The default pools with expandable_segments:False.
    let (b, _) = sim_with(1, 1 << 30, Config::pytorch());
    let q = b.malloc(MIB, 0, S).unwrap();
    match b.sleep(0, 0, SleepMode::Discard) {
        Err(Error::InvalidValue(m)) => assert!(m.contains("expandable_segments is off"), "{m}"),
        r => panic!("{r:?}"),
    }
    b.free(q).unwrap();
    // But a sleepable pool sleeps there all the same: its segments are expandable.
    let pool = b.pool_create_sleepable();
    b.begin_allocate_to_pool(0, pool, S).unwrap();
    let r = b.malloc(3 * MIB, 0, S).unwrap();
    b.end_allocate_to_pool(0, pool).unwrap();
    fill(r, 3 * MIB, 5);
    b.sleep(0, pool, SleepMode::Offload).unwrap();
    b.wake(0, pool).unwrap();
    assert!(holds(r, 3 * MIB, 5));
    check(&a);
    check(&b);
}

#[test]
fn sleep_waits_for_the_streams_by_events_not_by_synchronising_the_device() {
    let (a, drv) = sim_with(1, 1 << 30, default_config());
    let p = a.malloc(2 * MIB, 0, S).unwrap();
    a.record_stream(p, S2).unwrap();
    let freed = a.malloc(2 * MIB, 0, S).unwrap();
    a.record_stream(freed, 0x30).unwrap();
    drv.hold_stream(S2);
    drv.hold_stream(0x30);
    a.free(freed).unwrap();
    drv.hold_stream(S);
    let syncs = drv.counts().device_synchronize;
    a.sleep(0, 0, SleepMode::Offload).unwrap();
    assert_eq!(drv.counts().device_synchronize, syncs, "no device synchronisation");
    for s in [S, S2, 0x30] {
        assert_eq!(drv.stream_waits(s), 1, "stream {s:#x}'s work waited for by an event");
    }
    a.wake(0, 0).unwrap();
    a.free(p).unwrap();
    check(&a);
}

#[test]
fn a_sleeping_pool_cannot_be_released_and_its_statistics_say_it_sleeps() {
    let (a, _) = sim_with(1, 1 << 30, default_config());
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let p = a.malloc(5 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    let reserved = a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current;
    a.sleep(0, pool, SleepMode::Discard).unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.sleeping_bytes.current, reserved);
    assert_eq!(a.stats(0).unwrap().sleeping_bytes.current, reserved);
    assert!(matches!(a.release_pool(0, pool), Err(Error::InvalidValue(m)) if m.contains("sleep")));
    a.wake(0, pool).unwrap();
    assert_eq!(a.pool_stats(0, pool).unwrap().stats.sleeping_bytes.current, 0);
    let s = a.stats(0).unwrap();
    assert_eq!((s.sleeping_bytes.current, s.sleeping_bytes.peak), (0, reserved));
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    check(&a);
}

#[test]
fn a_graph_captured_into_a_sleepable_pool_finds_its_buffers_after_wake() {
    let (a, drv) = sim_with(1, 1 << 30, Config::pytorch());
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    drv.begin_capture(S, CaptureMode::Global).unwrap();
    let input = a.malloc(4 * MIB, 0, S).unwrap();
    let scratch = a.malloc(2 * MIB, 0, S).unwrap();
    a.free(scratch).unwrap();
    let output = a.malloc(MIB, 0, S).unwrap();
    assert!(drv.end_capture(S).unwrap(), "the pool grew on the virtual memory API without breaking the capture");
    assert!(matches!(a.sleep(0, pool, SleepMode::Offload), Err(Error::Capture(_))), "not while routed for capture");
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(drv.counts().capture_violations, 0);
    fill(input, 4 * MIB, 1);
    fill(output, MIB, 2);
    // The cache does not take the graph's free pages (scratch is written at every replay).
    a.empty_cache(0).unwrap();
    let reserved = a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current as usize;
    assert!(reserved >= 7 * MIB, "{reserved}");
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    assert_eq!(drv.used(0), 0);
    a.wake(0, pool).unwrap();
    assert_eq!(drv.used(0), reserved);
    assert!(holds(input, 4 * MIB, 1) && holds(output, MIB, 2));
    fill(scratch, 2 * MIB, 3);
    check(&a);
}

#[test]
fn the_summary_shows_the_sleeping_bytes() {
    let (a, _) = sim_with(1, 1 << 30, default_config());
    let p = a.malloc(5 * MIB, 0, S).unwrap();
    assert!(!a.memory_summary(0).unwrap().contains("Sleeping"), "no line before any sleep");
    a.sleep(0, 0, SleepMode::Discard).unwrap();
    let text = a.memory_summary(0).unwrap();
    assert!(text.contains("Sleeping (in reserved, given back): 6.00 MiB now, 6.00 MiB at peak"), "{text}");
    a.wake(0, 0).unwrap();
    let text = a.memory_summary(0).unwrap();
    assert!(text.contains("Sleeping (in reserved, given back): 0 bytes now, 6.00 MiB at peak"), "{text}");
    // The pages went straight back to the driver, not through the pages held unmapped.
    assert_eq!(a.stats(0).unwrap().unmapped_held_bytes.peak, 0);
    a.free(p).unwrap();
}
