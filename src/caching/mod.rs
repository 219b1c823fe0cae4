//! The allocator core: PyTorch's caching rules over any [`crate::driver::Driver`], testable
//! with no GPU. Nothing here is C API; the Rust API is [`crate::Allocator`].
//!
//! - `allocator`: the front door, over every device.
//! - `device`: one device's shards, malloc with free-and-retry, empty_cache, and its
//!   consistency check.
//! - `shard`: one stream of one device behind its own lock (blocks, segments, the check).
//! - `block`, `pool`: blocks and the free lists they sit in; `size_set`: the sizes a pool
//!   holds free blocks of, the best fit's first step; `rules`: the size rules.
//! - `expandable`: expandable segments, every part in one folder: a range's page table
//!   (PyTorch `ExpandableSegment`), the device's held pages, a shard's growth and unmapping,
//!   the high-water rule.
//! - `breakdown`: where a device's reserved bytes go (`Allocator::breakdown`), every part.
//! - `events`: the events of `record_stream`; `deferred`: frees that wait for a device
//!   synchronisation.
//! - `accounting`: the statistics, every part in one folder: their cells' layout, what each
//!   shard counts, exact device peaks from credit, and the device's and allocator's parts.
//! - `limit`: the memory fraction's byte limit; `budget`: per-pool memory budgets
//!   (`gpupool_pool_set_limit`), every part in one folder; `charge`: the count both charge
//!   before the driver is asked.
//! - `observers`: the observers and out of memory, every part in one folder: a malloc that
//!   failed after the cache and a new segment (release-and-retry, the out-of-memory observers
//!   called, the error and its message), the segment observers, told of every segment made and
//!   given back and of every page range mapped and unmapped, and the registry both kinds use.
//! - `largest`: the largest request that would succeed now, malloc's attempts replayed on a
//!   copy of a stream's blocks, every part in one folder: the search and the allocator's,
//!   device's and shard's parts.
//! - `shard_table`: a device's shards by stream, the dirty list of settles, retirement.
//! - `capture`: knowing whether a CUDA graph capture is under way; `pools`: private pools
//!   (PyTorch's graph pools and `MemPool`), every part in one folder: the routes to them, the
//!   calls by device, pools whose segments come from the program's allocator.
//! - `segment_index`: from an address to the shard that owns it; `fork`: refusing service in
//!   a forked child.
//! - `history`: the core's side of the allocation history (`crate::history`): what the
//!   allocator, each device and each stream record, and the state they give a snapshot.
//! - `ipc`: memory shared between processes (`gpupool_ipc_*`), every part in one folder: the
//!   protocol (handle, shared record, export and import tables) and the allocator's, device's
//!   and shard's parts.
//! - `sleep`: sleep and wake (`gpupool_sleep`, `gpupool_wake`), every part in one folder: the
//!   modes, the allocator's, device's and shard's parts, the copy engine.
//! - `peers`: the devices a device's mapped memory is granted to besides itself
//!   (`gpupool_enable_peer_access`, PyTorch's `enablePeerAccess`), every part in one folder.
//! - `registration`: the whole mapped range of a pointer's segment, and a dma-buf descriptor
//!   of it, for transports to register once (`gpupool_segment_mapped_range`), every part in
//!   one folder.
//! - `retire`: a stream about to be destroyed (`gpupool_stream_retire`): its work waited for,
//!   so that the next stream CUDA gives its handle reuses what was freed on it safely.

mod accounting;
pub(crate) mod allocator;
mod block;
mod breakdown;
mod budget;
mod capture;
mod charge;
pub(crate) mod deferred;
pub(crate) mod device;
mod events;
mod expandable;
pub(crate) mod fork;
mod history;
pub(crate) mod ipc;
mod largest;
mod limit;
pub(crate) mod observers;
mod peers;
mod pool;
pub(crate) mod pools;
pub(crate) mod registration;
mod retire;
pub(crate) mod rules;
pub(crate) mod segment_index;
mod shard;
mod shard_table;
mod size_set;
pub(crate) mod sleep;
