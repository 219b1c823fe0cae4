//! Unit tests of the device peaks' credit: borrows, surplus given back, settles and resets, on
//! shards' counters with no device.

use super::*;
use crate::caching::accounting::counters::Metric;

const BYTES: usize = cell(Metric::AllocatedBytes, StatType::All);

/// The streams a borrow takes its share of the spare credit among (see [`borrow`]): the tests'
/// devices have two to four shards; a share of a quarter keeps most of the credit spare.
const STREAMS: usize = 4;

fn spare() -> SpareCredit {
    std::array::from_fn(|_| AtomicI64::new(0))
}

/// What a device does at the end of a call on shard `i`.
fn finish(peaks: &mut Totals, shards: &mut [ShardCounters], i: usize, r: &SpareCredit) -> bool {
    if shards[i].has_surplus {
        give_back(&mut shards[i], r, false);
    }
    if shards[i].needs_settle && !borrow(&mut shards[i], r, STREAMS) {
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
    assert_eq!(s[0].cell(BYTES).headroom, 50, "active: keeps what the peak leaves");
    // Shard 0 has been quiet since: the next settle moves its credit to the spare credit, so
    // shard 1 borrows it afterwards instead of settling again.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 40);
    assert!(finish(&mut peaks, &mut s, 1, &r));
    assert_eq!((s[0].cell(BYTES).headroom, spare_credit(&r, BYTES)), (0, 10));
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
    let g: i64 = shards.iter().map(|s| s.cell(cell).current()).sum();
    let h: i64 = shards.iter().map(|s| s.cell(cell).headroom).sum();
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
    // Its need and its share of the 600 spare beyond it.
    let borrowed = 300 + 600 / STREAMS as i64;
    assert_eq!(spare_credit(&r, BYTES), -borrowed, "a debt: nothing can be borrowed against it");
    // The next call of shard 1 that runs past its share cannot borrow; its settle visits it
    // and pays the debt.
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, borrowed - 300 + 1);
    assert!(finish(&mut peaks, &mut s, 1, &r));
    assert_eq!(peaks.peak[BYTES], borrowed + 1);
    assert!(balanced(&peaks, &s, &r, BYTES));
}

/// A settle in steps, visiting `shards` one at a time (every one: a superset of the dirty list
/// and the holders), running `between(shards, j)` before the visit of shard `j`: calls of other
/// streams that run while the settle has visited some shards and not others.
fn settle_in_steps(
    peaks: &mut Totals,
    shards: &mut [ShardCounters],
    r: &SpareCredit,
    mut between: impl FnMut(&mut [ShardCounters], usize),
) {
    let mut s = Settle::new(peaks);
    let mut holds = vec![false; shards.len()];
    for j in 0..shards.len() {
        between(shards, j);
        holds[j] = s.visit(peaks, &mut shards[j]);
    }
    s.raise(peaks);
    if s.pay_from_spare(r) {
        for j in (0..shards.len()).rev() {
            if holds[j] && s.cover(peaks, &mut shards[j]) && !s.owes() {
                break;
            }
        }
    }
    s.end(r);
}

#[test]
fn a_settle_one_shard_at_a_time_keeps_the_credit_balanced_while_other_shards_move() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default(), ShardCounters::default(), ShardCounters::default()];
    // Shards 1 and 2 hold credit: 300 each, freed after a peak of 600.
    for i in [1, 2] {
        s[i].increase(Metric::AllocatedBytes, PoolKind::Large, 300);
        finish(&mut peaks, &mut s, i, &r);
    }
    for i in [1, 2] {
        s[i].decrease(Metric::AllocatedBytes, PoolKind::Large, 300);
        finish(&mut peaks, &mut s, i, &r);
    }
    assert_eq!(peaks.peak[BYTES], 600);
    // Shard 1, quiet since its peak, gave its 300 back to the spare credit; shard 2 keeps its.
    assert_eq!((s[1].cell(BYTES).headroom, s[2].cell(BYTES).headroom, spare_credit(&r, BYTES)), (0, 300, 300));
    // Shard 0 runs short by 400, more than the spare credit holds, and settles. While the
    // settle has visited shards 0 and 1 but not 2, shard 1 allocates 100 and borrows it from
    // the spare credit, and shard 2 allocates 50 within what it keeps: the settle sees shard 2
    // as it is then, and pays shard 0's debt with what is left.
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 400);
    assert!(s[0].needs_settle && !borrow(&mut s[0], &r, STREAMS));
    settle_in_steps(&mut peaks, &mut s, &r, |s, j| {
        if j == 2 {
            s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 100);
            assert!(borrow(&mut s[1], &r, STREAMS));
            s[2].increase(Metric::AllocatedBytes, PoolKind::Large, 50);
            assert!(!s[2].needs_settle);
        }
    });
    assert_eq!(peaks.peak[BYTES], 600, "550 now: under the peak");
    for c in [BYTES, cell(Metric::AllocatedBytes, StatType::Pool(PoolKind::Large))] {
        assert!(balanced(&peaks, &s, &r, c), "cell {c}");
    }
    // Shard 1 borrowed its 100 and a quarter of the 200 beyond (its share, `STREAMS`), so the
    // debt of shard 0 took what shard 2 held.
    let h: Vec<i64> = s.iter().map(|s| s.cell(BYTES).headroom).collect();
    assert_eq!((h, spare_credit(&r, BYTES)), (vec![0, 50, 0], 0));
}

