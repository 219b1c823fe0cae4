//! Unit tests of the device peaks' credit: borrows, surplus given back, settles and resets, on
//! shards' counters with no device.

use super::*;
use crate::caching::counters::Metric;

const BYTES: usize = cell(Metric::AllocatedBytes, StatType::All);

fn spare() -> SpareCredit {
    std::array::from_fn(|_| AtomicI64::new(0))
}

/// What a device does at the end of a call on shard `i`.
fn finish(peaks: &mut Totals, shards: &mut [ShardCounters], i: usize, r: &SpareCredit) -> bool {
    if shards[i].has_surplus {
        give_back(&mut shards[i], r, false);
    }
    if shards[i].needs_settle && !borrow(&mut shards[i], r) {
        let mut refs: Vec<&mut ShardCounters> = shards.iter_mut().collect();
        let mut holds = vec![false; refs.len()];
        settle(peaks, &mut refs, r, &mut holds);
        return true;
    }
    false
}

#[test]
fn credit_moves_between_shards_through_the_spare_credit_without_a_settle() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default(), ShardCounters::default()];
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 100);
    assert!(finish(&mut peaks, &mut s, 0, &r), "a new peak needs a settle");
    assert_eq!(peaks.peak[BYTES], 100);
    s[0].decrease(Metric::AllocatedBytes, PoolKind::Large, 100);
    finish(&mut peaks, &mut s, 0, &r);
    assert_eq!(spare_credit(&r, BYTES), 0, "shard 0 keeps what it once had to borrow");
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 100);
    assert!(finish(&mut peaks, &mut s, 1, &r), "the credit sits with shard 0: settle");
    assert_eq!(peaks.peak[BYTES], 100, "moving bytes to another stream is no new peak");
    s[1].decrease(Metric::AllocatedBytes, PoolKind::Large, 100);
    finish(&mut peaks, &mut s, 1, &r);
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 50);
    finish(&mut peaks, &mut s, 0, &r);
    s[0].decrease(Metric::AllocatedBytes, PoolKind::Large, 50);
    // Shard 1 now holds 100 and keeps 100: nothing to give back; shard 0 holds 100.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 101);
    assert!(finish(&mut peaks, &mut s, 1, &r));
    assert_eq!(peaks.peak[BYTES], 101);
}

#[test]
fn a_surplus_returns_to_the_spare_credit_and_is_borrowed_without_a_settle() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default(), ShardCounters::default()];
    for _ in 0..9 {
        s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 100);
        assert!(finish(&mut peaks, &mut s, 0, &r), "each step is a new peak");
    }
    assert_eq!(peaks.peak[BYTES], 900);
    // Shard 0 grew in steps of 100, so it keeps 100; holding 900, more than 8 times that,
    // it gives the other 800 back.
    s[0].decrease(Metric::AllocatedBytes, PoolKind::Large, 900);
    assert!(!finish(&mut peaks, &mut s, 0, &r));
    assert_eq!(spare_credit(&r, BYTES), 800);
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 200);
    assert!(!finish(&mut peaks, &mut s, 1, &r), "borrowed from the spare credit, no settle");
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 600);
    assert!(!finish(&mut peaks, &mut s, 1, &r), "800 in all: still under the peak");
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 100);
    assert!(!finish(&mut peaks, &mut s, 0, &r), "shard 0 spends what it kept");
    assert_eq!(peaks.peak[BYTES], 900);
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 1);
    assert!(finish(&mut peaks, &mut s, 0, &r), "past the peak: settle");
    assert_eq!(peaks.peak[BYTES], 901);
}

