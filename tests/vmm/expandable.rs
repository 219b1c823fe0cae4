//! Expandable segments (`expandable_segments:True`) on the simulated device: growth across
//! pages, giving every page back, out of memory while growing, faults in the virtual memory
//! calls, the fallback to ordinary segments, and the device's pool of physical pages held
//! unmapped (`caching::expandable::page_pool`).
use crate::common;

use std::sync::Arc;

use common::{MIB, check, sim_with};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SIM_GRANULARITY, SimDriver, SimFault, SimOp};

const PAGE: usize = SIM_GRANULARITY;

fn expandable() -> Config {
    Config { expandable_segments: true, expandable_large_pages: false, ..Config::default() }
}

/// Empties the cache (every block is freed) and checks that the driver has everything back:
/// no memory, no page handle, no address range, no ordinary segment.
fn all_given_back(a: &gpupool::Allocator, drv: &gpupool::driver::sim::SimDriver) {
    a.empty_cache(0).unwrap();
    check(a);
    assert_eq!((drv.used(0), drv.live_vmm(), drv.live_allocations()), (0, (0, 0), 0));
    assert_eq!(a.stats(0).unwrap().segment.all.current, 0);
}

/// Writes `byte` over `size` bytes at `ptr` and reads it back (the simulated device's memory
/// is host memory: an unmapped page would fault here).
fn touch(ptr: u64, size: usize, byte: u8) {
    // SAFETY: `ptr` is a live block of at least `size` bytes handed out by the allocator.
    unsafe {
        let p = ptr as *mut u8;
        p.write_bytes(byte, size);
        assert_eq!(*p.add(size - 1), byte);
    }
}

#[test]
fn a_segment_grows_across_pages_and_keeps_its_blocks_in_place() {
    let (a, drv) = sim_with(1, 1 << 30, expandable());
    // 1.5 pages, then 2 pages: the second block follows the first in the same segment, and
    // the segment grows by whole pages only.
    let first = a.malloc(PAGE + PAGE / 2, 0, 0x10).unwrap();
    touch(first, PAGE + PAGE / 2, 1);
    let s = a.stats(0).unwrap();
    assert_eq!((s.reserved_bytes.large_pool.current, s.segment.large_pool.current), (2 * PAGE as i64, 1));
    let c = drv.counts();
    assert_eq!((c.address_reserve, c.mem_create, c.mem_map), (1, 2, 2), "one range, a handle mapped per page");
    let second = a.malloc(2 * PAGE, 0, 0x10).unwrap();
    assert_eq!(second, first + (PAGE + PAGE / 2) as u64, "the segment grew instead of a new one");
    touch(second, 2 * PAGE, 2);
    let s = a.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.large_pool.current, 4 * PAGE as i64);
    assert_eq!(s.segment.large_pool.current, 1);
    assert_eq!(drv.used(0), 4 * PAGE, "reserved is what is mapped");
    assert_eq!((drv.counts().address_reserve, drv.counts().mem_map), (1, 4));
    // SAFETY: the first block is live and was written above.
    assert_eq!(unsafe { *(first as *const u8) }, 1, "growing left the first block's contents alone");
    // The best fit may span free memory and a new page: a block freed at the end is grown.
    a.free(second).unwrap();
    let third = a.malloc(3 * PAGE, 0, 0x10).unwrap();
    assert_eq!(third, second);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.large_pool.current, 5 * PAGE as i64);
    assert_eq!(a.stats(0).unwrap().inactive_split.all.current, 0, "no inactive split in expandable segments");
    check(&a);
    a.free(first).unwrap();
    a.free(third).unwrap();
    check(&a);
    all_given_back(&a, &drv);
    assert_eq!(drv.counts().mem_unmap, 5, "every page unmapped, one call each");
}

