//! Unit tests of how expandable segments' address ranges are sized, and their pages.

use super::*;

#[test]
fn ranges_grow_with_use_and_stay_whole_pages() {
    let p = ExpandablePolicy {
        small_page: 2 << 20,
        large_page: 20 << 20,
        huge_from: usize::MAX,
        huge_page: 20 << 20,
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
