//! A settle as steps, one shard at a time: [`Settle::visit`] each shard (under its own lock,
//! taken and dropped by the caller), [`Settle::raise`] the peaks, settle the account with the
//! spare credit ([`Settle::pay_from_spare`]: what the shards that went past their credit owe,
//! and any debt the spare credit holds), [`Settle::cover`] what is still owed from the shards
//! that hold credit, last visited first, and [`Settle::end`]. [`settle`] runs the steps over
//! shards that are all locked at once (PyTorch `getStats`' one consistent snapshot);
//! `DeviceAllocator`'s call-end settle (`accounting::device_call_settle`) runs them locking one
//! shard at a time, so that no stream waits for every other (see the module `peaks`, "What a
//! settle costs"). The callers take and drop the locks; the steps take none.
//!
//! Every step moves credit, never makes or loses any: what a visit takes from a shard, or a
//! debt it leaves there, goes into the settle's own account, which starts at zero, and from
//! there into the spare credit at the end; only the rise of the peaks adds credit. So
//! `P = G + sum(h) + R` of the true values holds through the steps whatever other shards do
//! meanwhile, and the steps need not see the device all at once for it.
//!
//! Where nothing else moves while a settle runs, the steps deal the credit as one pass over
//! locked shards would: each shard keeps what it holds up to what it keeps, the spare credit
//! pays the debts first, and where it cannot, the shards visited last give up what they keep.

use std::sync::atomic::Ordering;

use super::{CELLS, METRICS, PoolKind, ShardCounters, SpareCredit, StatType, Totals, absorb, cell};

/// A settle under way: what its visits saw and took. Lives while the caller holds the device's
/// peak lock, which keeps settles one at a time.
pub(crate) struct Settle {
    /// The peaks before the settle.
    before: [i64; CELLS],
    /// Per cell, the furthest a visited shard went past its credit, from its value now: the
    /// device was that far above its current value then (see the module `peaks`).
    excursion: [i64; CELLS],
    /// The settle's account per cell: credit taken from shards and the rise of the peaks, less
    /// the debts of shards that went past their credit. Below zero: owed still.
    credit: [i64; CELLS],
}

impl Settle {
    /// Begins a settle of the device whose totals are `t`.
    pub fn new(t: &Totals) -> Self {
        Settle { before: t.peak, excursion: [0; CELLS], credit: [0; CELLS] }
    }

    /// Visits one shard, its lock held: counts what it changed since it was last seen into the
    /// totals, notes how far past its credit it went, and takes what it holds beyond what it
    /// keeps (its debt, where it went past its credit). A shard whose value did not move
    /// since the last settle (a quiet stream) keeps nothing: its credit goes where streams
    /// that run short can borrow it. Returns whether the shard still holds credit (and so
    /// must be visited by the next settle).
    pub fn visit(&mut self, t: &mut Totals, s: &mut ShardCounters) -> bool {
        absorb(t, &mut [&mut *s]);
        let mut holds = false;
        let (cells, seen) = s.cells_and_seen();
        for (i, (c, seen)) in cells.iter_mut().zip(seen.iter_mut()).enumerate() {
            let moved = c.allocated + c.freed;
            if c.low < 0 {
                self.excursion[i] = self.excursion[i].max(c.headroom - c.low);
                c.keep = c.keep.max(-c.low);
            } else if moved == seen.allocated + seen.freed {
                c.keep = 0;
            }
            seen.allocated = c.allocated;
            seen.freed = c.freed;
            let kept = c.headroom.clamp(0, c.keep);
            self.credit[i] += c.headroom - kept;
            // `absorb` counted the headroom as it is; the totals hold what the shard keeps.
            t.held[i] -= c.headroom - kept;
            c.headroom = kept;
            seen.headroom = kept;
            c.low = kept;
            holds |= kept != 0;
        }
        s.needs_settle = false;
        s.has_surplus = false;
        holds
    }

    /// Raises each peak to the highest value the device reached as the visits saw it, keeps
    /// the peaks of a metric consistent with each other, and adds the rise to the account.
    pub fn raise(&mut self, t: &mut Totals) {
        for (i, peak) in t.peak.iter_mut().enumerate() {
            // Only a shard that went past its credit can have taken G above P; calls settle
            // before they return, so while it did, no other shard moved.
            *peak = (*peak).max(t.current[i] + self.excursion[i]);
        }
        consistent_pools(&mut t.peak, &t.current);
        for (i, peak) in t.peak.iter().enumerate() {
            self.credit[i] += peak - self.before[i];
        }
    }

