//! The copies of `gpupool_sleep` (a pool's live blocks from the device to their host copy,
//! offload) and `gpupool_wake` (back), through the device's pinned staging ring
//! (`staging`): blocks are cut into, and small blocks packed into, pieces of one
//! buffer each; each buffer's device copies go on one of [`COPY_STREAMS`] streams of
//! gpupool's own, the buffers dealt to the streams in turn, an event recorded after each; the
//! copies between a buffer and the host copy, which is ordinary pageable memory, are done by
//! a crew of CPU threads (`copy_threads`) while the device copies the other buffers. So the
//! copy engines work at the bus's speed on pinned memory, the host copy needs no pinning
//! (which costs more than the copy), and nothing pinned is left behind per pool.
//!
//! Offload: a buffer's device-to-host copies are queued as pieces are added; when the ring
//! comes round to a buffer again, its event is waited for and the crew copies it out. Restore:
//! the crew fills a buffer from the host copy, then its host-to-device copies are queued; a
//! buffer is filled again once its event says the device has read it. vLLM's sleep mode copies
//! each allocation with a synchronous `cudaMemcpy` into pinned memory it allocates per sleep.

use std::collections::VecDeque;

use super::copy_threads::{Crew, Move};
use super::staging::{Ring, quietly};
use crate::driver::{DevicePtr, Driver, DriverError, HostPtr, StreamHandle};

/// Copy streams per sleep or wake: an H100 has two copy engines per direction in use by
/// `cudaMemcpyAsync` on separate streams.
pub(crate) const COPY_STREAMS: usize = 2;

/// Which way a [`Copier`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    /// Device to host copy (sleep with offload).
    Offload,
    /// Host copy to device (wake).
    Restore,
}

/// Where a sleep's or a wake's copies go: through the staging ring ([`Copier`]) or straight
/// to a pinned host copy (`copy_direct::Direct`).
pub(crate) trait Copies {
    /// Adds `len` bytes between the host copy at `host` and device memory at `dev`, which way
    /// the copies go; written by the end of [`Copies::finish`].
    ///
    /// Errors: the driver's; what was added before stays queued (the caller abandons the
    /// copies, whose drop waits for them).
    fn add(&mut self, host: HostPtr, dev: DevicePtr, len: usize) -> Result<(), DriverError>;
    /// Copies what is left and waits for every copy.
    ///
    /// Errors: the driver's.
    fn finish(&mut self) -> Result<(), DriverError>;
}

impl Copies for Copier<'_> {
    fn add(&mut self, host: HostPtr, dev: DevicePtr, len: usize) -> Result<(), DriverError> {
        Copier::add(self, host, dev, len)
    }
    fn finish(&mut self) -> Result<(), DriverError> {
        Copier::finish(self)
    }
}

/// One piece of a buffer: (host copy address, device address, offset in the buffer, bytes).
type Piece = (HostPtr, DevicePtr, usize, usize);

/// A buffer of the ring as a copy uses it.
#[derive(Default)]
struct Slot {
    pieces: Vec<Piece>,
    /// Bytes of the buffer in use.
    used: usize,
    /// Its copies are queued and its event recorded.
    in_flight: bool,
    /// The stream its device copies go on.
    stream: StreamHandle,
}

/// One sleep's or wake's copies, one way, through a ring. Dropped, it waits for its streams
/// (so that no copy outlives the memory it reads or writes) and destroys them.
pub(crate) struct Copier<'a> {
    driver: &'a dyn Driver,
    device: i32,
    way: Way,
    ring: &'a Ring,
    crew: &'a Crew,
    streams: Vec<StreamHandle>,
    slots: Vec<Slot>,
    /// The buffer being filled.
    cur: usize,
    /// Buffers in flight, the oldest first.
    queue: VecDeque<usize>,
    /// Buffers begun: which stream the next one takes.
    begun: usize,
    moves: Vec<Move>,
}