#[test]
fn a_settle_one_shard_at_a_time_takes_over_a_debt_of_the_spare_credit() {
    let (mut peaks, r) = (Totals::default(), spare());
    let mut s = [ShardCounters::default(), ShardCounters::default()];
    s[0].increase(Metric::AllocatedBytes, PoolKind::Large, 500);
    finish(&mut peaks, &mut s, 0, &r);
    s[0].decrease(Metric::AllocatedBytes, PoolKind::Large, 500);
    finish(&mut peaks, &mut s, 0, &r);
    // A debt of 200 in the spare credit, as a settle that raced calls can leave one, with
    // the credit that pays it sitting in shard 0.
    r[BYTES].fetch_sub(200, Ordering::Relaxed);
    s[0].cells_mut()[BYTES].headroom += 200;
    s[0].cells_mut()[BYTES].low += 200;
    s[0].cells_mut()[BYTES].keep = 700;
    let seen = s[0].seen[BYTES].headroom;
    s[0].seen[BYTES].headroom += 200;
    peaks.held[BYTES] += s[0].seen[BYTES].headroom - seen;
    assert!(balanced(&peaks, &s, &r, BYTES));
    s[1].increase(Metric::AllocatedBytes, PoolKind::Large, 1);
    assert!(!borrow(&mut s[1], &r, STREAMS), "nothing to borrow against a debt");
    settle_in_steps(&mut peaks, &mut s, &r, |_, _| {});
    assert_eq!(peaks.peak[BYTES], 500);
    assert!(balanced(&peaks, &s, &r, BYTES));
    assert_eq!((s[0].cell(BYTES).headroom, spare_credit(&r, BYTES)), (499, 0), "shard 0 paid the debt");
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// One call on shard `i`: a rise and fall of up to 1,000 in one pool, or a free of part of
/// what it holds there. Returns the highest device value of the cell of `pool` in the call.
fn call(s: &mut [ShardCounters], i: usize, rng: &mut u64) -> (usize, i64) {
    let pool = if xorshift(rng) % 2 == 0 { PoolKind::Small } else { PoolKind::Large };
    let c = cell(Metric::AllocatedBytes, StatType::Pool(pool));
    let device = |s: &[ShardCounters]| s.iter().map(|s| s.cell(c).current()).sum::<i64>();
    let held = s[i].cell(c).current();
    let n = (xorshift(rng) % 1000) as i64 + 1;
    let high = if held > 0 && xorshift(rng) % 2 == 0 {
        s[i].decrease(Metric::AllocatedBytes, pool, n.min(held));
        device(s)
    } else {
        s[i].increase(Metric::AllocatedBytes, pool, n);
        let high = device(s);
        let back = (xorshift(rng) % 2 * (xorshift(rng) % n as u64)) as i64;
        s[i].decrease(Metric::AllocatedBytes, pool, back);
        high
    };
    (c, high)
}

/// Random calls on four shards, each ending as a device's call does, its settles in steps.
/// With `overlap`, each settle lets calls of other shards run between its visits (a call that
/// runs short then settles after it, unless the settle covered it): the credit stays balanced,
/// and a final settle leaves no debt and every peak at least its current value. Without, the
/// peak of each pool is the highest value the device reached, exactly.
#[test]
fn settles_in_steps_are_exact_alone_and_balanced_among_other_calls() {
    for overlap in [false, true] {
        for seed in 1..40u64 {
            let (mut peaks, r) = (Totals::default(), spare());
            let mut s: Vec<ShardCounters> = (0..4).map(|_| ShardCounters::default()).collect();
            let mut rng = seed * 0x9e37_79b9_7f4a_7c15;
            let mut truth = [0i64; CELLS];
            for _ in 0..400 {
                let i = (xorshift(&mut rng) % 4) as usize;
                let (c, high) = call(&mut s, i, &mut rng);
                truth[c] = truth[c].max(high);
                let mut queue = vec![i];
                while let Some(i) = queue.pop() {
                    if s[i].has_surplus {
                        give_back(&mut s[i], &r, false);
                    }
                    if !s[i].needs_settle || borrow(&mut s[i], &r, STREAMS) {
                        continue;
                    }
                    let mut rng2 = xorshift(&mut rng);
                    settle_in_steps(&mut peaks, &mut s, &r, |s, _| {
                        if overlap && xorshift(&mut rng2) % 2 == 0 {
                            let k = (xorshift(&mut rng2) % 4) as usize;
                            call(s, k, &mut rng2);
                            if s[k].needs_settle && !borrow(&mut s[k], &r, STREAMS) {
                                queue.push(k);
                            }
                        }
                    });
                }
                for c in 0..CELLS {
                    assert!(balanced(&peaks, &s, &r, c), "seed {seed}, cell {c}");
                }
            }
            let mut all: Vec<&mut ShardCounters> = s.iter_mut().collect();
            let mut holds = vec![false; 4];
            settle(&mut peaks, &mut all, &r, &mut holds);
            for (c, &truth) in truth.iter().enumerate() {
                let current: i64 = s.iter().map(|s| s.cell(c).current()).sum();
                assert!(balanced(&peaks, &s, &r, c) && peaks.peak[c] >= current, "seed {seed}, cell {c}");
                assert!(spare_credit(&r, c) >= 0 && s.iter().all(|s| s.cell(c).headroom >= 0), "seed {seed}");
                if !overlap && c != BYTES {
                    assert_eq!(peaks.peak[c], truth, "seed {seed}, cell {c}");
                }
            }
        }
    }
}
