//! gpupool's high-water rule for expandable segments (`GPUPOOL_EXPANDABLE_RECLAIM`) on the
//! simulated device: free pages unmapped before a segment grows past the mark, across streams,
//! waiting only for the growing stream's work (the device for the per-thread stream), moving
//! pages a growth can map and releasing smaller ones, and events that unwind.

use crate::common;

use common::{MIB, check, sim_with};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::{SimFault, SimOp};

use crate::expandable_support::{PAGE, all_given_back, cuda, expandable, reclaiming, touch};

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
/// The high-water rule unmaps the growing stream's own free pages once that stream's queued
/// work has run (an event recorded on it and waited for), without waiting for the other
/// streams' work or synchronising the device; if the event cannot be recorded, nothing is
/// unmapped and the growth goes past the mark instead.
#[test]
fn the_rule_waits_for_the_growing_streams_work_only() {
    use gpupool::driver::ops::*;
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
