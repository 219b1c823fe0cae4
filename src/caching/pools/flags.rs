//! The flags a private pool is created with (`gpupool_pool_create_ex`, PyTorch
//! `torch.cuda.MemPool(use_on_oom=, no_split=)`): a process-wide table by pool id, as pool ids
//! are, written once before the id is handed out and read only where a pool's shard is made
//! (`no_split`) and on the out-of-memory path (`use_on_oom`), never on the hit path.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::RwLock;
use rustc_hash::FxHashMap;

use crate::error::Error;

/// The pool serves, from its cache, the requests to the default pools that would fail with
/// out of memory (PyTorch `MemPool(use_on_oom=True)`, `setUseOnOOM`). The C header's is
/// `GPUPOOL_POOL_USE_ON_OOM`.
/// cbindgen:ignore
pub const POOL_USE_ON_OOM: u32 = 1;
/// The pool's blocks are never split: each request takes a whole cached block or a whole new
/// segment (PyTorch `MemPool(no_split=True)`, `setNoSplit`). The C header's is
/// `GPUPOOL_POOL_NO_SPLIT`.
/// cbindgen:ignore
pub const POOL_NO_SPLIT: u32 = 2;
/// Every flag gpupool knows.
const KNOWN: u32 = POOL_USE_ON_OOM | POOL_NO_SPLIT;

/// The flags of the pools created with any, by id (a few bytes a pool, for the life of the
/// process, as the ids handed out).
static FLAGS: RwLock<Option<FxHashMap<u64, u32>>> = RwLock::new(None);
/// Whether any pool was ever created with [`POOL_USE_ON_OOM`]: until one is, the
/// out-of-memory path looks no further.
static ANY_USE_ON_OOM: AtomicBool = AtomicBool::new(false);

/// `flags` checked: only bits gpupool knows.
///
/// Errors: [`Error::InvalidValue`] naming the unknown bits.
pub(crate) fn check(flags: u32) -> Result<u32, Error> {
    let unknown = flags & !KNOWN;
    if unknown != 0 {
        return Err(Error::InvalidValue(format!(
            "pool flags {flags:#x} carry unknown bits {unknown:#x}: only GPUPOOL_POOL_USE_ON_OOM ({POOL_USE_ON_OOM:#x}) \
             and GPUPOOL_POOL_NO_SPLIT ({POOL_NO_SPLIT:#x}) exist"
        )));
    }
    Ok(flags)
}

/// Records `flags` (checked) as `pool`'s, before any shard of the pool exists.
pub(crate) fn set(pool: u64, flags: u32) {
    if flags == 0 {
        return;
    }
    FLAGS.write().get_or_insert_with(FxHashMap::default).insert(pool, flags);
    if flags & POOL_USE_ON_OOM != 0 {
        ANY_USE_ON_OOM.store(true, Ordering::Release);
    }
}

/// The flags `pool` was created with (0: none, and for the default pools).
pub(crate) fn get(pool: u64) -> u32 {
    if pool == 0 {
        return 0;
    }
    FLAGS.read().as_ref().and_then(|m| m.get(&pool).copied()).unwrap_or(0)
}

/// Whether `pool` never splits its blocks.
pub(crate) fn no_split(pool: u64) -> bool {
    get(pool) & POOL_NO_SPLIT != 0
}

/// Whether `pool` serves the default pools' requests that would fail with out of memory.
pub(crate) fn use_on_oom(pool: u64) -> bool {
    get(pool) & POOL_USE_ON_OOM != 0
}

/// Whether any pool was created with [`POOL_USE_ON_OOM`] (one load, for the out-of-memory path).
pub(crate) fn any_use_on_oom() -> bool {
    ANY_USE_ON_OOM.load(Ordering::Acquire)
}
