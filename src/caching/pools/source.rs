//! Private pools whose segments come from the program's allocator instead of the driver (the C
//! equivalent of `torch.cuda.MemPool(allocator)`, with which PyTorch takes a pool's segments
//! from `ncclMemAlloc` for NVLink SHARP). Everything else (caching, splitting, `record_stream`,
//! statistics, routes) is a private pool's (`caching::pools`).
//!
//! Pool ids are process-wide, so the sources are one process-wide table, read once per shard
//! when a pool's shard is made (`Shard::new`), never on the hit path.

use std::sync::Arc;

use parking_lot::RwLock;
use rustc_hash::FxHashMap;

use crate::driver::{DevicePtr, StreamHandle};

/// Allocates a segment of `bytes` on `device` for `stream`: its address, or `None` when it
/// cannot (gpupool then treats the device as out of memory: release-and-retry, the observers).
pub type SegmentAllocFn = dyn Fn(usize, i32, StreamHandle) -> Option<DevicePtr> + Send + Sync;
/// Frees a segment `alloc` gave: (address, bytes, device, stream).
pub type SegmentFreeFn = dyn Fn(DevicePtr, usize, i32, StreamHandle) + Send + Sync;

/// Where a pool's segments come from.
pub(crate) struct PoolSource {
    pub alloc: Box<SegmentAllocFn>,
    pub free: Box<SegmentFreeFn>,
    /// Bytes that every block and segment of the pool is a multiple of (0: none): no block is
    /// split below it, so that each block starts at a multiple of it from its segment's start
    /// (NVLink SHARP buffers from `ncclMemAlloc` need the multicast granularity).
    pub split_alignment: usize,
}

static SOURCES: RwLock<Option<FxHashMap<u64, Arc<PoolSource>>>> = RwLock::new(None);

/// Makes `source` the allocator of `pool`'s segments, before any of its shards exists.
pub(crate) fn set(pool: u64, source: PoolSource) {
    SOURCES.write().get_or_insert_with(FxHashMap::default).insert(pool, Arc::new(source));
}

/// The allocator of `pool`'s segments, if the program gave one.
pub(crate) fn get(pool: u64) -> Option<Arc<PoolSource>> {
    if pool == 0 {
        return None;
    }
    SOURCES.read().as_ref().and_then(|m| m.get(&pool).cloned())
}
