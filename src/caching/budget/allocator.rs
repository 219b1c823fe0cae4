//! Per-pool memory budgets (`caching::budget`): the calls that set and read a pool's limit on
//! a device.

use crate::caching::allocator::Allocator;
use crate::error::Error;

impl Allocator {
    /// Sets the most bytes `pool` may reserve on `device` (-1: current); `pool` 0 names the
    /// default pools (every stream's, together); `limit` `None` removes the limit. From then on
    /// a growth of the pool (a new segment, pages mapped) that would take its reserved bytes
    /// past the limit releases the pool's own free cache and retries, then fails as out of
    /// memory, the observers told, the message naming the pool, its limit and its use; other
    /// pools and the driver are not touched. Nothing is released by the call: a limit under the
    /// pool's use refuses its growths until it shrinks. Not in PyTorch, whose one limit is the
    /// process's fraction of the device ([`Allocator::set_memory_fraction`], which still
    /// applies: the first limit reached refuses).
    ///
    /// Errors: [`Error::InvalidValue`], nothing changed: a pool never created, a pool released on
    /// the device, a limit over `i64::MAX` bytes but `u64::MAX` (no limit, as `None`), a device
    /// out of range.
    pub fn pool_set_limit(&self, device: i32, pool: u64, limit: Option<u64>) -> Result<(), Error> {
        if pool != 0 {
            Self::check_pool(pool)?;
        }
        // `u64::MAX` is no limit too, as in C; `i64::MAX` is none in effect.
        let limit = match limit {
            None => None,
            Some(bytes) => crate::caching::budget::limit_from_c(bytes)?,
        };
        self.device_or_init(device)?.set_pool_limit(pool, limit)
    }

    /// The limit of `pool` (0: the default pools) on `device` in bytes; `None` when none is set.
    ///
    /// Errors: [`Error::InvalidValue`]: a pool never created, a device out of range.
    pub fn pool_limit(&self, device: i32, pool: u64) -> Result<Option<u64>, Error> {
        if pool != 0 {
            Self::check_pool(pool)?;
        }
        Ok(self.device_or_init(device)?.pool_limit(pool).map(|l| l as u64))
    }
}