#[test]
fn empty_cache_gives_every_page_and_range_back() {
    let (a, drv) = sim_with(1, 1 << 30, expandable());
    let ptrs: Vec<u64> = (0..40).map(|i| a.malloc(300 * 1024 * (1 + i % 7), 0, 0x10 * (1 + i % 3)).unwrap()).collect();
    assert!(drv.live_vmm().0 >= 3, "one range per stream and pool");
    // Frees in an order that leaves holes, then some allocations again.
    for &p in ptrs.iter().step_by(2) {
        a.free(p).unwrap();
    }
    check(&a);
    let syncs = drv.counts().device_synchronize;
    a.empty_cache(0).unwrap();
    check(&a);
    assert!(drv.counts().device_synchronize > syncs, "unmapping waits for the device");
    let s = a.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.all.current as usize, drv.used(0));
    assert!(s.reserved_bytes.all.current < s.reserved_bytes.all.peak, "free pages between live blocks went back");
    for &p in ptrs.iter().skip(1).step_by(2) {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}

#[test]
fn out_of_memory_while_growing_rolls_back_and_release_and_retry_serves() {
    let (a, drv) = sim_with(1, 16 * PAGE, expandable());
    let big = a.malloc(10 * PAGE, 0, 0x10).unwrap();
    let other = a.malloc(4 * PAGE, 0, 0x20).unwrap();
    a.free(other).unwrap();
    // 8 more pages: 2 free on the device, 4 cached by the other stream. Growing fails halfway,
    // what it mapped is undone, the cache is released (the other stream's pages) and the retry
    // fits... not: 2 + 4 < 8, so out of memory, with nothing left mapped by the attempt.
    let before = a.stats(0).unwrap();
    let err = a.malloc(8 * PAGE, 0, 0x10).unwrap_err();
    assert!(err.to_string().contains("out of memory"), "{err}");
    let s = a.stats(0).unwrap();
    assert_eq!(s.num_alloc_retries, before.num_alloc_retries + 1);
    assert_eq!(s.reserved_bytes.all.current, 10 * PAGE as i64, "the other stream's cached pages went back");
    assert_eq!(drv.used(0), 10 * PAGE);
    check(&a);
    // 6 pages fit once the other stream's cache is gone.
    let more = a.malloc(6 * PAGE, 0, 0x10).unwrap();
    assert_eq!(drv.used(0), 16 * PAGE);
    touch(more, 6 * PAGE, 3);
    a.free(more).unwrap();
    a.free(big).unwrap();
    all_given_back(&a, &drv);
}

#[test]
fn a_failed_virtual_memory_call_falls_back_to_an_ordinary_segment() {
    let (a, drv) = sim_with(1, 1 << 30, expandable());
    let cuda = |call: &'static str| DriverError::Cuda { call, code: 800, name: "CUDA_ERROR_NOT_PERMITTED".into() };
    drv.inject(SimOp::MemCreate, 0, SimFault::Fail(cuda("cuMemCreate")));
    let p = a.malloc(3 * MIB, 0, 0).unwrap();
    assert_eq!(drv.counts().mem_alloc, 1, "served by cuMemAlloc");
    touch(p, 3 * MIB, 4);
    let q = a.malloc(3 * MIB, 0, 0).unwrap();
    touch(q, 3 * MIB, 5);
    check(&a);
    a.free(p).unwrap();
    a.free(q).unwrap();
    all_given_back(&a, &drv);
}

#[test]
fn a_range_that_fills_up_is_followed_by_a_larger_one() {
    // A device of 64 pages: a first large range of an eighth of it (8 pages); past that, a
    // second range of at least twice the first.
    let (a, drv) = sim_with(1, 64 * PAGE, expandable());
    let p = a.malloc(7 * PAGE, 0, 0).unwrap();
    let q = a.malloc(5 * PAGE, 0, 0).unwrap();
    assert_eq!(drv.live_vmm().0, 2);
    assert_eq!(a.stats(0).unwrap().segment.large_pool.current, 2);
    touch(q, 5 * PAGE, 6);
    check(&a);
    a.free(p).unwrap();
    a.free(q).unwrap();
    all_given_back(&a, &drv);
}

#[test]
fn blocks_awaiting_events_keep_their_pages_mapped() {
    let (a, drv) = sim_with(1, 1 << 30, expandable());
    let p = a.malloc(4 * PAGE, 0, 0x10).unwrap();
    a.record_stream(p, 0x20).unwrap();
    drv.hold_stream(0x20);
    a.free(p).unwrap();
    // empty_cache waits for the event (the simulated wait completes the stream's work), then
    // the block is free and its pages go back.
    all_given_back(&a, &drv);
    drv.release_stream(0x20);
}

