//! A device's shards by stream, and which of them changed since the last peak settle (the
//! dirty list), so that a settle visits what moved instead of every stream that ever existed.
//!
//! A shard joins the dirty list once per settle epoch, at the first call that locks it for a
//! change ([`ShardTable::lock_for_change`]): one relaxed load and a comparison on the hit path.
//! A settle moves the epoch on and takes the list, under the device's peak lock; a call that
//! read the old epoch holds the shard's lock, so the settle, which locks every shard it
//! visits, sees its change; a call that reads the new epoch joins the new list.
//!
//! An idle shard (no segment, no block, no event, no credit) is retired by `empty_cache`
//! ([`ShardTable::retire_idle`]): out of the table, flagged, and dropped once no thread's cache
//! of recent shards holds it; a later call on its stream gets a new shard.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::shard::{Shard, ShardState};
use crate::driver::StreamHandle;

pub(crate) struct ShardTable {
    /// By (private pool, stream); pool 0 is the device's default pools.
    by_stream: Mutex<FxHashMap<(u64, StreamHandle), Arc<Shard>>>,
    /// Starts at 1: a new shard's `dirty_epoch` is 0, so its first call puts it on the list.
    epoch: AtomicU64,
    dirty: Mutex<Vec<Arc<Shard>>>,
    /// Shards in `by_stream`, kept with it under its lock, read without it (see [`ShardTable::count`]).
    count: AtomicUsize,
    /// The device's pool budgets (see `caching::budget`), which a new shard takes its pool's
    /// from.
    pub budgets: super::budget::Budgets,
}

impl Default for ShardTable {
    fn default() -> Self {
        ShardTable {
            by_stream: Mutex::default(),
            epoch: AtomicU64::new(1),
            dirty: Mutex::default(),
            count: AtomicUsize::new(0),
            budgets: Default::default(),
        }
    }
}

impl ShardTable {
    /// The shard of `stream` in `pool` (0: the default pools), created on first use (or after
    /// its last one was retired).
    pub fn get_or_create(&self, pool: u64, stream: StreamHandle) -> Arc<Shard> {
        let mut table = self.by_stream.lock();
        let shard = table
            .entry((pool, stream))
            .or_insert_with(|| Arc::new(Shard::new(pool, stream, self.budgets.get_or_create(pool))))
            .clone();
        self.count.store(table.len(), Ordering::Relaxed);
        shard
    }

    /// Shards in the table, without its lock: a moment's count, for a borrow's share of the
    /// spare credit (`peaks::borrow`), where the table's lock would be shared by every stream's
    /// borrows.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// The shards of private pool `pool`.
    pub fn of_pool(&self, pool: u64) -> Vec<Arc<Shard>> {
        self.by_stream.lock().iter().filter(|(k, _)| k.0 == pool).map(|(_, s)| s.clone()).collect()
    }

    /// Every shard in the table (for the slow paths that visit them all).
    pub fn all(&self) -> Vec<Arc<Shard>> {
        self.by_stream.lock().values().cloned().collect()
    }

    /// Shards in the table.
    pub fn len(&self) -> usize {
        self.by_stream.lock().len()
    }

    /// The invariant checker's rule: the lock-free count is the table's.
    pub fn check(&self) -> Result<(), String> {
        let table = self.by_stream.lock();
        let count = self.count.load(Ordering::Relaxed);
        if count != table.len() {
            return Err(format!("the shard table counts {count} shards and holds {}", table.len()));
        }
        Ok(())
    }

    /// Locks `shard` for a call that may change its counters, and puts it on the dirty list
    /// if it is not on it yet. Its front cache is merged into its pools (see [`Shard::lock`]).
    #[inline]
    pub fn lock_for_change<'a>(&self, shard: &'a Arc<Shard>) -> MutexGuard<'a, ShardState> {
        self.dirty_on_change(shard, shard.lock())
    }

    /// [`ShardTable::lock_for_change`] for malloc and free on the hit path, which use the
    /// front cache as it is ([`Shard::lock_hot`]).
    #[inline(always)]
    pub fn lock_hot_for_change<'a>(&self, shard: &'a Arc<Shard>) -> MutexGuard<'a, ShardState> {
        self.dirty_on_change(shard, shard.lock_hot())
    }

    /// Puts `shard`, locked as `st` by a call that will change it, on the dirty list if it is
    /// not on it yet (see [`ShardTable::lock_for_change`]).
    #[inline(always)]
    pub fn dirty_on_change<'a>(
        &self,
        shard: &'a Arc<Shard>,
        mut st: MutexGuard<'a, ShardState>,
    ) -> MutexGuard<'a, ShardState> {
        let epoch = self.epoch.load(Ordering::Relaxed);
        if st.dirty_epoch != epoch {
            st.dirty_epoch = epoch;
            self.dirty.lock().push(shard.clone());
        }
        st
    }

    /// The current settle epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Moves the epoch on and appends the shards that changed in the last one to `into`
    /// (whose buffer the list keeps, so that neither allocates once warm). Call with the
    /// device's peak lock held.
    pub fn take_dirty(&self, into: &mut Vec<Arc<Shard>>) {
        let mut d = self.dirty.lock();
        self.epoch.fetch_add(1, Ordering::Relaxed);
        if into.is_empty() {
            std::mem::swap(&mut *d, into);
        } else {
            into.append(&mut d);
        }
    }

    /// Takes out of the table every shard for which `idle` (called with its lock held, and
    /// given the current epoch) says so, flagging it retired. The shards of a private pool not
    /// yet released stay: they keep the pool's statistics. Call with the device's peak lock
    /// held, after a settle. Returns how many were retired.
    pub fn retire_idle(&self, mut idle: impl FnMut(&mut ShardState, u64) -> bool) -> usize {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let mut table = self.by_stream.lock();
        let before = table.len();
        table.retain(|_, shard| {
            let Some(mut st) = shard.try_lock() else { return true };
            if st.dirty_epoch == epoch || (shard.pool != 0 && !st.released) || !idle(&mut st, epoch) {
                return true;
            }
            shard.retire(&mut st);
            false
        });
        self.count.store(table.len(), Ordering::Relaxed);
        // The table's memory follows the streams it holds, not the most it ever held.
        if table.len() * 4 < table.capacity() {
            table.shrink_to_fit();
        }
        let mut dirty = self.dirty.lock();
        if dirty.len() * 4 < dirty.capacity() {
            dirty.shrink_to_fit();
        }
        before - table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_sees_a_count_that_is_not_the_tables() {
        let t = ShardTable::default();
        t.get_or_create(0, 0x10);
        t.get_or_create(0, 0x20);
        t.get_or_create(0, 0x10);
        assert_eq!((t.count(), t.check()), (2, Ok(())));
        t.count.store(3, Ordering::Relaxed);
        assert!(t.check().is_err());
    }
}
