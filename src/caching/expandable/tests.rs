//! Unit tests of how expandable segments' address ranges are sized, and their pages.

use super::*;

#[test]
fn ranges_grow_with_use_and_stay_whole_pages() {
    let p = ExpandablePolicy {
        small_page: 2 << 20,
        large_page: 20 << 20,
        huge_from: usize::MAX,
        huge_page: 20 << 20,
        pages_per_request: 0,
        small_pages_within: 0,
        small_pages_saving: 0,
        device_total: 80 << 30,
    };
    assert_eq!(p.range_size(PoolKind::Large, 1 << 20, 0), Some(10 << 30));
    assert_eq!(p.range_size(PoolKind::Small, 512, 0), Some(1280 << 20));
    assert_eq!(p.range_size(PoolKind::Large, 1 << 20, 10 << 30), Some(20 << 30));
    assert_eq!(p.range_size(PoolKind::Large, 30 << 30, 10 << 30), Some(30 << 30));
    assert_eq!(p.range_size(PoolKind::Large, (30 << 30) + 1, 0), Some((30 << 30) + (20 << 20)));
    assert_eq!(p.range_size(PoolKind::Large, usize::MAX - 4, 0), None);
    let tiny = ExpandablePolicy {
        small_page: 2 << 20,
        large_page: 20 << 20,
        huge_from: usize::MAX,
        huge_page: 20 << 20,
        pages_per_request: 0,
        small_pages_within: 0,
        small_pages_saving: 0,
        device_total: 64 << 20,
    };
    assert_eq!(tiny.range_size(PoolKind::Large, 512, 0), Some(20 << 20));
}

#[test]
fn large_requests_take_large_pages_only_when_asked() {
    let mut p = ExpandablePolicy {
        small_page: 2 << 20,
        large_page: 2 << 20,
        huge_from: usize::MAX,
        huge_page: 20 << 20,
        pages_per_request: 0,
        small_pages_within: 0,
        small_pages_saving: 0,
        device_total: 80 << 30,
    };
    assert_eq!(p.page_for(PoolKind::Large, 64 << 20), 2 << 20, "off: one page size");
    p.huge_from = 20 << 20;
    assert_eq!(p.page_for(PoolKind::Large, (20 << 20) - 512), 2 << 20);
    assert_eq!(p.page_for(PoolKind::Large, 20 << 20), 20 << 20);
    assert_eq!(p.page_for(PoolKind::Small, 20 << 20), 2 << 20, "the small pool keeps its page");
    // A range for a large request is a whole number of its pages.
    assert_eq!(p.range_size(PoolKind::Large, (30 << 30) + 1, 0), Some((30 << 30) + (20 << 20)));
    assert_eq!(p.range_size(PoolKind::Large, (2 << 20) + 1, 0), Some(10 << 30));
}

