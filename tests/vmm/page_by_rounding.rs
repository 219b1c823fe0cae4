//! The page by rounding on the simulated device (gpupool's default, issue 39): a growth for a
//! request of 20 MiB and more maps 2 MiB pages where they map fewer bytes than its large
//! pages, at most 64 of them, and where they save at least a 480th of what the pool maps;
//! large pages otherwise; and 2 MiB pages last when the device has no room for the large ones,
//! which `largest_allocatable` counts.
use crate::common;

use common::ladder::{ladder, touch_ends};
use common::{MIB, check, sim_with};

/// Pages created by a `malloc` of `size` bytes on stream 0x10: (created, their bytes).
fn grow(a: &gpupool::Allocator, drv: &gpupool::driver::sim::SimDriver, size: usize) -> (u64, u64, usize) {
    let (c0, r0) = (drv.counts().mem_create, a.stats(0).unwrap().reserved_bytes.all.current);
    let p = a.malloc(size, 0, 0x10).unwrap();
    touch_ends(p, size, 3);
    let (c1, r1) = (drv.counts().mem_create, a.stats(0).unwrap().reserved_bytes.all.current);
    (p, c1 - c0, (r1 - r0) as usize)
}

#[test]
fn a_growth_maps_the_pages_that_round_least() {
    let (a, drv) = sim_with(1, 4 << 30, ladder(16));
    // Whole 20 MiB pages: the large ones map no more, and ten times fewer.
    let (whole, pages, bytes) = grow(&a, &drv, 40 * MIB);
    assert_eq!((pages, bytes), (2, 40 * MIB));
    // 21 MiB maps 22 in 2 MiB pages, not 40.
    let (p21, pages, bytes) = grow(&a, &drv, 21 * MIB);
    assert_eq!((pages, bytes), (11, 22 * MIB));
    // 101 MiB after the 1 MiB left free past the 21 MiB block: 50 small pages rather than
    // 120 MiB of large ones.
    let (p101, pages, bytes) = grow(&a, &drv, 101 * MIB);
    assert_eq!((pages, bytes), (50, 100 * MIB));
    // 201 MiB would be 101 small pages, past 64: large ones.
    let (p201, pages, bytes) = grow(&a, &drv, 201 * MIB);
    assert_eq!((pages, bytes), (11, 220 * MIB));
    check(&a);
    for p in [whole, p21, p101, p201] {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    assert_eq!((drv.used(0), drv.live_vmm()), (0, (0, 0)));
}

#[test]
fn a_saving_small_against_what_the_pool_maps_takes_large_pages() {
    let (a, drv) = sim_with(1, 4 << 30, ladder(16));
    // 1,200 MiB: fifteen 80 MiB pages.
    let (big, pages, bytes) = grow(&a, &drv, 1200 * MIB);
    assert_eq!((pages, bytes), (15, 1200 * MIB));
    // 21 MiB saves 18 MiB in small pages, more than a 480th of the 1,222 MiB mapped.
    let (p21, pages, bytes) = grow(&a, &drv, 21 * MIB);
    assert_eq!((pages, bytes), (11, 22 * MIB));
    // 58 MiB would save 2 MiB (58 small pages' bytes against 60 of large ones), less than
    // a 480th of 1,280 MiB: three large pages rather than 29 small ones.
    let (p58, pages, bytes) = grow(&a, &drv, 58 * MIB);
    assert_eq!((pages, bytes), (3, 60 * MIB));
    check(&a);
    for p in [big, p21, p58] {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    assert_eq!((drv.used(0), drv.live_vmm()), (0, (0, 0)));
}

#[test]
fn a_large_ranges_free_tail_counts() {
    let (a, drv) = sim_with(1, 4 << 30, ladder(16));
    // The 40 MiB freed at a large range's end and 20 MiB more hold 50 MiB: one large page,
    // where 2 MiB pages would map all 50.
    let (whole, _, _) = grow(&a, &drv, 40 * MIB);
    a.free(whole).unwrap();
    let (p50, pages, bytes) = grow(&a, &drv, 50 * MIB);
    assert_eq!((p50, pages, bytes), (whole, 1, 20 * MIB));
    check(&a);
    a.free(p50).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!((drv.used(0), drv.live_vmm()), (0, (0, 0)));
}

#[test]
fn without_room_for_large_pages_a_request_maps_small_ones_and_largest_allocatable_says_so() {
    // 210 MiB: 201 MiB takes 220 MiB of large pages, which do not fit, or 202 of small ones.
    let (a, drv) = sim_with(1, 210 * MIB, ladder(16));
    let answer = a.largest_allocatable(0, 0x10).unwrap();
    assert!(answer >= 201 * MIB, "{answer}");
    let p = a.malloc(201 * MIB, 0, 0x10).unwrap();
    touch_ends(p, 201 * MIB, 9);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, (202 * MIB) as i64);
    check(&a);
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!((drv.used(0), drv.live_vmm()), (0, (0, 0)));
}

#[test]
fn twenty_mib_pages_at_any_size_and_the_rule_keep_large_pages() {
    for (per_request, reclaim) in [(0, false), (16, true)] {
        let mut config = ladder(per_request);
        config.expandable_reclaim = reclaim;
        let (a, drv) = sim_with(1, 4 << 30, config);
        let (p, pages, bytes) = grow(&a, &drv, 21 * MIB);
        assert_eq!((pages, bytes), (2, 40 * MIB), "{per_request} {reclaim}");
        a.free(p).unwrap();
        a.empty_cache(0).unwrap();
        assert_eq!(drv.used(0), 0);
    }
}
