//! The device's pool of physical pages held unmapped (`caching::expandable::page_pool`) on the
//! simulated device: handles unmapped by one stream mapped by another, and held pages released
//! by `empty_cache`, the out-of-memory path, the memory fraction and garbage collection, or
//! given back by a growth that unwinds.

use crate::common;

use std::sync::Arc;

use common::{MIB, check, sim_with};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};

use crate::expandable_support::{PAGE, all_given_back, cuda, expandable, reclaiming, touch};

/// The handles of pages one stream unmaps are mapped by another stream's growth: with the
/// high-water rule, stream 0x10's four free pages are unmapped when stream 0x20 grows past the
/// mark, and stream 0x20 maps their handles, with no `cuMemCreate` and no `cuMemRelease`.
/// With the rule off nothing is unmapped, so nothing is held, and the growth creates.
#[test]
fn a_page_unmapped_by_one_stream_is_mapped_by_another_with_its_handle() {
    for reclaim in [true, false] {
        let (a, drv) = sim_with(1, 1 << 30, Config { expandable_reclaim: reclaim, ..expandable() });
        let one = a.malloc(4 * PAGE, 0, 0x10).unwrap();
        touch(one, 4 * PAGE, 1);
        a.free(one).unwrap();
        let c0 = drv.counts();
        let two = a.malloc(4 * PAGE, 0, 0x20).unwrap();
        touch(two, 4 * PAGE, 2);
        let c = drv.counts();
        let d = |f: fn(&gpupool::driver::sim::SimCounts) -> u64| f(&c) - f(&c0);
        let (create, unmap) = if reclaim { (0, 4) } else { (4, 0) };
        let calls = (d(|c| c.mem_create), d(|c| c.mem_map), d(|c| c.mem_unmap), d(|c| c.mem_release));
        assert_eq!(calls, (create, 4, unmap, 0), "reclaim {reclaim}: create, map, unmap, release");
        let s = a.stats(0).unwrap();
        let h = s.unmapped_held_bytes;
        let moved = if reclaim { 4 * PAGE as i64 } else { 0 };
        assert_eq!((h.current, h.peak, h.allocated, h.freed), (0, moved, moved, moved), "reclaim {reclaim}");
        assert_eq!(drv.used(0), s.reserved_bytes.all.current as usize);
        check(&a);
        a.free(two).unwrap();
        all_given_back(&a, &drv);
    }
}

/// Held pages at rest, as a driver failure leaves them: with the rule on, stream 0x10's four
/// free pages are unmapped into the device's pool when stream 0x20 grows past the mark, and
/// mapping them there fails (an injected CUDA error), so they go back to the pool, held, and
/// the request falls back to an ordinary segment (20 MiB, PyTorch's for a request of 8 MiB).
/// Returns what that request got.
fn held_after_a_failed_map(
    capacity: usize,
    config: Config,
) -> (Allocator, Arc<SimDriver>, Result<u64, gpupool::Error>) {
    let (a, drv) = sim_with(1, capacity, config);
    let one = a.malloc(4 * PAGE, 0, 0x10).unwrap();
    a.free(one).unwrap();
    drv.inject(SimOp::MemMap, 0, SimFault::Fail(cuda("cuMemMap")));
    let two = a.malloc(4 * PAGE, 0, 0x20);
    (a, drv, two)
}

#[test]
fn empty_cache_releases_every_held_page_and_retries_one_the_driver_refused() {
    let (a, drv, two) = held_after_a_failed_map(1 << 30, reclaiming());
    let two = two.unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!((drv.counts().mem_alloc, s.reserved_bytes.all.current), (1, 20 * MIB as i64), "an ordinary segment");
    assert_eq!(s.unmapped_held_bytes.current, 4 * PAGE as i64);
    assert_eq!(drv.used(0), 20 * MIB + 4 * PAGE, "held pages are device memory");
    assert_eq!(drv.live_vmm().1, 4, "four handles alive, mapped nowhere (the check asks the driver)");
    assert!(a.memory_summary(0).unwrap().contains("Unmapped pages held: 8.00 MiB now"));
    check(&a);
    // A release the driver refuses: that page stays held and counted, the others go.
    drv.inject(SimOp::MemRelease, 1, SimFault::Fail(cuda("cuMemRelease")));
    assert!(a.empty_cache(0).is_err());
    assert_eq!((a.stats(0).unwrap().unmapped_held_bytes.current, drv.live_vmm().1), (PAGE as i64, 1));
    check(&a);
    a.free(two).unwrap();
    all_given_back(&a, &drv);
    assert_eq!(a.stats(0).unwrap().unmapped_held_bytes.current, 0);
}

