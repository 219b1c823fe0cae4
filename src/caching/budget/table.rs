//! A device's pool budgets by pool id: found by a pool's shards when they are made (each keeps
//! its pool's), and by the calls that set and read a limit.

use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::PoolBudget;

/// The budgets of one device's pools (pool 0: the default pools). A leaf lock: held while
/// taking no other.
#[derive(Default)]
pub(crate) struct Budgets {
    by_pool: Mutex<FxHashMap<u64, Arc<PoolBudget>>>,
}

impl Budgets {
    /// The budget of `pool`, made (with no limit) on first use.
    pub fn get_or_create(&self, pool: u64) -> Arc<PoolBudget> {
        self.by_pool.lock().entry(pool).or_insert_with(|| Arc::new(PoolBudget::new(pool))).clone()
    }

    /// The budget of `pool`, if it was ever used or limited.
    pub fn get(&self, pool: u64) -> Option<Arc<PoolBudget>> {
        self.by_pool.lock().get(&pool).cloned()
    }

    /// Forgets the budget of a released pool that holds nothing any more (its limit with it),
    /// so that churning pools does not grow the table.
    pub fn forget(&self, pool: u64) {
        self.by_pool.lock().remove(&pool);
    }

    /// Every budget, for the consistency check.
    pub fn all(&self) -> Vec<Arc<PoolBudget>> {
        self.by_pool.lock().values().cloned().collect()
    }
}