/// gpupool's high-water rule (`GPUPOOL_EXPANDABLE_RECLAIM`, on by default): a stream's free
/// pages are unmapped before its segment grows past the most the device has had reserved, so
/// that a hole left by one request holds part of the next; with the rule off, PyTorch's
/// behaviour, the segment grows and the hole stays mapped.
#[test]
fn growth_past_the_high_water_mark_unmaps_free_pages_first() {
    for reclaim in [true, false] {
        let (a, drv) = sim_with(1, 1 << 30, Config { expandable_reclaim: reclaim, ..expandable() });
        let first = a.malloc(10 * PAGE, 0, 0x10).unwrap();
        let second = a.malloc(10 * PAGE, 0, 0x10).unwrap();
        a.free(first).unwrap();
        let c0 = drv.counts();
        // 20 pages do not fit the 10-page hole: the segment grows at its end.
        let third = a.malloc(20 * PAGE, 0, 0x10).unwrap();
        touch(third, 20 * PAGE, 3);
        let s = a.stats(0).unwrap();
        let (peak, unmapped) = if reclaim { (30, 1) } else { (40, 0) };
        assert_eq!(s.reserved_bytes.all.peak, peak * PAGE as i64, "reclaim {reclaim}");
        assert_eq!(drv.used(0), peak as usize * PAGE, "reserved is what is mapped");
        let c1 = drv.counts();
        let waits = (c1.device_synchronize - c0.device_synchronize, c1.event_synchronize - c0.event_synchronize);
        assert_eq!(waits, (0, unmapped), "the stream's work waited for before unmapping, not the device");
        // A request that fits a free block is served from it, not from the unmapped hole
        // (without the rule, the hole is still mapped: the two free blocks coalesced).
        a.free(second).unwrap();
        let fourth = a.malloc(10 * PAGE, 0, 0x10).unwrap();
        assert_eq!(fourth, if reclaim { second } else { first });
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.peak, peak * PAGE as i64);
        check(&a);
        for p in [third, fourth] {
            a.free(p).unwrap();
        }
        all_given_back(&a, &drv);
    }
}

/// The rule across streams: the free pages of another stream's segment are unmapped (the
/// growing stream's lock is not held meanwhile) before a stream grows past the mark.
#[test]
fn another_streams_free_pages_hold_the_growth_of_a_stream() {
    for reclaim in [true, false] {
        let (a, drv) = sim_with(1, 1 << 30, Config { expandable_reclaim: reclaim, ..expandable() });
        let one = a.malloc(16 * PAGE, 0, 0x10).unwrap();
        let kept = a.malloc(PAGE / 2, 0, 0x10).unwrap();
        a.free(one).unwrap();
        let two = a.malloc(16 * PAGE, 0, 0x20).unwrap();
        touch(two, 16 * PAGE, 5);
        let s = a.stats(0).unwrap();
        let peak = if reclaim { 17 } else { 33 };
        assert_eq!(s.reserved_bytes.all.peak, peak * PAGE as i64, "reclaim {reclaim}");
        check(&a);
        // Stream 0x10 grows again, into its unmapped pages, under the mark if stream 0x20's
        // block is freed first.
        a.free(two).unwrap();
        let three = a.malloc(16 * PAGE, 0, 0x10).unwrap();
        touch(three, 16 * PAGE, 6);
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.peak, peak * PAGE as i64);
        check(&a);
        for p in [kept, three] {
            a.free(p).unwrap();
        }
        all_given_back(&a, &drv);
    }
}

fn reclaiming() -> Config {
    Config { expandable_reclaim: true, ..expandable() }
}

fn cuda(call: &'static str) -> DriverError {
    DriverError::Cuda { call, code: 999, name: "CUDA_ERROR_UNKNOWN".into() }
}

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

