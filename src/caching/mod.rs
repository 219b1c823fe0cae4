//! The allocator core: PyTorch's caching rules over any [`crate::driver::Driver`], testable
//! with no GPU. Nothing here is C API; the Rust API is [`crate::Allocator`].
//!
//! - `allocator`: the front door, over every device.
//! - `device`: one device's shards, malloc with free-and-retry, empty_cache, statistics, and
//!   its consistency check.
//! - `shard`: one stream of one device behind its own lock (blocks, segments, the check).
//! - `block`, `pool`: blocks and the free lists they sit in; `rules`: the size rules.
//! - `events`: the events of `record_stream`; `deferred`: frees that wait for a device
//!   synchronisation.
//! - `counters`, `peaks`: statistics counted per shard, exact device peaks from credit;
//!   `cells`: the statistics' layout and the device's totals, which both use (a leaf);
//!   `limit`: the memory fraction's byte limit; `oom`: the out-of-memory message;
//!   `page_pool`: the physical pages a device holds unmapped for expandable segments;
//!   `observers`: the functions called when a request fails; `largest`: the largest request
//!   that would succeed now, malloc's attempts replayed on a copy of a stream's blocks.
//! - `shard_table`: a device's shards by stream, the dirty list of settles, retirement.
//! - `capture`: knowing whether a CUDA graph capture is under way; `device::pools`: private
//!   pools and the routes to them.
//! - `segment_index`: from an address to the shard that owns it; `fork`: refusing service in
//!   a forked child.

pub(crate) mod allocator;
mod block;
mod budget;
mod capture;
mod cells;
mod copy;
mod copy_direct;
pub(crate) mod counters;
mod crew;
pub(crate) mod deferred;
pub(crate) mod device;
mod events;
mod expandable;
pub(crate) mod fork;
mod kept;
mod largest;
mod limit;
mod observer_list;
pub(crate) mod observers;
mod oom;
mod page_pool;
mod peaks;
mod pool;
pub(crate) mod pool_source;
pub(crate) mod rules;
pub(crate) mod segment_index;
pub(crate) mod segment_observers;
mod shard;
mod shard_table;
mod size_set;
pub(crate) mod sleep;
mod staging;