    /// Settles the account with the spare credit: takes over a debt the spare credit holds
    /// (left by an earlier settle or reset while calls on other streams moved), and pays what
    /// the account owes from the spare credit as far as it holds any (a load per cell, and a
    /// compare-and-swap per cell that moves). Returns whether the account still owes credit
    /// in some cell, for [`Settle::cover`].
    pub fn pay_from_spare(&mut self, spare: &SpareCredit) -> bool {
        let mut owed = false;
        for (c, r) in self.credit.iter_mut().zip(spare) {
            let mut have = r.load(Ordering::Relaxed);
            loop {
                // A debt of the spare credit becomes the account's; credit it holds pays
                // what the account owes.
                let take = if have < 0 { have } else { have.min((-*c).max(0)) };
                if take == 0 {
                    break;
                }
                match r.compare_exchange_weak(have, have - take, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        *c += take;
                        break;
                    }
                    Err(now) => have = now,
                }
            }
            owed |= *c < 0;
        }
        owed
    }

    /// Pays what the account still owes from a shard that holds credit, its lock held: the
    /// shards visited last give up what they keep first. Returns whether the shard still
    /// holds credit. A cell that went past its credit again since the visit gives nothing
    /// (its call borrows or settles).
    pub fn cover(&mut self, t: &mut Totals, s: &mut ShardCounters) -> bool {
        let mut holds = false;
        let (cells, seen) = s.cells_and_seen();
        for (i, (c, seen)) in cells.iter_mut().zip(seen.iter_mut()).enumerate() {
            if self.credit[i] < 0 && c.low >= 0 && c.headroom > 0 {
                let take = c.headroom.min(-self.credit[i]);
                self.credit[i] += take;
                c.headroom -= take;
                c.low = c.low.min(c.headroom);
                seen.headroom -= take;
                t.held[i] -= take;
            }
            holds |= c.headroom != 0;
        }
        holds
    }

    /// Whether the account still owes credit in some cell.
    pub fn owes(&self) -> bool {
        self.credit.iter().any(|&c| c < 0)
    }

    /// Ends the settle: what is left of the account goes to the spare credit. Below zero (only
    /// where calls on other streams moved during the settle), a debt that no call can borrow
    /// against and that the next settle visiting the shards that moved pays.
    pub fn end(self, spare: &SpareCredit) {
        for (r, &c) in spare.iter().zip(&self.credit) {
            if c != 0 {
                r.fetch_add(c, Ordering::Relaxed);
            }
        }
    }
}

/// Settles every cell over `shards`, all locked: raises each peak to the highest value reached,
/// keeps the peaks of a metric consistent with each other, then deals the credit out again:
/// each shard keeps what it held up to what it keeps, the rest goes to the spare credit.
///
/// `shards` must hold, locked, every shard that changed since a settle last visited it (the
/// device's dirty list) and every shard that still held credit after the last settle; a
/// shard in neither has no credit and counts as it was seen, so a settle costs what moved
/// since the last one, not the number of streams. Sets `holds[j]` to whether shard `j` still
/// holds credit (and so must be visited by the next settle).
///
/// A shard that is not visited (it joined the dirty list after this settle took it) may borrow
/// from the spare credit or give credit back to it meanwhile: the settle moves credit and never
/// computes it as `P - G` of what it sees, so none is dealt twice or lost.
pub(crate) fn settle(t: &mut Totals, shards: &mut [&mut ShardCounters], spare: &SpareCredit, holds: &mut [bool]) {
    let mut s = Settle::new(t);
    for (shard, h) in shards.iter_mut().zip(holds.iter_mut()) {
        *h = s.visit(t, shard);
    }
    s.raise(t);
    if s.pay_from_spare(spare) {
        for (shard, h) in shards.iter_mut().zip(holds.iter_mut()).rev() {
            if *h {
                *h = s.cover(t, shard);
                if !s.owes() {
                    break;
                }
            }
        }
    }
    s.end(spare);
}

/// Keeps each metric's peaks as true peaks relate: the peak over all pools is at most the
/// small pool's plus the large pool's, and at least either. Exact peaks already are; when
/// calls on several streams overlap, each cell's peak can be overstated by what other streams
/// moved meanwhile, by a different amount per cell, and this bounds the aggregate by the
/// pools. `current` is at most each bound, so every peak stays at or above its current value.
fn consistent_pools(peak: &mut [i64; CELLS], current: &[i64; CELLS]) {
    for m in METRICS {
        let all = cell(m, StatType::All);
        let small = peak[cell(m, StatType::Pool(PoolKind::Small))];
        let large = peak[cell(m, StatType::Pool(PoolKind::Large))];
        peak[all] = peak[all].min(small + large).max(small).max(large).max(current[all]);
    }
}