/// The high-water rule unmaps the growing stream's own free pages once that stream's queued
/// work has run (an event recorded on it and waited for), without waiting for the other
/// streams' work or synchronising the device; if the event cannot be recorded, nothing is
/// unmapped and the growth goes past the mark instead.
#[test]
fn the_rule_waits_for_the_growing_streams_work_only() {
    use gpupool::driver::Driver;
    for fail in [false, true] {
        let (a, drv) = sim_with(1, 1 << 30, reclaiming());
        let first = a.malloc(10 * PAGE, 0, 0x10).unwrap();
        let second = a.malloc(10 * PAGE, 0, 0x10).unwrap();
        // Both streams busy: work queued on 0x10 before `first` is freed may still read it.
        let (mine, other) = (drv.event_create(0).unwrap(), drv.event_create(0).unwrap());
        for (ev, stream) in [(mine, 0x10), (other, 0x20)] {
            drv.hold_stream(stream);
            drv.event_record(0, ev, stream).unwrap();
        }
        a.free(first).unwrap();
        let c0 = drv.counts();
        if fail {
            drv.inject(SimOp::EventRecord, 0, SimFault::Fail(cuda("cuEventRecord")));
        }
        let third = a.malloc(20 * PAGE, 0, 0x10).unwrap();
        touch(third, 20 * PAGE, 7);
        let c1 = drv.counts();
        assert_eq!(c1.device_synchronize, c0.device_synchronize, "fail {fail}: the device is not synchronised");
        assert_eq!(c1.mem_unmap - c0.mem_unmap, if fail { 0 } else { 10 }, "fail {fail}: pages unmapped");
        let peak = if fail { 40 } else { 30 };
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.peak, peak * PAGE as i64, "fail {fail}");
        assert_eq!(drv.event_query(mine).unwrap(), !fail, "fail {fail}: the growing stream's work ran first");
        assert!(!drv.event_query(other).unwrap(), "fail {fail}: the other stream's work was not waited for");
        check(&a);
        for stream in [0x10, 0x20] {
            drv.release_stream(stream);
        }
        for ev in [mine, other] {
            drv.event_destroy(0, ev);
        }
        for p in [second, third] {
            a.free(p).unwrap();
        }
        all_given_back(&a, &drv);
        assert_eq!(drv.live_events(), 0, "fail {fail}: no event left behind");
    }
}

/// `GPUPOOL_EXPANDABLE_LARGE_PAGES`: a request of 20 MiB or more grows a range of 20 MiB
/// pages, a smaller one a range of 2 MiB pages, and the page pool keeps each size apart; a map
/// that fails leaves nothing behind.
#[test]
fn large_requests_map_large_pages_in_ranges_of_their_own() {
    const HUGE: usize = 20 * MIB;
    for reclaim in [false, true] {
        let config = Config { expandable_large_pages: true, expandable_reclaim: reclaim, ..expandable() };
        let (a, drv) = sim_with(1, 1 << 30, config);
        let c0 = drv.counts();
        let big = a.malloc(2 * HUGE, 0, 0x10).unwrap();
        touch(big, 2 * HUGE, 1);
        let c1 = drv.counts();
        assert_eq!(c1.mem_map - c0.mem_map, 2, "reclaim {reclaim}: two pages of 20 MiB");
        let small = a.malloc(3 * MIB, 0, 0x10).unwrap();
        touch(small, 3 * MIB, 2);
        assert_eq!(drv.counts().mem_map - c1.mem_map, 2, "reclaim {reclaim}: two pages of 2 MiB");
        assert!(small.abs_diff(big) >= (2 * HUGE) as u64, "reclaim {reclaim}: another range");
        let s = a.stats(0).unwrap();
        assert_eq!((s.segment.all.current, s.reserved_bytes.all.current), (2, (2 * HUGE + 4 * MIB) as i64));
        check(&a);
        // A third large page fails to map: the growth falls back to an ordinary segment, and
        // the large range is as it was.
        drv.inject(SimOp::MemMap, 0, SimFault::Fail(cuda("cuMemMap")));
        let third = a.malloc(HUGE, 0, 0x10).unwrap();
        touch(third, HUGE, 3);
        check(&a);
        // Freed, the large block serves a large request again from the cache.
        a.free(big).unwrap();
        let again = a.malloc(2 * HUGE, 0, 0x10).unwrap();
        assert_eq!(again, big, "reclaim {reclaim}");
        for p in [again, small, third] {
            a.free(p).unwrap();
        }
        all_given_back(&a, &drv);
    }
}

