//! The largest single request a stream of a device would be served now, over every device
//! (`gpupool_largest_allocatable`): the allocator's part of `caching::largest`.

use crate::caching::allocator::Allocator;
use crate::driver::StreamHandle;
use crate::error::Error;

impl Allocator {
    /// The largest single request in bytes that [`Allocator::malloc`] on `device` (-1:
    /// current) and `stream` would serve now, counting the stream's cached free blocks, the
    /// free pages and unmapped room of its expandable segments, what the driver has free
    /// (`cuMemGetInfo`) within the memory fraction and the default pools' limit
    /// (`pool_set_limit` with pool 0), and what release-and-retry would give
    /// back (every stream's wholly free cached segments and pages); 0 when every request but
    /// one of 0 bytes would fail. RMM's `available_device_memory` (rapidsai/rmm#813) answers
    /// with `cudaMemGetInfo` alone; PyTorch has no equivalent. Success is not monotone in the
    /// size (see `docs/c-and-cpp.md`): a smaller request may fail where this one succeeds.
    ///
    /// Changes nothing: no allocation, release, synchronisation or statistic. Each shard of the
    /// device is locked in turn, briefly, so the answer is a snapshot that other threads may
    /// make stale at once (see `gpupool_largest_allocatable` for what makes it too high or too
    /// low). The answer is for the device's default pools, not a private pool a route takes.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`] (`cuMemGetInfo`,
    /// `cuStreamGetCaptureInfo` or `cuEventQuery` failed), [`Error::DriverUnavailable`].
    pub fn largest_allocatable(&self, device: i32, stream: StreamHandle) -> Result<usize, Error> {
        self.device_or_init(device)?.largest_allocatable(stream)
    }
}
