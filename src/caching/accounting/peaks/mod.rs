//! Exact device peaks without a shared write on the hot path.
//!
//! PyTorch keeps one `DeviceStats` per device under the device's one mutex, so every call of
//! every stream serialises on it. gpupool gives each stream a shard with its own lock and
//! keeps the device peak `P` of each statistic exact with *credit*: each shard `j` holds
//! `h_j >= 0`, the device holds spare credit `R >= 0` (an atomic), and the invariant is
//!
//! ```text
//!     P = G + sum(h_j) + R        (G: the device's current value, the sum over shards)
//! ```
//!
//! A free of `n` on shard `j` lowers `G` by `n` and raises `h_j` by `n`; an allocation spends
//! the shard's own credit. When a shard runs out (`h_j < 0`) the call that did it, still
//! holding only its own lock, borrows what it needs from the spare credit ([`borrow`], one
//! compare-and-swap per statistic). Only when the spare credit cannot cover it (the device
//! may be at a new peak, or the credit sits with other streams) does the call settle the
//! device ([`Settle`]): it recounts `G`, sets `P` to the highest value `G` reached and deals
//! the credit out again.
//!
//! Where credit stays. A stream the calling thread uses again and again (it is in the
//! thread's cache of recent shards: *hot*) keeps the most it had to borrow at once, and gives
//! back only what it holds beyond several times that ([`give_back`], `SURPLUS_FACTOR`, 4); a
//! borrow takes its need and its share of the rest of the spare credit, one part in the
//! device's streams ([`borrow`]). Threads that each churn their own stream then rarely settle:
//! on the H100 machine's 16-core host, 16 threads on one device settled 3-9 times per million
//! calls, against 148-172 with a factor of 8 and borrows of the need alone. An
//! allocation on a stream that is not hot for the calling thread (a thread serving more streams
//! than it caches, a stream per request) gives all the stream's credit back at its end, what
//! its frees kept included: credit left with a stream that comes back only after thousands of
//! others is credit that every other stream finds missing, and each shortfall would be a
//! settle. (A free cannot tell cheaply whether its stream is hot, and keeps what it frees.) A
//! settle also takes back what a stream that was quiet since the last settle keeps.
//!
//! What a settle costs. The device keeps totals of what settles saw of each shard (`Totals`)
//! and a dirty list of the shards locked for a change since the last settle (see
//! `shard_table`). A settle visits those and the shards that still held credit after the last
//! one; every other shard holds no credit and is as the totals saw it. So a settle, and
//! `stats()`, cost what moved since the last settle, not the number of streams that exist or
//! have existed. Settles run one at a time, under the device's peak lock.
//!
//! A call's settle visits those shards one at a time ([`Settle`], `DeviceAllocator::settle_for`):
//! each is locked only for its own visit (a few hundred instructions: its cells added to the
//! totals, its credit taken or dealt), its front cache left as it is, and the streams go on
//! meanwhile; a stream waits at most for its own shard's visit, and the shards that hold
//! credit that is needed elsewhere are locked a second time ([`Settle::cover`]). Until
//! 2026-11-28 a settle locked every shard at once, and every stream of the device waited for
//! the whole settle: 16 threads on one device of the H100 machine's host ran 25-33 M ops/s,
//! 75 with settles skipped (commit 84a0962). A call whose settle waited for the peak lock
//! behind one that visited its shard after it ran short was covered by it, and settles
//! nothing. `stats()`, `reset_peak_stats()` and `empty_cache` settle over every shard locked
//! at once ([`settle`], the same steps): PyTorch reads its statistics as one snapshot.
//!
//! Measured on the simulated device before the factor of 4 and the borrow's share
//! (2-core development machine, so threads mostly took turns): threads each churning 16 blocks of 4 KiB to 1 MiB on their own stream
//! (`examples/settle_rate.rs`, 200,000 calls a thread), 195 settles per million calls at 1
//! thread (every one a new peak), 114-156 at 4 and 16 (168-219 while a call whose settle
//! another had covered settled again); shared credit (a compare-and-swap of a borrow, an
//! addition of a give-back) touched 12,000-17,000 times per million calls, before and after,
//! only by the calls that borrow or give back. N streams each
//! holding a block, freed and allocated again in rotation with sizes alternating 512 B and
//! 1 KiB (`benches/streams.rs`): no settle after the first round at any N (a quarter of the
//! calls settled while credit stayed with the stream that freed it).
//!
//! A call may raise a value and lower it again before it finishes (a malloc whose pending
//! events return a split block to the pool, `inactive_split` + 1, and which then takes that
//! block, - 1). PyTorch's peak counts that moment, so each cell also keeps `low`, the lowest
//! headroom since the last settle or borrow: the shard's value was then `h - low` above what it
//! is now. A borrow succeeds only if the spare credit covers `-low`, the whole excursion; a settle
//! takes `G + max(h_j - low_j)` as the highest value reached.
//!
//! Why `P = G + sum(h) + R` holds, whatever runs at once: a call moves `G` and its shard's
//! `h_j` by opposite amounts under the shard's lock; a borrow or a give-back moves credit
//! between `h_j` and `R` in one atomic operation; a settle's steps move credit between a
//! shard's `h_j` (under its lock), the settle's own account and `R`, and its raise adds the
//! same amount to `P` and to the account. No step makes or loses credit, so the sum holds
//! with a settle's account counted in `R`, and between settles exactly (the invariant
//! checker, `DeviceAllocator::check`, holds every cell to it). A settle never computes the
//! credit as `P - G` of what it saw, which a settle that does not see every shard at once
//! would get wrong.
//!
//! Exactness: every history of calls that do not overlap in time gets PyTorch's peak exactly,
//! because borrowing and settling happen before the call returns, while no other shard moves:
//! a settle that visits the shards one at a time then sees what one visiting them all at once
//! would, and deals the credit the same way. When calls on different streams of one device
//! overlap, their order is not defined to begin with; the peak is then exact up to the bytes
//! other streams moved meanwhile, above or below: a settle adds up values of shards seen at
//! different moments while calls of other streams run between its visits. Credit stays exact
//! whatever the overlap (above); a settle that set a peak too low leaves a debt in the spare
//! credit, against which no call can borrow, and which the next settle pays from the shards'
//! credit. A read of the statistics settles with every shard locked, so that what it reports
//! always has every current value at most its peak.
//!
//! `settle_steps.rs`: a settle's arithmetic as steps, visit, raise, pay and cover, taking no
//! lock; `tests.rs`: the credit's unit tests (borrows, give-backs, settles, resets).

