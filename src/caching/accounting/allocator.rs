//! The allocator's part of the statistics: a device's, as `torch.cuda.memory_stats` and
//! `memory_summary` report them, and gpupool's own diagnostics (settles, streams, size bins).

use crate::caching::allocator::Allocator;
use crate::error::Error;
use crate::stats::DeviceStats;
use crate::stats::summary::memory_summary;

impl Allocator {
    /// The statistics of `device` (-1: current), as `torch.cuda.memory_stats` reports them:
    /// one snapshot taken with every lock of the device held briefly.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`] (reading the
    /// current device for -1).
    pub fn stats(&self, device: i32) -> Result<DeviceStats, Error> {
        Ok(self.device_or_init(device)?.stats())
    }

    /// Sets every peak of `device` (-1: current) to its current value (PyTorch
    /// `reset_peak_memory_stats`).
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn reset_peak_stats(&self, device: i32) -> Result<(), Error> {
        self.device_or_init(device)?.reset_peak_stats();
        Ok(())
    }

    /// How many calls on `device` settled the peak statistics, visiting the shard of every
    /// stream that moved since the last settle, one at a time (see `src/caching/accounting/peaks/`): a
    /// diagnostic of the cost of exact peaks, not a PyTorch statistic. A call that runs past
    /// its stream's credit when the device's spare credit cannot cover it settles (a new peak,
    /// or credit sitting with other streams); in a steady state the count stays flat. Reads
    /// of the statistics (`stats`, `reset_peak_stats`, `empty_cache`) settle too and are not
    /// counted.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn peak_settles(&self, device: i32) -> Result<i64, Error> {
        Ok(self.device_or_init(device)?.peak_settles())
    }

    /// How many streams of `device` have state in gpupool: those holding memory (blocks,
    /// cached segments, events) and those used since the last `empty_cache`, which reclaims
    /// the state of streams that hold nothing. A diagnostic, not a PyTorch statistic.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn stream_count(&self, device: i32) -> Result<usize, Error> {
        Ok(self.device_or_init(device)?.shard_count())
    }

    /// Size bins, empty or not, in the pools of every stream of `device`: the host memory the
    /// free lists take. For tests that it follows the blocks cached, not every size ever seen.
    ///
    /// Errors: as [`Allocator::stats`].
    #[doc(hidden)]
    pub fn pool_bins(&self, device: i32) -> Result<usize, Error> {
        Ok(self.device_or_init(device)?.pool_bins())
    }

    /// The table of `torch.cuda.memory_summary` for `device` (-1: current), one line a row,
    /// sizes in PyTorch's units (B, KiB, MiB, GiB); then gpupool's lines: the private pools,
    /// and the pinned staging buffers of sleep and wake while the device holds them.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn memory_summary(&self, device: i32) -> Result<String, Error> {
        let dev = self.device_or_init(device)?;
        let mut text = memory_summary(dev.device, self.driver.name(), &dev.stats());
        text.push_str(&crate::stats::summary::pools_summary(&dev.all_pool_stats()));
        let staging = dev.staging_bytes();
        if staging > 0 {
            text.push_str(&format!(
                "Sleep and wake's pinned staging buffers (host memory, until empty_cache): {}\n",
                crate::stats::summary::format_size(staging as u64)
            ));
        }
        Ok(text)
    }
}
