//! Sleep and wake of a pool on one device (see `caching::sleep` for what they do and
//! docs/sleep.md for the rules).

use super::sleepers::SleepMode;
use crate::caching::allocator::Allocator;
use crate::error::Error;

impl Allocator {
    /// Puts `pool` on `device` (-1: current) to sleep: 0 names the device's default pools,
    /// any other id a private pool made by [`Allocator::pool_create_sleepable`]. Waits (by
    /// events) for the work queued on the pool's blocks, copies its live blocks to host memory
    /// through the device's pinned staging ring ([`SleepMode::Offload`]) or not ([`SleepMode::Discard`]), then gives every page
    /// of its memory back to the driver: free device memory rises by the pool's reserved
    /// bytes. Its blocks keep their addresses; nothing can be allocated from it until
    /// [`Allocator::wake`]; its blocks may be freed meanwhile.
    ///
    /// Errors, each leaving every pool as it was: [`Error::InvalidValue`] (a pool never made,
    /// a device out of range, a pool whose memory is not on the virtual memory API, naming
    /// why, a pool asleep already or released); [`Error::Capture`] while a capture may be under
    /// way on the device; [`Error::OutOfMemory`] when the host cannot pin the staging ring or
    /// give the copy's memory;
    /// [`Error::Cuda`] when waiting or copying fails. A driver failure while the pages are
    /// given back leaves the pool asleep, and says so ([`Error::Cuda`]). A pool holding blocks
    /// exported to other processes ([`Allocator::ipc_export`], live or freed while imported)
    /// is refused ([`Error::InvalidValue`]): their importers would keep the old pages.
    pub fn sleep(&self, device: i32, pool: u64, mode: SleepMode) -> Result<(), Error> {
        if pool != 0 {
            Self::check_pool(pool)?;
        }
        let dev = self.device_or_init(device)?;
        self.reclaim_limbo();
        dev.sleep(pool, mode, || self.ipc_refuse_sleep(dev.device, pool))
    }

    /// Wakes `pool` on `device` (-1: current): maps new memory at the addresses of every page
    /// it gave back, puts the copies of its live blocks back (offload) and frees them. All or
    /// nothing: when the device cannot give the memory (after the cache of its other pools was
    /// released), the pool stays asleep with its host copy and the call fails.
    ///
    /// Errors, each leaving the pool asleep: [`Error::InvalidValue`] (a pool never made, a
    /// device out of range, a pool that does not sleep); [`Error::Capture`];
    /// [`Error::OutOfMemory`]; [`Error::Cuda`].
    pub fn wake(&self, device: i32, pool: u64) -> Result<(), Error> {
        if pool != 0 {
            Self::check_pool(pool)?;
        }
        self.device_or_init(device)?.wake(pool)
    }

    /// Bytes of pinned host memory held by `device`'s (-1: current) staging ring of sleep and
    /// wake with offload: `GPUPOOL_SLEEP_BUFFERS` times `GPUPOOL_SLEEP_CHUNK` from the first
    /// offload or restore of the device until [`Allocator::empty_cache`], 0 otherwise. Counted
    /// in no statistic of the device (it is host memory) nor of the pinned host allocator (it
    /// is not its memory). Thread-safe; no driver call.
    ///
    /// Errors: [`Error::InvalidValue`] for a device out of range.
    pub fn sleep_staging_bytes(&self, device: i32) -> Result<usize, Error> {
        Ok(self.device_or_init(device)?.staging_bytes())
    }

    /// Bytes of pinned host memory that pools of `device` (-1: current) keep for their next
    /// [`SleepMode::OffloadPinned`] sleep: `pool`'s, or every pool's with `None`. A sleeping
    /// pool's copy is in use, not kept: 0 until it wakes. Counted in no statistic of the device
    /// (host memory) nor of the pinned host allocator (not its memory). Thread-safe; no
    /// driver call.
    ///
    /// Errors: [`Error::InvalidValue`] for a device out of range or a pool never made.
    pub fn sleep_kept_bytes(&self, device: i32, pool: Option<u64>) -> Result<usize, Error> {
        if let Some(p) = pool.filter(|&p| p != 0) {
            Self::check_pool(p)?;
        }
        Ok(self.device_or_init(device)?.kept_bytes(pool))
    }

    /// Gives back the pinned host copy `pool` (0: the default pools) on `device` (-1: current)
    /// keeps for its next [`SleepMode::OffloadPinned`] sleep (`cuMemHostUnregister`, then
    /// `munmap`), and returns its bytes. A sleeping pool's copy is in use, and stays: call it
    /// after the wake. Thread-safe.
    ///
    /// Errors: [`Error::InvalidValue`] for a device out of range or a pool never made.
    pub fn sleep_release_kept(&self, device: i32, pool: u64) -> Result<usize, Error> {
        if pool != 0 {
            Self::check_pool(pool)?;
        }
        Ok(self.device_or_init(device)?.release_kept(pool))
    }

    /// Makes the host memory of a sleep of `pool` (0: the default pools) on `device` (-1:
    /// current) in `mode` ready now, before the pool's first sleep, and returns the pinned
    /// bytes held for it: with [`SleepMode::OffloadPinned`], a pinned copy of each stream's
    /// live bytes, kept as a sleep in that mode keeps it (counted by
    /// [`Allocator::sleep_kept_bytes`], given back by [`Allocator::sleep_release_kept`]); with
    /// [`SleepMode::Offload`], the device's staging ring (until [`Allocator::empty_cache`]);
    /// with [`SleepMode::Discard`], nothing. Not in PyTorch (vLLM allocates its backup before
    /// sleeping). Thread-safe; do not call it while the same pool sleeps in another thread
    /// (refused when it sleeps already).
    ///
    /// Errors, each leaving the pool awake and what it keeps as it was: [`Error::InvalidValue`]
    /// (a pool never made, released, asleep, or one that cannot sleep, a device out of range);
    /// [`Error::OutOfMemory`] when the host cannot pin the memory; [`Error::Cuda`] when
    /// registering it fails.
    pub fn sleep_prepare(&self, device: i32, pool: u64, mode: SleepMode) -> Result<usize, Error> {
        if pool != 0 {
            Self::check_pool(pool)?;
        }
        self.device_or_init(device)?.sleep_prepare(pool, mode)
    }
}
