//! The copies of `gpupool_sleep` (device memory to pinned host memory, offload) and
//! `gpupool_wake` (back): queued on [`COPY_STREAMS`] streams of gpupool's own, in pieces of
//! at most [`PIECE`] bytes dealt to the streams in turn, so that the copy engines of the
//! device work on several pieces at once and a large block is not copied by one stream
//! alone; then every stream is waited for.
//!
//! The host side is the pinned memory that holds the copy itself (`cuMemHostAlloc`), so that
//! each piece is one DMA transfer at the bus's speed, with no staging through pageable
//! memory (vLLM's sleep mode copies each allocation with a synchronous `cudaMemcpy` into
//! pinned memory, one at a time).

use crate::driver::{DevicePtr, Driver, DriverError, HostPtr, StreamHandle};

/// Copy streams per sleep or wake: an H100 has two copy engines per direction in use by
/// `cudaMemcpyAsync` on separate streams.
pub(crate) const COPY_STREAMS: usize = 2;

/// The largest piece queued as one copy, in bytes: large enough that a copy's fixed cost
/// (a few microseconds) is under 1% of its time at 50 GB/s, small enough that a block of
/// hundreds of MiB is spread over every stream.
pub(crate) const PIECE: usize = 64 << 20;

/// A set of copy streams on one device. Dropped, it waits for its streams (so that no copy
/// outlives the memory it reads or writes) and destroys them.
pub(crate) struct Copier<'a> {
    driver: &'a dyn Driver,
    device: i32,
    streams: Vec<StreamHandle>,
    next: usize,
}

impl<'a> Copier<'a> {
    /// [`COPY_STREAMS`] new streams on `device` (`cuStreamCreate`, non-blocking).
    ///
    /// Errors: the driver's; the streams made are destroyed.
    pub fn new(driver: &'a dyn Driver, device: i32) -> Result<Copier<'a>, DriverError> {
        let mut c = Copier { driver, device, streams: Vec::with_capacity(COPY_STREAMS), next: 0 };
        for _ in 0..COPY_STREAMS {
            c.streams.push(driver.stream_create(device)?);
        }
        Ok(c)
    }

    /// Queues a copy of `len` bytes from device memory at `src` to pinned host memory at `dst`.
    ///
    /// Errors: the driver's; pieces queued before it stay queued.
    pub fn offload(&mut self, dst: HostPtr, src: DevicePtr, len: usize) -> Result<(), DriverError> {
        self.pieces(len, |d, s, off, n| d.memcpy_dtoh_async(s.0, dst + off, src + off as u64, n, s.1))
    }

    /// Queues a copy of `len` bytes from pinned host memory at `src` to device memory at `dst`.
    ///
    /// Errors: the driver's; pieces queued before it stay queued.
    pub fn restore(&mut self, dst: DevicePtr, src: HostPtr, len: usize) -> Result<(), DriverError> {
        self.pieces(len, |d, s, off, n| d.memcpy_htod_async(s.0, dst + off as u64, src + off, n, s.1))
    }

    /// Calls `copy(driver, (device, stream), offset, bytes)` for each piece of `len` bytes, the
    /// streams in turn.
    fn pieces(
        &mut self,
        len: usize,
        copy: impl Fn(&dyn Driver, (i32, StreamHandle), usize, usize) -> Result<(), DriverError>,
    ) -> Result<(), DriverError> {
        let mut off = 0;
        while off < len {
            let n = PIECE.min(len - off);
            let stream = self.streams[self.next % self.streams.len()];
            self.next += 1;
            copy(self.driver, (self.device, stream), off, n)?;
            off += n;
        }
        Ok(())
    }

    /// Waits for every copy queued (`cuStreamSynchronize` on each stream).
    ///
    /// Errors: the first failure; every stream is still waited for.
    pub fn finish(&mut self) -> Result<(), DriverError> {
        let mut first = Ok(());
        for &s in &self.streams {
            if let Err(e) = self.driver.stream_synchronize(self.device, s) {
                first = first.and(Err(e));
            }
        }
        first
    }
}

impl Drop for Copier<'_> {
    /// Never panics (it may run while a panic unwinds): a driver call that fails or unwinds
    /// here leaks the stream, which holds no memory of the pool.
    fn drop(&mut self) {
        let (driver, device) = (self.driver, self.device);
        for s in std::mem::take(&mut self.streams) {
            let _ = quietly(|| driver.stream_synchronize(device, s));
            let _ = quietly(|| driver.stream_destroy(device, s));
        }
    }
}

/// Runs a driver call whose failure the caller ignores, a panic included (a destructor's, or
/// one that frees what holds nothing of the device).
fn quietly<T>(call: impl FnOnce() -> Result<T, DriverError>) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).ok()?.ok()
}

/// Pinned host memory for one shard's copy (`cuMemHostAlloc`), freed when dropped unless
/// kept with [`HostCopy::keep`].
pub(crate) struct HostCopy<'a> {
    driver: &'a dyn Driver,
    device: i32,
    pub ptr: HostPtr,
    pub size: usize,
}

impl<'a> HostCopy<'a> {
    /// `size` bytes of pinned host memory (0: none, with no driver call).
    ///
    /// Errors: the driver's ([`DriverError::OutOfMemory`] when the host cannot pin that much).
    pub fn new(driver: &'a dyn Driver, device: i32, size: usize) -> Result<HostCopy<'a>, DriverError> {
        let ptr = if size == 0 { 0 } else { driver.host_alloc(device, size)? };
        Ok(HostCopy { driver, device, ptr, size })
    }

    /// The memory stays allocated: its owner frees it with [`free_host`].
    pub fn keep(self) -> (HostPtr, usize) {
        let r = (self.ptr, self.size);
        std::mem::forget(self);
        r
    }
}

impl Drop for HostCopy<'_> {
    fn drop(&mut self) {
        free_host(self.driver, self.device, self.ptr);
    }
}

/// Frees pinned host memory from [`HostCopy`] (`cuMemFreeHost`; 0: none). A failure, or a
/// driver call that unwinds, leaks it: it holds nothing of the device. Never panics.
pub(crate) fn free_host(driver: &dyn Driver, device: i32, ptr: HostPtr) {
    if ptr != 0 {
        let _ = quietly(|| driver.host_free(device, ptr));
    }
}
