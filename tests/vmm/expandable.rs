//! Expandable segments (`expandable_segments:True`) on the simulated device: growth across
//! pages, giving every page back, out of memory while growing, faults in the virtual memory
//! calls, the fallback to ordinary segments, and large pages in ranges of their own. The
//! device's pool of physical pages held unmapped (`caching::expandable::page_pool`) is in
//! `held_pages.rs`, the high-water rule in `expandable_rule.rs`.

use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};

use crate::expandable_support::{PAGE, all_given_back, cuda, expandable, touch};

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