impl<'a> Copier<'a> {
    /// [`COPY_STREAMS`] new streams on `device` (`cuStreamCreate`, non-blocking), to copy `way`
    /// through `ring` with `crew`.
    ///
    /// Errors: the driver's; the streams made are destroyed.
    pub fn new(
        driver: &'a dyn Driver,
        device: i32,
        way: Way,
        ring: &'a Ring,
        crew: &'a Crew,
    ) -> Result<Copier<'a>, DriverError> {
        let slots = ring.slots.iter().map(|_| Slot::default()).collect();
        let mut c = Copier {
            driver,
            device,
            way,
            ring,
            crew,
            streams: Vec::with_capacity(COPY_STREAMS),
            slots,
            cur: 0,
            queue: VecDeque::new(),
            begun: 0,
            moves: Vec::new(),
        };
        for _ in 0..COPY_STREAMS {
            c.streams.push(driver.stream_create(device)?);
        }
        c.slots[0].stream = c.streams[0];
        c.begun = 1;
        Ok(c)
    }

    /// Adds `len` bytes between the host copy at `host` and device memory at `dev`, which
    /// way the copier goes. For [`Way::Offload`] the host copy is written by the end of
    /// [`Copier::finish`]; for [`Way::Restore`] the device memory.
    ///
    /// Errors: the driver's; what was added before stays queued (the caller abandons the
    /// copier, whose drop waits for it).
    pub fn add(&mut self, host: HostPtr, dev: DevicePtr, len: usize) -> Result<(), DriverError> {
        let chunk = self.ring.chunk;
        let mut off = 0;
        while off < len {
            let slot = &mut self.slots[self.cur];
            let n = (chunk - slot.used).min(len - off);
            let at = slot.used;
            if self.way == Way::Offload {
                let buf = self.ring.slots[self.cur].0 + at;
                self.driver.memcpy_dtoh_async(self.device, buf, dev + off as u64, n, slot.stream)?;
            }
            let slot = &mut self.slots[self.cur];
            slot.pieces.push((host + off, dev + off as u64, at, n));
            slot.used += n;
            off += n;
            if slot.used == chunk {
                self.submit()?;
            }
        }
        Ok(())
    }

    /// The buffer being filled is complete: (restore) filled from the host copy and its
    /// copies queued; its event recorded; the next buffer made free, waiting for its event
    /// and (offload) copying it out.
    fn submit(&mut self) -> Result<(), DriverError> {
        let (buf, event) = self.ring.slots[self.cur];
        let stream = self.slots[self.cur].stream;
        if self.way == Way::Restore {
            self.moves.clear();
            self.moves.extend(self.slots[self.cur].pieces.iter().map(|&(host, _, at, n)| (buf + at, host, n)));
            // SAFETY: the buffer is pinned memory of the ring, free (its last copies done),
            // the host copy is the caller's, live until the copier is finished; the pieces
            // tile distinct parts of the buffer.
            unsafe { self.crew.copy(&self.moves) };
            for &(_, dev, at, n) in &self.slots[self.cur].pieces {
                self.driver.memcpy_htod_async(self.device, dev, buf + at, n, stream)?;
            }
        }
        self.driver.event_record(self.device, event, stream)?;
        self.slots[self.cur].in_flight = true;
        self.queue.push_back(self.cur);
        self.cur = (self.cur + 1) % self.slots.len();
        if self.slots[self.cur].in_flight {
            self.retire()?;
        }
        self.slots[self.cur].stream = self.streams[self.begun % self.streams.len()];
        self.begun += 1;
        Ok(())
    }

    /// Waits for the oldest buffer in flight (`cuEventSynchronize`) and (offload) copies it
    /// out to the host copy; it is free again.
    fn retire(&mut self) -> Result<(), DriverError> {
        let Some(k) = self.queue.pop_front() else { return Ok(()) };
        let (buf, event) = self.ring.slots[k];
        self.driver.event_synchronize(event)?;
        let slot = &mut self.slots[k];
        if self.way == Way::Offload {
            self.moves.clear();
            self.moves.extend(slot.pieces.iter().map(|&(host, _, at, n)| (host, buf + at, n)));
            // SAFETY: the device has written the buffer (its event completed); the host copy
            // is the caller's, live and written by nothing else; the pieces tile distinct
            // parts of it.
            unsafe { self.crew.copy(&self.moves) };
        }
        slot.pieces.clear();
        slot.used = 0;
        slot.in_flight = false;
        Ok(())
    }

    /// Copies what is left and waits for every copy: on return the host copy (offload) or the
    /// device memory (restore) holds every byte added.
    ///
    /// Errors: the driver's.
    pub fn finish(&mut self) -> Result<(), DriverError> {
        if self.slots[self.cur].used != 0 {
            self.submit()?;
        }
        while !self.queue.is_empty() {
            self.retire()?;
        }
        Ok(())
    }
}

impl Drop for Copier<'_> {
    fn drop(&mut self) {
        end_streams(self.driver, self.device, std::mem::take(&mut self.streams));
    }
}

/// Waits for each of a copier's `streams` and destroys it, so that no copy outlives the memory
/// it reads or writes. Never panics (it may run while a panic unwinds): a driver call that fails
/// or unwinds here leaks the stream, which holds no memory of the pool.
pub(crate) fn end_streams(driver: &dyn Driver, device: i32, streams: Vec<StreamHandle>) {
    for s in streams {
        let _ = quietly(|| driver.stream_synchronize(device, s));
        let _ = quietly(|| driver.stream_destroy(device, s));
    }
}

/// A pool's pageable host copy for one shard (`host_map`, see `driver::pageable`), unmapped
/// when dropped unless kept with [`HostCopy::keep`].
pub(crate) struct HostCopy<'a> {
    driver: &'a dyn Driver,
    pub ptr: HostPtr,
    pub size: usize,
}

impl<'a> HostCopy<'a> {
    /// `size` bytes of pageable host memory (0: none, with no call), with transparent huge
    /// pages asked for with `huge_pages`.
    ///
    /// Errors: [`DriverError::OutOfMemory`] when the system refuses it.
    pub fn new(driver: &'a dyn Driver, size: usize, huge_pages: bool) -> Result<HostCopy<'a>, DriverError> {
        let ptr = if size == 0 { 0 } else { driver.host_map(size, huge_pages)? };
        Ok(HostCopy { driver, ptr, size })
    }

    /// The memory stays mapped: its owner unmaps it with [`free_host`].
    pub fn keep(self) -> (HostPtr, usize) {
        let r = (self.ptr, self.size);
        std::mem::forget(self);
        r
    }
}

impl Drop for HostCopy<'_> {
    fn drop(&mut self) {
        free_host(self.driver, (self.ptr, self.size));
    }
}

/// Unmaps a host copy from [`HostCopy`] (`munmap`; a null pointer: none), its pages back to
/// the system. A failure, or a call that unwinds, leaks it. Never panics.
pub(crate) fn free_host(driver: &dyn Driver, (ptr, size): (HostPtr, usize)) {
    if ptr != 0 {
        let _ = quietly(|| driver.host_unmap(ptr, size));
    }
}
