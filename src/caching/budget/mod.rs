//! Per-pool memory budgets (`gpupool_pool_set_limit`; issue 43): the most bytes one pool of a
//! device may reserve, its out-of-memory kept to itself. PyTorch has one process-wide fraction
//! (`set_per_process_memory_fraction`, `caching::limit`); an inference server that puts several
//! models, adapters or requests on one GPU needs one budget per tenant.
//!
//! What counts against a pool: its reserved bytes, as `reserved_bytes` of its statistics count
//! them: the ordinary segments of its shards and the pages mapped in their expandable segments
//! (and the pages a sleeping pool gave back and will map again at wake, so that a wake never
//! fails on the budget). Handles the device's page pool holds unmapped are the device's, not a
//! pool's (as `unmapped_held_bytes` in a pool's statistics is 0): the device's memory fraction
//! counts them.
//!
//! The count is `caching::charge`'s, as the memory fraction's (`caching::limit`): one atomic
//! count per pool, shared by the pool's shards (a shard per stream), charged before the driver
//! is asked (`charge::Charge`, committed, settled or dropped), checked against the limit. Only where a segment is made or pages are mapped
//! (`shard::segments`, `expandable::grow`), and given back where a segment is freed or pages
//! unmapped: the hit path never looks at it. Every pool is counted, limit or not, so that a
//! limit set later is checked against the right use.
//!
//! The charge comes before anything is made: before `cuMemAlloc` for an ordinary segment, and
//! before a new expandable range is reserved (charged then for the pages the request maps from
//! its start). A growth the budget refuses makes no segment, not even one given back at once,
//! so the segment count, the reserved bytes and their peaks stay as they were (as PyTorch
//! `alloc_block` checks its memory fraction before `try_allocate_expandable_block` reserves a
//! range; issue 43).
//!
//! A refused charge is out of memory for the shard (`DriverError::OutOfMemory`), and flags the
//! calling thread ([`take_refusal`]): the out-of-memory path ([`device`]) then releases
//! the pool's own free cache and retries, then calls the out-of-memory observers and fails with
//! the message of [`message`], naming the pool, its limit and its use. Other pools' caches and
//! the driver are not touched (the device's path releases every pool's cache).
//!
//! - this file: the count and the charge;
//! - [`table`]: a device's budgets by pool;
//! - [`message`]: the limit's checks and the out-of-memory message;
//! - [`device`]: a device's budgets set and read, and the out-of-memory path of a request its
//!   pool's budget refused; [`allocator`]: the calls by device; `ffi::pools`: the C functions;
//! - `tests.rs`: the count, the charge and the limit's checks.

mod allocator;
mod device;
mod message;
mod table;
#[cfg(test)]
mod tests;

pub(crate) use message::{limit_from_c, over_budget, pool_name};
pub(crate) use table::Budgets;

use std::cell::Cell;

use super::charge::{Charge, LimitedCount};

thread_local! {
    /// The last charge of this thread was refused by a pool's budget (cleared by a charge that
    /// passed, and by [`take_refusal`]).
    static REFUSED: Cell<bool> = const { Cell::new(false) };
}

/// Whether the last budget charge of the calling thread was refused; clears the flag. The
/// out-of-memory path asks it to tell a budget's refusal from the device's.
pub(crate) fn take_refusal() -> bool {
    REFUSED.with(|r| r.replace(false))
}

/// Whether the last budget charge of the calling thread was refused, the flag left as it is:
/// for a growth that tries several page sizes, each charged (`expandable::grow`).
pub(crate) fn refused() -> bool {
    REFUSED.with(Cell::get)
}

/// One pool's reserved bytes on one device, and the most it may reserve.
#[derive(Debug)]
pub(crate) struct PoolBudget {
    /// The pool's id; 0: the device's default pools (every stream's).
    pub pool: u64,
    /// The pool's reserved bytes, counted before the driver is asked, and its limit (none
    /// unless set): `caching::charge`'s count, as the device's memory fraction's.
    count: LimitedCount,
}

impl PoolBudget {
    /// The budget of `pool`, with no limit and nothing counted.
    pub fn new(pool: u64) -> Self {
        PoolBudget { pool, count: LimitedCount::default() }
    }

    /// Counts `size` more bytes reserved by the pool, unless that would take it past its
    /// limit: `None` then, and the calling thread is flagged ([`take_refusal`]). Two threads
    /// cannot both pass the limit: each sees the other's charge. The charge gives its bytes
    /// back when dropped uncommitted (`charge::Charge`).
    pub fn try_charge(&self, size: usize) -> Option<Charge<'_>> {
        let charge = self.count.try_charge(size);
        REFUSED.with(|r| r.set(charge.is_none()));
        charge
    }

    /// Counts `size` bytes no longer reserved (a segment went back to the driver).
    pub fn uncharge(&self, size: usize) {
        self.count.uncharge(size);
    }

    /// Counts a change of the pool's reserved bytes made without a charge: pages unmapped
    /// (negative).
    pub fn adjust(&self, change: isize) {
        self.count.adjust(change);
    }

    /// Sets the limit in bytes; `None` (or `i64::MAX`): no limit.
    pub fn set_limit(&self, bytes: Option<i64>) {
        self.count.set_limit(bytes);
    }

    /// The limit in bytes, or `None` when none is set.
    pub fn limit(&self) -> Option<i64> {
        self.count.limit()
    }

    /// The pool's reserved bytes as counted (with charges in flight).
    pub fn reserved(&self) -> i64 {
        self.count.counted()
    }
}
