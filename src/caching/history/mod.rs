//! The allocator core's side of the allocation history (`crate::history`: the recorder, the
//! traces, stacks, tags, snapshots and PyTorch's pickle, which import nothing from here): where
//! the allocator, each device and each stream record their events and hand over their state,
//! in reading order:
//!
//! - `allocator.rs`: `Allocator::record_history`, `history`, `snapshot`, the statistics of
//!   tags and the live report, over every device.
//! - `device.rs`: a device's recording level, the `oom` event of a request that failed, its
//!   live blocks for the report, and its segments and trace for a snapshot, taken with every
//!   shard locked.
//! - `shard.rs`: one stream's events (`alloc`, `free_requested`, `free_completed`, segments,
//!   pages mapped and unmapped) recorded under its lock as they happen, each block's and
//!   segment's context, and its segments for a snapshot.
//!
//! Malloc and free read the history's flag on the hit path (`crate::history::HistoryHook`);
//! what they record when it is on is here.

mod allocator;
mod device;
mod shard;
