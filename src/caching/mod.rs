//! The allocator core: PyTorch's caching rules over any [`crate::driver::Driver`], testable
//! with no GPU.
//!
//! - [`rules`]: the size rules (rounding, pools, segment sizes, splitting).
//! - `block`, `pool`: blocks and the free lists they sit in.
//! - `shard`: one stream of one device, behind its own lock.
//! - `device`: one device's shards, malloc with free-and-retry, empty_cache, statistics.
//! - `segment_index`: from an address to the shard that owns it.
//! - [`allocator`]: the front door, over every device.

pub mod allocator;
mod block;
mod device;
mod pool;
pub mod rules;
mod segment_index;
mod shard;