#[test]
fn very_large_requests_map_few_pages() {
    const MIB: usize = 1 << 20;
    let mut p = ladder_of_80_gib(0);
    // 20 MiB pages up to 16 of them, then each double past 16 of the page before.
    assert_eq!(p.page_for(PoolKind::Large, 320 * MIB), 20 * MIB, "16 pages exactly");
    assert_eq!(p.page_for(PoolKind::Large, 320 * MIB + 512), 40 * MIB);
    assert_eq!(p.page_for(PoolKind::Large, 4 << 30), 320 * MIB, "a 4 GiB request: 13 pages, not 205");
    assert_eq!(p.page_for(PoolKind::Small, 4 << 30), 2 * MIB, "the small pool keeps its page");
    assert_eq!(p.page_for(PoolKind::Large, 19 * MIB), 2 * MIB);
    // Whatever the size, at most 16 pages, and no page past the device's memory.
    let mut edges: Vec<usize> = p.page_edges().collect();
    let sizes: Vec<usize> = p.page_sizes().filter(|s| s.0 == PoolKind::Large).map(|s| s.1).skip(1).collect();
    assert_eq!(sizes.len(), edges.len());
    for (k, (&page, &from)) in sizes.iter().zip(&edges).enumerate() {
        assert_eq!(page, (20 * MIB) << k);
        assert_eq!(p.page_for(PoolKind::Large, from), page, "the edge starts its page");
        assert!(from == 20 * MIB || p.page_for(PoolKind::Large, from - 1) == page / 2);
    }
    assert_eq!(*sizes.last().unwrap(), 80 << 30, "the last page is the device's memory");
    for r in [20 * MIB, 333 * MIB, 1 << 30, (5 << 30) + 7, 80 << 30, usize::MAX / 2, usize::MAX - 4095] {
        let page = p.page_for(PoolKind::Large, r);
        assert!(page <= 80 << 30 && page % (20 * MIB) == 0);
        assert!(page == 80 << 30 || r.div_ceil(page) <= 16, "{r}: {page}");
    }
    // 0: PyTorch's 20 MiB at any size; one edge only.
    p.pages_per_request = 0;
    assert_eq!(p.page_for(PoolKind::Large, 4 << 30), 20 * MIB);
    edges = p.page_edges().collect();
    assert_eq!(edges, [20 * MIB]);
    // One page a request: the page is the request's next power-of-two multiple of 20 MiB.
    p.pages_per_request = 1;
    assert_eq!(p.page_for(PoolKind::Large, 100 * MIB), 160 * MIB);
    assert_eq!(p.page_for(PoolKind::Large, 160 * MIB), 160 * MIB, "one page exactly");
    assert_eq!(p.page_for(PoolKind::Large, 20 * MIB), 20 * MIB);
    // Without large pages, no ladder at all.
    p.huge_from = usize::MAX;
    p.pages_per_request = 16;
    assert_eq!(p.page_edges().count(), 0);
    assert_eq!(p.page_for(PoolKind::Large, 4 << 30), 2 * MIB);
}

#[test]
fn a_growth_without_room_tries_each_smaller_rung_down_to_20_mib() {
    const MIB: usize = 1 << 20;
    let p = ladder_of_80_gib(0);
    let tried = |pool, r| p.pages_tried(pool, r).collect::<Vec<_>>();
    assert_eq!(tried(PoolKind::Large, 1000 * MIB), [80 * MIB, 40 * MIB, 20 * MIB]);
    assert_eq!(tried(PoolKind::Large, 300 * MIB), [20 * MIB]);
    assert_eq!(tried(PoolKind::Large, 19 * MIB), [2 * MIB], "below the ladder: one page");
    assert_eq!(tried(PoolKind::Small, MIB), [2 * MIB]);
    assert_eq!(tried(PoolKind::Large, usize::MAX).len(), 13, "from the device's 80 GiB down");
}

#[test]
fn the_page_by_rounding_adds_small_pages_last_for_large_requests() {
    const MIB: usize = 1 << 20;
    let p = ladder_of_80_gib(64);
    let tried = |pool, r| p.pages_tried(pool, r).collect::<Vec<_>>();
    assert_eq!(tried(PoolKind::Large, 21 * MIB), [20 * MIB, 2 * MIB]);
    assert_eq!(tried(PoolKind::Large, 700 * MIB), [80 * MIB, 40 * MIB, 20 * MIB, 2 * MIB]);
    assert_eq!(tried(PoolKind::Large, 19 * MIB), [2 * MIB], "below large pages: one size");
    assert_eq!(tried(PoolKind::Small, 512), [2 * MIB]);
    // The edges do not move: small pages are tried at every size from `huge_from` on.
    let off = ExpandablePolicy { small_pages_within: 0, ..p };
    assert_eq!(p.page_edges().collect::<Vec<_>>(), off.page_edges().collect::<Vec<_>>());
}

/// The ladder of an 80 GiB device (2 MiB pages, 20 MiB from 20 MiB requests, 16 pages a
/// request) with `small_pages_within` for the page by rounding.
fn ladder_of_80_gib(small_pages_within: usize) -> ExpandablePolicy {
    const MIB: usize = 1 << 20;
    ExpandablePolicy {
        small_page: 2 * MIB,
        large_page: 2 * MIB,
        huge_from: 20 * MIB,
        huge_page: 20 * MIB,
        pages_per_request: 16,
        small_pages_within,
        small_pages_saving: 0,
        device_total: 80 << 30,
    }
}