/// The held pages take 8 MiB of a 24 MiB device: the ordinary segment of 20 MiB fails, the
/// out-of-memory path releases them, and the retry grows the expandable segment.
#[test]
fn out_of_memory_with_held_pages_releases_them_and_succeeds() {
    let (a, drv, two) = held_after_a_failed_map(12 * PAGE, reclaiming());
    let two = two.unwrap();
    touch(two, 4 * PAGE, 3);
    let s = a.stats(0).unwrap();
    assert_eq!((s.num_alloc_retries, s.num_ooms, drv.counts().mem_alloc), (1, 0, 1));
    assert_eq!((s.unmapped_held_bytes.current, s.unmapped_held_bytes.peak), (0, 4 * PAGE as i64));
    assert_eq!((drv.used(0), s.reserved_bytes.all.current), (4 * PAGE, 4 * PAGE as i64));
    check(&a);
    a.free(two).unwrap();
    all_given_back(&a, &drv);
}

/// The memory fraction counts held pages: with 20 MiB reserved and 8 MiB held under a limit of
/// 44 MiB, another ordinary segment of 20 MiB (growths that fail again fall back to one) would
/// pass the limit, so the out-of-memory path releases the held pages and the retry grows
/// by 8 MiB. Counting reserved bytes alone (PyTorch, which holds no pages), the segment would
/// have fit, and the device would hold 48 MiB.
#[test]
fn a_memory_fraction_counts_held_pages() {
    let (a, drv, two) = held_after_a_failed_map(64 * PAGE, reclaiming());
    let two = two.unwrap();
    a.set_memory_fraction(44.0 / 128.0, 0).unwrap();
    // Both attempts before the out-of-memory path fail to map, and fall back.
    for _ in 0..2 {
        drv.inject(SimOp::MemMap, 0, SimFault::Fail(cuda("cuMemMap")));
    }
    let three = a.malloc(4 * PAGE, 0, 0x30).unwrap();
    touch(three, 4 * PAGE, 4);
    let s = a.stats(0).unwrap();
    assert_eq!((s.num_alloc_retries, s.unmapped_held_bytes.current), (1, 0), "released to fit the limit");
    assert_eq!((drv.used(0), drv.counts().mem_alloc), (28 * MIB, 1), "no second ordinary segment");
    check(&a);
    for p in [two, three] {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}

/// `garbage_collection_threshold` releases held pages before cached segments: 28 MiB of a
/// 64 MiB limit are over a threshold of 40% (25.6 MiB), so the next request that misses the
/// cache releases two held pages, and maps a third.
#[test]
fn garbage_collection_releases_held_pages_first() {
    let config = Config { garbage_collection_threshold: 0.4, ..reclaiming() };
    let (a, drv, two) = held_after_a_failed_map(64 * PAGE, config);
    let two = two.unwrap();
    assert_eq!(a.stats(0).unwrap().unmapped_held_bytes.current, 4 * PAGE as i64);
    a.set_memory_fraction(0.5, 0).unwrap();
    let released = drv.counts().mem_release;
    let three = a.malloc(PAGE, 0, 0x30).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!((drv.counts().mem_release - released, s.unmapped_held_bytes.current), (2, PAGE as i64));
    assert_eq!((s.num_alloc_retries, s.reserved_bytes.all.current), (0, 22 * MIB as i64));
    check(&a);
    for p in [two, three] {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}

/// A growth that took held handles and then unwinds before it maps them (a panic in the
/// wait for the stream's work before the high-water rule unmaps this stream's free page) gives
/// them back to the pool, and the event it waited on back to the stream's idle events: the
/// memory fraction's count stays reserved plus held.
#[test]
fn a_growth_that_unwinds_gives_its_held_handles_back() {
    let (a, drv) = sim_with(1, 1 << 30, reclaiming());
    // As `held_after_a_failed_map`, beside a large live block (so that the pool's bound, an
    // eighth of the rest, keeps the held pages after each growth below).
    let big = a.malloc(32 * PAGE, 0, 0x10).unwrap();
    let one = a.malloc(4 * PAGE, 0, 0x10).unwrap();
    a.free(one).unwrap();
    drv.inject(SimOp::MemMap, 0, SimFault::Fail(cuda("cuMemMap")));
    let two = a.malloc(4 * PAGE, 0, 0x20).unwrap();
    // Stream 0x10 maps two held pages, and frees the first: one free page, two held.
    let r1 = a.malloc(PAGE, 0, 0x10).unwrap();
    let r2 = a.malloc(PAGE, 0, 0x10).unwrap();
    a.free(r1).unwrap();
    assert_eq!(a.stats(0).unwrap().unmapped_held_bytes.current, 2 * PAGE as i64);
    // Four pages: two held, two past the mark, so the rule unmaps the free page first.
    drv.inject(SimOp::EventSynchronize, 0, SimFault::Panic);
    let grown = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.malloc(4 * PAGE, 0, 0x10)));
    assert!(grown.is_err(), "the injected panic unwinds");
    assert_eq!(a.stats(0).unwrap().unmapped_held_bytes.current, 2 * PAGE as i64, "both back in the pool");
    check(&a);
    a.empty_cache(0).unwrap();
    assert_eq!(drv.live_events(), 0, "the event is idle again, and destroyed by empty_cache");
    for p in [big, r2, two] {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}
