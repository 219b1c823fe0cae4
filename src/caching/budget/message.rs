//! The limit as the C caller gives it, checked, and the out-of-memory message of a pool over
//! its budget.

use crate::caching::shard::Request;
use crate::error::Error;
use crate::stats::summary::format_size;

/// The limit of `gpupool_pool_set_limit`: `u64::MAX` is no limit; any other value up to
/// `i64::MAX` is a limit in bytes (0 included: the pool may reserve nothing new; a limit over
/// the device's memory never binds, the device's own out-of-memory comes first).
///
/// Errors: [`Error::InvalidValue`] for a value over `i64::MAX` but `u64::MAX` (a negative
/// number cast to unsigned, most likely).
pub(crate) fn limit_from_c(bytes: u64) -> Result<Option<i64>, Error> {
    if bytes == u64::MAX {
        return Ok(None);
    }
    i64::try_from(bytes).map(Some).map_err(|_| {
        Error::InvalidValue(format!(
            "limit {bytes} bytes is over 2^63-1 (a negative number cast to unsigned?); pass UINT64_MAX \
             (GPUPOOL_NO_LIMIT) to remove the limit"
        ))
    })
}

/// The pool's name in messages.
pub(crate) fn pool_name(pool: u64) -> String {
    if pool == 0 { "the default pools (pool 0)".to_string() } else { format!("pool {pool:#x}") }
}

/// The out-of-memory error of a request of `pool` on `device` refused by its budget: `limit`
/// bytes allowed, `used` reserved now (after its free cache was released).
pub(crate) fn over_budget(device: i32, pool: u64, limit: i64, used: i64, req: &Request) -> Error {
    Error::OutOfMemory(format!(
        "CUDA out of memory. Tried to allocate {} (for a request of {} bytes) in {} on device {device}, which is \
         limited to {} ({limit} bytes, gpupool_pool_set_limit) and reserves {} ({used} bytes) after its free cache \
         was released. Other pools and the device were not touched: free blocks of this pool or raise its limit.",
        format_size(req.segment as u64),
        req.size,
        pool_name(pool),
        format_size(limit.max(0) as u64),
        format_size(used.max(0) as u64),
    ))
}