/// With large pages and the rule, a growth moves free pages of its own page size first (the
/// only handles it can map: free 20 MiB pages move to it without a handle created), then
/// unmaps and releases free pages of the smaller size, so that it creates within the mark what
/// their memory covers (`expandable::cross`; until 2026-11-28 the 2 MiB pages stayed mapped
/// while the range grew past the mark).
#[test]
fn the_rule_moves_pages_a_growth_can_map_and_releases_smaller_ones() {
    const HUGE: usize = 20 * MIB;
    let config = Config { expandable_large_pages: true, ..reclaiming() };
    let (a, drv) = sim_with(1, 1 << 30, config);
    // Free pages of both sizes: 8 MiB in 2 MiB pages, 40 MiB in 20 MiB pages.
    let small = a.malloc(8 * MIB, 0, 0x10).unwrap();
    let big = a.malloc(2 * HUGE, 0, 0x10).unwrap();
    let kept = a.malloc(HUGE, 0, 0x10).unwrap();
    for p in [small, big] {
        a.free(p).unwrap();
    }
    // 60 MiB do not fit the 40 MiB hole: the growth passes the mark by 60 MiB.
    let c0 = drv.counts();
    let grown = a.malloc(3 * HUGE, 0, 0x10).unwrap();
    touch(grown, 3 * HUGE, 9);
    let c1 = drv.counts();
    assert_eq!(c1.mem_unmap - c0.mem_unmap, 2 + 4, "the two free 20 MiB pages, then the four of 2 MiB");
    assert_eq!(c1.mem_release - c0.mem_release, 4, "the 2 MiB pages' handles go back to the driver");
    assert_eq!(c1.mem_create - c0.mem_create, 1, "one 20 MiB page made, two moved");
    let s = a.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.all.current, (4 * HUGE) as i64);
    assert_eq!(s.unmapped_held_bytes.current, 0);
    assert_eq!(drv.used(0), 4 * HUGE, "the growth passed the mark by what the small pages did not cover");
    check(&a);
    for p in [kept, grown] {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}

/// Two blocks of 10 pages on `stream`, the first freed: a 10-page hole that a 20-page request
/// does not fit, so that its growth passes the high-water mark. Returns the second block.
fn ten_page_hole(a: &Allocator, stream: usize) -> u64 {
    let first = a.malloc(10 * PAGE, 0, stream).unwrap();
    let second = a.malloc(10 * PAGE, 0, stream).unwrap();
    a.free(first).unwrap();
    second
}

/// On the per-thread default stream (one handle, each thread's own stream) the rule cannot wait
/// for the one stream that used the pages: it synchronises the device.
#[test]
fn the_rule_synchronises_the_device_for_the_per_thread_stream() {
    let (a, drv) = sim_with(1, 1 << 30, reclaiming());
    let second = ten_page_hole(&a, 2);
    let c0 = drv.counts();
    let third = a.malloc(20 * PAGE, 0, 2).unwrap();
    let c1 = drv.counts();
    let waits = (c1.device_synchronize - c0.device_synchronize, c1.event_synchronize - c0.event_synchronize);
    assert_eq!(waits, (1, 0));
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.peak, (30 * PAGE) as i64);
    for p in [second, third] {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}

/// A panic while the rule records its event loses no event: it goes back to the idle ones.
#[test]
fn an_event_whose_record_unwinds_goes_back() {
    let (a, drv) = sim_with(1, 1 << 30, reclaiming());
    let second = ten_page_hole(&a, 0x10);
    drv.inject(SimOp::EventRecord, 0, SimFault::Panic);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.malloc(20 * PAGE, 0, 0x10)));
    assert!(r.is_err(), "the injected panic unwinds");
    check(&a);
    a.free(second).unwrap();
    all_given_back(&a, &drv);
    assert_eq!(drv.live_events(), 0, "the event went back to the idle ones, and was destroyed");
}