pub(crate) use super::cell_layout::Totals;
pub(crate) use settle_steps::{Settle, settle};

use std::sync::atomic::{AtomicI64, Ordering};

use super::cell_layout::{CELLS, METRICS, StatType, cell};
use super::counters::ShardCounters;
use crate::caching::rules::PoolKind;

/// The device's credit not held by any shard (`R` above), one atomic per statistic.
pub(crate) type SpareCredit = [AtomicI64; CELLS];

/// Covers every cell that ran out of credit from the spare credit; returns false (having borrowed
/// nothing for the cells it could not cover) when some cell needs a full settle. Called with
/// the shard's lock held. `streams`: the shards of the device (a moment's count).
///
/// It takes what it needs and a share of what the spare credit holds beyond that: one part in
/// `streams`. Taking only the need, a stream that climbs borrowed at every call that raised it:
/// a fifth of vit_train's calls, each a pass over every cell (about 620 instructions, replayed
/// on the simulated device). Taking more than a share leaves the others short: half of the
/// spare credit at each borrow raised the settles of 16 threads on one device from 148-172 to
/// 220-240 per million calls, and twice the need settled four streams in rotation on one
/// thread at one call in four. With one stream the share is all of it; what a stream holds
/// beyond [`crate::caching::accounting::counters`]' surplus factor goes back at its next free, and a settle
/// takes back what it holds beyond what it keeps.
pub(crate) fn borrow(shard: &mut ShardCounters, spare: &SpareCredit, streams: usize) -> bool {
    let mut all = true;
    let parts = streams.max(1) as i64;
    let (cells, mask) = shard.cells_with_credit();
    for i in cell_bits(*mask) {
        let (c, r) = (&mut cells[i], &spare[i]);
        if c.low >= 0 {
            continue;
        }
        let excursion = -c.low;
        let need = (-c.headroom).max(0);
        let mut have = r.load(Ordering::Relaxed);
        let took = loop {
            if have < excursion {
                break None;
            }
            let take = need + (have - need) / parts;
            match r.compare_exchange_weak(have, have - take, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break Some(take),
                Err(now) => have = now,
            }
        };
        match took {
            Some(take) => {
                c.headroom += take;
                c.low = c.headroom;
                c.keep = c.keep.max(excursion);
            }
            None => all = false,
        }
    }
    shard.needs_settle = !all;
    all
}