#[test]
fn a_settle_takes_back_what_a_quiet_shard_keeps_but_not_an_active_one() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default(), ShardCounters::default()];
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 100);
    assert!(finish(&mut peaks, &mut s, 0, &r));
    s[0].decrease(Metric::AllocatedBytes, PoolKind::Large, 100);
    finish(&mut peaks, &mut s, 0, &r);
    // Shard 1 runs short while shard 0, active since the last settle, holds the credit.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 50);
    assert!(finish(&mut peaks, &mut s, 1, &r));
    assert_eq!(s[0].cells[BYTES].headroom, 50, "active: keeps what the peak leaves");
    // Shard 0 has been quiet since: the next settle moves its credit to the spare credit, so
    // shard 1 borrows it afterwards instead of settling again.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 40);
    assert!(finish(&mut peaks, &mut s, 1, &r));
    assert_eq!((s[0].cells[BYTES].headroom, spare_credit(&r, BYTES)), (0, 10));
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 10);
    assert!(!finish(&mut peaks, &mut s, 1, &r), "borrowed what shard 0 no longer keeps");
    assert_eq!(peaks.peak[BYTES], 100);
}

#[test]
fn a_rise_and_fall_within_one_call_is_a_peak() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default()];
    s[0].increase(Metric::InactiveSplit, PoolKind::Small, 1);
    s[0].decrease(Metric::InactiveSplit, PoolKind::Small, 1);
    assert!(finish(&mut peaks, &mut s, 0, &r));
    assert_eq!(peaks.peak[cell(Metric::InactiveSplit, StatType::All)], 1);
    assert_eq!(peaks.peak[cell(Metric::InactiveSplit, StatType::Pool(PoolKind::Small))], 1);
}

#[test]
fn reusing_own_credit_needs_no_settle() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default()];
    s[0].increase(Metric::AllocatedBytes, PoolKind::Small, 512);
    finish(&mut peaks, &mut s, 0, &r);
    for _ in 0..10 {
        s[0].decrease(Metric::AllocatedBytes, PoolKind::Small, 512);
        s[0].increase(Metric::AllocatedBytes, PoolKind::Small, 512);
        assert!(!finish(&mut peaks, &mut s, 0, &r));
    }
    let mut refs: Vec<&mut ShardCounters> = s.iter_mut().collect();
    reset(&mut peaks, &mut refs, &r);
    assert_eq!(peaks.peak[BYTES], 512);
}

/// `P = G + sum(h) + R` over every shard, `G` and `h` as they are now.
fn balanced(peaks: &Totals, shards: &[ShardCounters], r: &SpareCredit, cell: usize) -> bool {
    let g: i64 = shards.iter().map(|s| s.cells[cell].current()).sum();
    let h: i64 = shards.iter().map(|s| s.cells[cell].headroom).sum();
    peaks.peak[cell] == g + h + spare_credit(r, cell)
}

#[test]
fn a_borrow_by_a_shard_the_reset_does_not_visit_keeps_the_credit_exact() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default(), ShardCounters::default()];
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 900);
    assert!(finish(&mut peaks, &mut s, 0, &r));
    s[0].decrease(Metric::AllocatedBytes, PoolKind::Large, 900);
    finish(&mut peaks, &mut s, 0, &r);
    // Shard 0 gives most of its credit back; shard 1, quiet and holding nothing, is the
    // one a concurrent reset does not visit.
    give_back(&mut s[0], &r, true);
    let mut all: Vec<&mut ShardCounters> = s.iter_mut().collect();
    let mut holds = vec![false; 2];
    settle(&mut peaks, &mut all, &r, &mut holds);
    assert!(balanced(&peaks, &s, &r, BYTES));
    // Shard 1 borrows from the spare credit (after the reset listed the shards, before it
    // took the spare credit), then the reset runs over shard 0 alone.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 300);
    assert!(!finish(&mut peaks, &mut s, 1, &r), "borrowed, no settle");
    let (first, _) = s.split_at_mut(1);
    let mut visited: Vec<&mut ShardCounters> = first.iter_mut().collect();
    reset(&mut peaks, &mut visited, &r);
    assert!(balanced(&peaks, &s, &r, BYTES), "the reset counts what shard 1 borrowed");
    assert_eq!(spare_credit(&r, BYTES), -300, "a debt: nothing can be borrowed against it");
    // The next call of shard 1 cannot borrow; its settle visits it and pays the debt.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 1);
    assert!(finish(&mut peaks, &mut s, 1, &r));
    assert_eq!(peaks.peak[BYTES], 301);
    assert!(balanced(&peaks, &s, &r, BYTES));
}
