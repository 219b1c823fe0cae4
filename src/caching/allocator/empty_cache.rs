//! Memory given back to the driver (`empty_cache`, the device synchronisation that
//! `free_after_device_sync` waits for) and the memory fraction that bounds what a device
//! reserves.

use super::Allocator;
use crate::caching::deferred::DeferredStats;
use crate::error::Error;

impl Allocator {
    /// Synchronises `device` (-1: every device in use) if blocks freed with
    /// [`Allocator::free_after_device_sync`] await it, and returns them to their pools. Returns
    /// how many were released. Blocks the calling thread until the device is idle.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`] (the
    /// synchronisation failed; the blocks stay deferred).
    pub fn release_deferred(&self, device: i32) -> Result<usize, Error> {
        crate::caching::fork::check()?;
        if device == -1 {
            let mut n = 0;
            for dev in self.devices.iter().filter_map(|d| d.get()) {
                n += dev.release_deferred()?;
            }
            return Ok(n);
        }
        self.device_or_init(device)?.release_deferred()
    }

    /// What awaits a device synchronisation on `device`, and what synchronisations released so
    /// far. For a device ordinal (not -1) it reads counters only, with no driver call, so it is
    /// safe at process exit.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range).
    pub fn deferred(&self, device: i32) -> Result<DeferredStats, Error> {
        Ok(self.device_or_init(device)?.deferred())
    }

    /// Returns every wholly free cached segment to the driver, after waiting for all pending
    /// events (PyTorch `emptyCache`), and with expandable segments every wholly free page and
    /// the physical pages held unmapped. `device` -1: every device in use.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`].
    pub fn empty_cache(&self, device: i32) -> Result<(), Error> {
        crate::caching::fork::check()?;
        self.ipc_reclaim();
        if device == -1 {
            for dev in self.devices.iter().filter_map(|d| d.get()) {
                dev.release_cached_blocks()?;
            }
            return Ok(());
        }
        self.device_or_init(device)?.release_cached_blocks()
    }

    /// Limits `device` (-1: current) to reserving at most `fraction` of its total memory
    /// (PyTorch `torch.cuda.set_per_process_memory_fraction` / `setMemoryFraction`). A
    /// segment that would pass the limit is treated as out of memory: gpupool releases its
    /// cache and retries as for a full device, then fails with the out-of-memory error.
    /// Segments already reserved stay. 1.0 allows the whole device. The limit counts physical
    /// memory: with expandable segments, the pages held unmapped too
    /// ([`crate::stats::DeviceStats::unmapped_held_bytes`]).
    ///
    /// Errors: [`Error::InvalidValue`] (`fraction` not within 0 to 1, device out of range),
    /// [`Error::Cuda`] (the device's total cannot be read).
    pub fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidValue(format!(
                "memory fraction {fraction} is not valid: expected a value from 0 to 1"
            )));
        }
        self.device_or_init(device)?.set_memory_fraction(fraction)
    }
}
