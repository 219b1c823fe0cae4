//! The copies of a sleep and a wake whose host copy is pinned (`GPUPOOL_SLEEP_OFFLOAD_PINNED`,
//! see `pinned_copies`): no staging ring and no CPU copy; each run of blocks goes straight
//! between the device and the host copy (`cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync`), cut into
//! pieces of [`PIECE`] bytes dealt in turn to [`COPY_STREAMS`] streams of gpupool's own, as
//! `test_sleep`'s pinned bandwidth is measured (55 GB/s each way on an H100, 2026-11-27).

use super::copy::{COPY_STREAMS, Copies, Way, end_streams};
use crate::driver::{DevicePtr, Driver, DriverError, HostPtr, StreamHandle};

/// Bytes of one copy: large enough that the copy engines run at the bus's speed, small
/// enough that both streams have work.
pub(crate) const PIECE: usize = 64 << 20;

/// One sleep's or wake's direct copies. Dropped, it waits for its streams (no copy outlives
/// the memory it reads or writes) and destroys them.
pub(crate) struct Direct<'a> {
    driver: &'a dyn Driver,
    device: i32,
    way: Way,
    streams: Vec<StreamHandle>,
    /// Copies queued: which stream the next takes.
    queued: usize,
}

impl<'a> Direct<'a> {
    /// [`COPY_STREAMS`] new streams on `device` (non-blocking), to copy `way`.
    ///
    /// Errors: the driver's; the streams made are destroyed.
    pub fn new(driver: &'a dyn Driver, device: i32, way: Way) -> Result<Direct<'a>, DriverError> {
        let mut d = Direct { driver, device, way, streams: Vec::with_capacity(COPY_STREAMS), queued: 0 };
        for _ in 0..COPY_STREAMS {
            d.streams.push(driver.stream_create(device)?);
        }
        Ok(d)
    }
}

impl Copies for Direct<'_> {
    /// Queues the copies of `len` bytes between pinned `host` and `dev`.
    fn add(&mut self, host: HostPtr, dev: DevicePtr, len: usize) -> Result<(), DriverError> {
        let mut off = 0;
        while off < len {
            let n = PIECE.min(len - off);
            let s = self.streams[self.queued % self.streams.len()];
            match self.way {
                Way::Offload => self.driver.memcpy_dtoh_async(self.device, host + off, dev + off as u64, n, s)?,
                Way::Restore => self.driver.memcpy_htod_async(self.device, dev + off as u64, host + off, n, s)?,
            }
            self.queued += 1;
            off += n;
        }
        Ok(())
    }

    /// Waits for every copy queued (`cuStreamSynchronize` of each stream).
    fn finish(&mut self) -> Result<(), DriverError> {
        for &s in &self.streams {
            self.driver.stream_synchronize(self.device, s)?;
        }
        Ok(())
    }
}

impl Drop for Direct<'_> {
    fn drop(&mut self) {
        end_streams(self.driver, self.device, std::mem::take(&mut self.streams));
    }
}