/// Gives credit above what each cell keeps (`all`: all of it) back to the spare. Called with
/// the shard's lock held.
/// Visits only the cells that may hold credit (`ShardCounters::cells_with_credit`).
pub(crate) fn give_back(shard: &mut ShardCounters, spare: &SpareCredit, all: bool) {
    let (cells, mask) = shard.cells_with_credit();
    for i in cell_bits(*mask) {
        let c = &mut cells[i];
        let keep = if all { 0 } else { c.keep };
        if c.headroom > keep && c.low >= 0 {
            let surplus = c.headroom - keep;
            c.headroom -= surplus;
            c.low = c.low.min(c.headroom);
            spare[i].fetch_add(surplus, Ordering::Relaxed);
        }
    }
    shard.has_surplus = false;
}

/// The end of a call on a stream that is not hot (see the module's doc): [`borrow`] for the
/// cells that ran out of credit, then [`give_back`] of all of it, in one pass. A cell that went
/// past its credit takes exactly what it lacks, where the spare credit covers its whole
/// excursion (a borrow's share of the rest would go straight back); every other cell gives
/// all it holds back. Each cell ends holding nothing, as after the borrow and the give-back,
/// and its `keep` rises to the excursion as a borrow's does; a cell the spare credit cannot
/// cover is left as it is, for the settle the caller runs. Returns false when some cell needs
/// that settle. Called with the shard's lock held.
///
/// Visits only the cells that may hold credit (`ShardCounters::cells_with_credit`) and takes
/// every cell it empties out of that mask: a borrow and a give-back over all 29 cells, and a
/// second pass over those in the mask, cost a cold malloc about 470 instructions
/// (callgrind, `examples/stream_rotation.rs`, 1,000 streams). A shard it leaves with no credit
/// has its hit path's minimums taken at once (`ShardCounters::minimums_at_zero`).
///
/// Inlined into its one caller, the end of a cold malloc (`DeviceAllocator::finish_call`): a
/// call cost it about 8 instructions.
#[inline(always)]
pub(crate) fn return_all(shard: &mut ShardCounters, spare: &SpareCredit) -> bool {
    let mut all = true;
    let (cells, mask) = shard.cells_with_credit_flushed();
    let mut left = 0;
    let mut bits = *mask;
    debug_assert!(bits >> CELLS == 0);
    while bits != 0 {
        let i = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        // SAFETY: `i < CELLS`: a mask holds no bit past the last cell (every bit set is a
        // cell's, `ShardCounters::cells_with_credit`). Indexed with their checks (and
        // `cell_bits`' test of the index), the walk cost 3 instructions a cell more
        // (callgrind, `examples/stream_rotation.rs`, where each cold malloc walks 6 to 10).
        let (c, r) = unsafe { (cells.get_unchecked_mut(i), spare.get_unchecked(i)) };
        if c.low >= 0 {
            if c.headroom > 0 {
                r.fetch_add(c.headroom, Ordering::Relaxed);
                c.headroom = 0;
                c.low = 0;
            } else if c.headroom < 0 {
                // Only where a cell went past its credit (`low` follows it there).
                left |= 1 << i;
            }
            continue;
        }
        // The spare credit must cover the excursion, and gains what the cell holds (below
        // zero: loses what it lacks).
        let excursion = -c.low;
        let mut have = r.load(Ordering::Relaxed);
        let covered = loop {
            if have < excursion {
                break false;
            }
            match r.compare_exchange_weak(have, have + c.headroom, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break true,
                Err(now) => have = now,
            }
        };
        if covered {
            c.headroom = 0;
            c.low = 0;
            c.keep = c.keep.max(excursion);
        } else {
            all = false;
            left |= 1 << i;
        }
    }
    *mask = left;
    if left == 0 {
        shard.minimums_at_zero();
    } else {
        shard.minimums_stale();
    }
    shard.needs_settle = !all;
    shard.has_surplus = false;
    all
}

