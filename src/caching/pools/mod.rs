//! Private pools (PyTorch's graph pools and `MemPool`), every part: memory that the allocations routed to
//! a pool share with nothing else, so that a CUDA graph captured with it finds its buffers
//! where it left them at every replay.
//!
//! A pool is a set of shards of the device keyed by (pool id, stream), next to the default
//! pools' (pool 0): the same blocks, segments, rules and statistics, found through the segment
//! index on free like any other. Only malloc's routing differs: while a route is active
//! (`gpupool_begin_allocate_to_pool` and its variants, PyTorch `beginAllocateToPool`), an
//! allocation that matches it goes to the pool's shard of its stream. Without routes, malloc
//! pays one relaxed load (`CaptureProbe::routes`).
//!
//! The rules, PyTorch's unless said:
//! - Inside a pool, a block freed is reused by the next allocation of the same stream routed
//!   there, during a capture too (a captured forward pass takes no more memory than an eager
//!   one); graphs that share a pool must replay in the order they were captured.
//! - A segment that served a block while the stream captured is kept reserved until the pool
//!   is released (the graph replays into it). Other wholly free segments of a live pool go
//!   back to the driver at `empty_cache` (PyTorch cannot release a live pool's memory, issue
//!   #167745).
//! - `release_pool` (PyTorch `releasePool`, for a graph destroyed or a capture that failed):
//!   routes to the pool end, its wholly free segments go back to the driver now and the others
//!   when their last block is freed; nothing is allocated from it again, and its id may not be
//!   routed to on this device again. PyTorch frees a pool only once its blocks are all free
//!   and leaks the pool of a failed capture (PR #190348).
//! - A private pool's segments are ordinary ones (never expandable): unmapping a free page would
//!   take away an address a graph uses. A sleepable pool's are expandable (`caching::sleep`),
//!   and keep the free pages of a segment a graph uses mapped.

//!
//! - [`device`]: a device's pools, routes and the pool a malloc goes to, statistics per pool,
//!   release;
//! - [`allocator`]: the calls by device, pool ids (process-wide), sleepable pools' ids;
//! - [`source`]: pools whose segments come from the program's allocator
//!   (`torch.cuda.MemPool(allocator)`);
//! - [`flags`]: the flags a pool is created with (`torch.cuda.MemPool(use_on_oom=,
//!   no_split=)`), by pool id;
//! - [`fallback`]: a default-pool request that would fail with out of memory served from the
//!   cache of the pools created with `POOL_USE_ON_OOM` (its rules are there).
//!
//! A pool created with `POOL_NO_SPLIT` never splits a block (PyTorch `should_split` is false
//! for it, PR #169739): a request takes a whole cached block that fits by PyTorch's rules (the
//! best fit, within the `max_split_size` rules) or a whole new segment sized as PyTorch sizes
//! segments (2 MiB for a request up to 1 MiB, 20 MiB up to 10 MiB, else the request rounded
//! to 2 MiB), and counts its whole size as allocated. A private pool's segments are never
//! expandable, so the question of PyTorch's expandable no-split pools (where `should_split`
//! answers false first, and the whole mapped block is handed out) does not arise.
//!
//! A pool's memory budget is `caching::budget`; a pool's sleep is `caching::sleep`.

mod allocator;
mod device;
mod fallback;
pub(crate) mod flags;
pub(crate) mod source;

pub(in crate::caching) use device::Pools;
pub(crate) use device::{RouteFilter, RouteTo};
