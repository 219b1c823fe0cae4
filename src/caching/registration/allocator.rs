//! `Allocator::mapped_range` and `Allocator::mapped_range_dmabuf`: the checks, the shard found
//! by the segment index, the run read under its lock, and the driver's descriptor made while
//! that lock keeps the run mapped.

use std::os::fd::OwnedFd;

use super::MappedRange;
use super::shard::unknown;
use crate::caching::allocator::Allocator;
use crate::driver::DevicePtr;
use crate::error::Error;

impl Allocator {
    /// The mapped run around `ptr` (see `caching::registration`): any byte of a live
    /// allocation of this allocator, interior pointers included. See
    /// `gpupool_segment_mapped_range`.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer in no segment of gpupool's, or in a
    /// block that is not allocated (freed, cached, unmapped address space);
    /// [`Error::InvalidValue`] inside a segment observer (the stream's lock may be held by the
    /// very call that told it) and for a pool that sleeps. Nothing changes.
    pub fn mapped_range(&self, ptr: DevicePtr) -> Result<MappedRange, Error> {
        self.with_mapped_run(ptr, |_, run| Ok(run))
    }

    /// [`Allocator::mapped_range`] and a dma-buf descriptor of exactly that run
    /// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`), made while the
    /// stream's lock keeps the run mapped. The caller owns the descriptor.
    ///
    /// Errors: those of [`Allocator::mapped_range`]; the driver's refusal
    /// ([`Error::DriverUnavailable`] where it cannot export dma-bufs, [`Error::Cuda`] for a
    /// range it refuses, [`Error::OutOfMemory`]). Nothing changes.
    pub fn mapped_range_dmabuf(&self, ptr: DevicePtr) -> Result<(MappedRange, OwnedFd), Error> {
        self.with_mapped_run(ptr, |driver, run| {
            let fd = driver.mem_range_dmabuf(run.device, run.base, run.bytes).map_err(|e| {
                Error::driver(
                    e,
                    &format!(
                        "exporting the mapped range {:#x}+{} of device {} as a dma-buf",
                        run.base, run.bytes, run.device
                    ),
                )
            })?;
            Ok((run, fd))
        })
    }

    /// Finds `ptr`'s run and calls `then` with it under its shard's lock.
    fn with_mapped_run<R>(
        &self,
        ptr: DevicePtr,
        then: impl FnOnce(&dyn crate::driver::Driver, MappedRange) -> Result<R, Error>,
    ) -> Result<R, Error> {
        crate::caching::fork::check()?;
        if crate::caching::observers::segments::observing() {
            return Err(Error::InvalidValue(
                "a mapped range cannot be asked from inside a segment observer (its stream may be locked by the call \
                 that told it): note the event's range, and ask once the observer has returned"
                    .into(),
            ));
        }
        let found = self.index.with_segment(ptr, |seg| seg.map(|e| (e.base, e.device, e.owner.clone())));
        let Some((base, device, shard)) = found else {
            return Err(Error::InvalidPointer(unknown(ptr)));
        };
        let st = shard.lock();
        let run = st.mapped_run(base, ptr)?;
        let run = MappedRange { device, stream: shard.stream, pool: shard.pool, ..run };
        then(&*self.driver, run)
    }
}