/// The cells whose bits are set in `mask`, lowest first.
#[inline(always)]
fn cell_bits(mut mask: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let i = mask.trailing_zeros() as usize;
        // A mask holds no bit past the last cell (`ShardCounters::cells_with_credit`).
        (i < CELLS).then(|| {
            mask &= mask - 1;
            i
        })
    })
}

/// Adds what `shards` changed since their last visit to the totals, and marks it seen.
pub(crate) fn absorb(t: &mut Totals, shards: &mut [&mut ShardCounters]) {
    for s in shards.iter_mut() {
        t.device_allocs += s.device_allocs - s.seen_device.0;
        t.device_frees += s.device_frees - s.seen_device.1;
        s.seen_device = (s.device_allocs, s.device_frees);
        let (cells, seen) = s.cells_and_seen();
        for (i, (c, seen)) in cells.iter().zip(seen.iter_mut()).enumerate() {
            t.current[i] += c.current() - seen.current;
            t.allocated[i] += c.allocated - seen.allocated;
            t.freed[i] += c.freed - seen.freed;
            t.held[i] += c.headroom - seen.headroom;
            seen.current = c.current();
        }
    }
}

/// The credit a reset deals out, per cell: the spare credit (taken, leaving 0) and what the
/// visited `shards` hold (taken off the totals' `held`). Credit that shards off the list give
/// back or borrow meanwhile moves the spare credit after this swap, and [`return_credit`] adds
/// to it rather than storing, so none is dealt twice or lost.
fn take_credit(t: &mut Totals, shards: &[&mut ShardCounters], spare: &SpareCredit) -> [i64; CELLS] {
    std::array::from_fn(|i| {
        let held: i64 = shards.iter().map(|s| s.cell(i).headroom).sum();
        t.held[i] -= held;
        spare[i].swap(0, Ordering::Relaxed) + held
    })
}

/// Puts what is left of the credit [`take_credit`] took back into the spare credit; below
/// zero, a debt that no call can borrow against and that the next settle visiting the
/// shards that moved pays.
fn return_credit(spare: &SpareCredit, credit: &[i64; CELLS]) {
    for (r, &c) in spare.iter().zip(credit) {
        if c != 0 {
            r.fetch_add(c, Ordering::Relaxed);
        }
    }
}

/// PyTorch `reset_peak_stats`: every peak becomes the current value, and no credit is left.
/// `shards` as for [`settle`], all locked; afterwards no shard holds credit.
///
/// The credit moves as in a settle ([`take_credit`], the peak's change, [`return_credit`]),
/// with every peak lowered to the current value and no shard keeping any.
/// A shard this reset does not visit (it joined the dirty list after the reset took it) may
/// meanwhile have borrowed from the spare credit for an allocation the reset does not see:
/// storing 0 in the spare credit, as the reset once did, lost that borrow (a peak below
/// current + credit in the stress test, one run in hundreds); dealt this way, it stays in
/// the spare credit as a debt.
pub(crate) fn reset(t: &mut Totals, shards: &mut [&mut ShardCounters], spare: &SpareCredit) {
    absorb(t, shards);
    let mut credit = take_credit(t, shards, spare);
    for (i, c) in credit.iter_mut().enumerate() {
        *c += t.current[i] - t.peak[i];
    }
    for s in shards.iter_mut() {
        let (cells, seen) = s.cells_and_seen();
        for (c, seen) in cells.iter_mut().zip(seen.iter_mut()) {
            seen.allocated = c.allocated;
            seen.freed = c.freed;
            c.headroom = 0;
            seen.headroom = 0;
            c.low = 0;
        }
        s.needs_settle = false;
        s.has_surplus = false;
    }
    t.peak = t.current;
    t.held = [0; CELLS];
    return_credit(spare, &credit);
}

/// The credit the spare credit holds for `cell` (for the consistency check).
pub(crate) fn spare_credit(spare: &SpareCredit, cell: usize) -> i64 {
    spare[cell].load(Ordering::Relaxed)
}

mod settle_steps;
#[cfg(test)]
mod tests;
