//! One private pool's statistics on one device (`gpupool_pool_stats`, PyTorch's
//! `torch.cuda.memory.MemPool`'s `snapshot` and `use_count`): plain data, filled by the core's
//! pools (`caching::pools`).

use super::DeviceStats;

/// The statistics of one private pool on one device, with its state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// The pool's id.
    pub pool: u64,
    /// The counters of `torch.cuda.memory_stats()` over the pool's blocks and segments. Peaks
    /// are the highest values seen after an allocation from the pool or at a read; the event
    /// counts (`num_*`) are 0: they count the device's events.
    pub stats: DeviceStats,
    /// Whether `release_pool` released it on this device.
    pub released: bool,
    /// Routes to it active now.
    pub routes: usize,
}
