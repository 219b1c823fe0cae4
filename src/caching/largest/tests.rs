use super::*;
use crate::config::Config;

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;

fn seg(pool: PoolKind, page: Option<usize>, blocks: &[(usize, Kind)]) -> SegModel {
    SegModel { base: 0, pool, page, releasable: true, blocks: blocks.to_vec() }
}

fn situation(now: ShardModel, room: usize) -> Situation {
    Situation {
        rules: SizeRules::default(),
        pages: None,
        now,
        room,
        held: Vec::new(),
        others_release: 0,
        budget: usize::MAX,
        others_release_default: 0,
        orphans: 0,
        grow: true,
        release: true,
        deferred: false,
    }
}

#[test]
fn freed_blocks_merge_and_a_wholly_free_segment_is_released() {
    use Kind::*;
    let m = ShardModel {
        segs: vec![
            seg(PoolKind::Large, None, &[(4 * MIB, Free), (6 * MIB, Events), (10 * MIB, Sync)]),
            seg(PoolKind::Large, None, &[(4 * MIB, Free), (16 * MIB, Used)]),
        ],
    };
    let after = m.freeing(&[Events]);
    assert_eq!(after.segs[0].blocks, [(10 * MIB, Free), (10 * MIB, Sync)]);
    assert_eq!(m.release_bytes(), 20 * MIB, "the first segment, once its blocks are all free");
    let (released, freed) = m.freeing(&[Events, Sync]).released();
    assert_eq!((released.segs.len(), freed), (1, 20 * MIB), "the split segment stays");
    // A CUDA graph's segment stays, wholly free or not.
    let kept =
        ShardModel { segs: vec![SegModel { releasable: false, ..seg(PoolKind::Large, None, &[(20 * MIB, Free)]) }] };
    assert_eq!(kept.release_bytes(), 0);
}

#[test]
fn release_unmaps_the_whole_pages_of_free_blocks_and_drops_an_empty_range() {
    use Kind::*;
    let page = Some(PAGE);
    // Offsets: used [0, 1 MiB), free [1, 8 MiB): pages 2..8 MiB unmapped (6 MiB), 1..2 stays
    // free; then unmapped [8, 16 MiB) merges with them.
    let m = ShardModel {
        segs: vec![
            seg(PoolKind::Large, page, &[(MIB, Used), (7 * MIB, Free), (8 * MIB, Unmapped)]),
            seg(PoolKind::Large, page, &[(4 * MIB, Free), (12 * MIB, Unmapped)]),
        ],
    };
    let (after, freed) = m.released();
    assert_eq!(freed, 6 * MIB + 4 * MIB);
    assert_eq!(after.segs.len(), 1, "the second range has nothing mapped: given back");
    assert_eq!(after.segs[0].blocks, [(MIB, Used), (MIB, Free), (14 * MIB, Unmapped)]);
}

#[test]
fn growth_maps_the_first_run_that_holds_the_request() {
    use Kind::*;
    let page = Some(PAGE);
    let m = ShardModel {
        segs: vec![seg(
            PoolKind::Large,
            page,
            &[(4 * MIB, Unmapped), (MIB, Used), (3 * MIB, Free), (12 * MIB, Unmapped)],
        )],
    };
    let a = Attempt::new(m, 0, Vec::new(), usize::MAX);
    // 4 MiB fits the first run (4 unmapped MiB); 5 MiB the second: 3 free MiB and 2 to map.
    assert_eq!(a.pages_to_map(PoolKind::Large, PAGE, 4 * MIB), 4 * MIB);
    assert_eq!(a.pages_to_map(PoolKind::Large, PAGE, 5 * MIB), 2 * MIB);
    assert_eq!(a.pages_to_map(PoolKind::Large, PAGE, 15 * MIB), 12 * MIB);
    assert_eq!(a.pages_to_map(PoolKind::Large, PAGE, 16 * MIB), 16 * MIB, "a new range");
    assert_eq!(a.pages_to_map(PoolKind::Small, PAGE, MIB), PAGE, "the small pool has no range");
    let mut s = situation(a.shard.clone(), 6 * MIB);
    s.pages = Some(ExpandablePolicy {
        small_page: PAGE,
        large_page: PAGE,
        huge_from: usize::MAX,
        huge_page: 20 * MIB,
        pages_per_request: 0,
        small_pages_within: 0,
        small_pages_saving: 0,
        device_total: 80 << 30,
    });
    assert_eq!(largest(&s), 9 * MIB, "the second run: 3 free MiB and 6 mapped");
}

#[test]
fn the_largest_request_is_not_the_largest_that_bisection_would_find() {
    // 15 MiB of room, nothing cached: 14 MiB (a 14 MiB segment) but not 5 MiB (20 MiB).
    let s = situation(ShardModel::default(), 15 * MIB);
    assert_eq!(largest(&s), 14 * MIB);
    assert!(!Attempt::new(ShardModel::default(), 15 * MIB, Vec::new(), usize::MAX).serves(5 * MIB, &s));
    // 3 MiB of room: 1 MiB, a small request in a 2 MiB segment.
    assert_eq!(largest(&situation(ShardModel::default(), 3 * MIB)), MIB);
    assert_eq!(largest(&situation(ShardModel::default(), MIB)), 0);
    // A stream that captures has its cached blocks only.
    let cached =
        ShardModel { segs: vec![seg(PoolKind::Large, None, &[(8 * MIB, Kind::Free), (12 * MIB, Kind::Used)])] };
    let s = Situation { grow: false, ..situation(cached, 1 << 30) };
    assert_eq!(largest(&s), 8 * MIB);
}

#[test]
fn sizes_are_those_round_size_keeps() {
    let plain = SizeRules::default();
    assert_eq!(largest_rounded_within(511, &plain), None);
    assert_eq!(largest_rounded_within(1000, &plain), Some(512));
    let rules = SizeRules::from_config(&Config::default().with_conf("roundup_power2_divisions:4").unwrap());
    // Steps of 256 KiB between 1 and 2 MiB, of 8 MiB between 32 and 64 MiB.
    assert_eq!(largest_rounded_within(1500 << 10, &rules), Some(1280 << 10));
    assert_eq!(largest_rounded_within(47 * MIB, &rules), Some(40 * MIB));
    // The last step below 2^64 (steps of 2^61 from 2^63): no overflow on the way.
    let top = largest_rounded_within(usize::MAX, &rules).unwrap();
    assert_eq!((top, rules::round_size(top, &rules)), (usize::MAX - (1 << 61) + 1, Some(top)));
}
