//! Giving cached memory back (PyTorch `empty_cache` of `CachingHostAllocatorImpl` in
//! `aten/src/ATen/core/CachingHostAllocator.h`), and the blocks that wait for a device
//! synchronisation before they are reused: frees deferred for the LD_PRELOAD shim's
//! `cudaFreeHost` rule, and blocks stranded by a failed event record.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::blocks::{Block, Origin};
use super::stats::StatExt;
use super::{HostAllocator, Inner, freed_already};
use crate::caching::fork;
use crate::caching::segment_index::SegmentEntry;
use crate::driver::HostPtr;
use crate::error::Error;

/// A deferred-free summary for the LD_PRELOAD shim's report: blocks and bytes waiting, device
/// synchronisations made for them, blocks those released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostDeferredStats {
    pub blocks: u64,
    pub bytes: u64,
    pub syncs: u64,
    pub released: u64,
}

impl HostAllocator {
    /// Releases every cached free block to the driver (`cuMemFreeHost`, or
    /// `cuMemHostUnregister` and `free`), after polling the events of freed blocks (PyTorch
    /// `empty_cache`), and destroys the events kept for reuse. Blocks still in use, or whose
    /// events have not completed, stay; so do the reserve segment's blocks, whose memory cannot
    /// be given back. Blocks waiting for a device synchronisation (a failed event record, or
    /// [`HostAllocator::free_after_device_sync`]) are released after one.
    ///
    /// Errors: [`Error::Cuda`] when a driver call fails (what was released before stays
    /// released; a block whose release failed stays cached).
    pub fn empty_cache(&self) -> Result<(), Error> {
        fork::check()?;
        let inner = &*self.inner;
        let mut first_error = None;
        let mut note = |r: Result<(), Error>| {
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        };
        let mut to_release = Vec::new();
        let mut to_destroy = Vec::new();
        // Blocks waiting for a synchronisation first, so that they are released below.
        note(inner.release_deferred().map(|_| ()));
        note(inner.release_stranded());
        for stripe in inner.stripes.iter() {
            let mut st = stripe.0.lock();
            note(inner.process_events(&mut st, false));
            for list in st.free.iter_mut() {
                to_release.append(&mut list.take_unless(|b| b.origin == Origin::Reserve));
            }
            to_destroy.append(&mut st.idle_events);
        }
        for (device, ev) in to_destroy {
            inner.driver.event_destroy(device, ev);
        }
        for b in to_release {
            note(inner.release(b));
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Frees the block at `ptr` for reuse only after a synchronisation of `device`, made by
    /// gpupool when a later allocation misses, when [`HostAllocator::release_deferred`] is
    /// called, or by `empty_cache`: the rule of `cudaFreeHost`, which waits for the device,
    /// for the LD_PRELOAD shim. Streams named by `record_event` need no event then. Returns
    /// the bytes now waiting.
    ///
    /// Errors: as [`HostAllocator::free`].
    pub fn free_after_device_sync(&self, ptr: HostPtr, device: i32) -> Result<usize, Error> {
        fork::check()?;
        let block = {
            let (_, mut st) = self.inner.home_of(ptr, "free")?;
            st.handed_out.remove(ptr).ok_or_else(|| freed_already(ptr))?.block
        };
        let mut slow = self.inner.slow.lock();
        slow.deferred_bytes += block.size;
        slow.deferred.push((device, block));
        self.inner.any_deferred.store(true, Ordering::Release);
        Ok(slow.deferred_bytes)
    }

    /// Synchronises the devices of the deferred blocks and returns them to their free lists;
    /// returns how many there were.
    ///
    /// Errors: [`Error::Cuda`] when a synchronisation fails (the blocks stay deferred).
    pub fn release_deferred(&self) -> Result<usize, Error> {
        fork::check()?;
        self.inner.release_deferred()
    }

    /// The deferred frees: waiting now, and released so far.
    pub fn deferred(&self) -> HostDeferredStats {
        let slow = self.inner.slow.lock();
        HostDeferredStats {
            blocks: slow.deferred.len() as u64,
            bytes: slow.deferred_bytes as u64,
            syncs: slow.deferred_syncs,
            released: slow.deferred_released,
        }
    }
}

impl Inner {
    /// Releases a free block taken out of its free list: out of the index first (its address
    /// may be pinned again at once), then back to the driver. A failed release puts it back.
    fn release(&self, block: Arc<Block>) -> Result<(), Error> {
        self.index.remove(block.ptr as u64);
        match self.unpin(block.ptr, block.origin) {
            Ok(()) => {
                let mut slow = self.slow.lock();
                slow.allocations.decrease(1);
                slow.allocated_bytes.decrease(block.size as i64);
                Ok(())
            }
            Err(e) => {
                self.index.insert(SegmentEntry {
                    base: block.ptr as u64,
                    size: block.size,
                    device: -1,
                    owner: block.clone(),
                });
                let home = block.home.load(Ordering::Relaxed) as usize;
                let mut st = self.stripes[home].0.lock();
                // Still free: it was counted free when it was taken for release.
                let class = block.class;
                st.free[class].push(block);
                Err(e)
            }
        }
    }

    /// Synchronises each device that deferred blocks wait for, and frees those blocks; returns
    /// how many were released.
    pub(super) fn release_deferred(&self) -> Result<usize, Error> {
        let waiting = {
            let mut slow = self.slow.lock();
            slow.deferred_bytes = 0;
            std::mem::take(&mut slow.deferred)
        };
        if waiting.is_empty() {
            return Ok(0);
        }
        let mut devices: Vec<i32> = waiting.iter().map(|&(d, _)| d).collect();
        devices.sort_unstable();
        devices.dedup();
        for &d in &devices {
            if let Err(e) = self.driver.device_synchronize(d) {
                let mut slow = self.slow.lock();
                slow.deferred_bytes += waiting.iter().map(|(_, b)| b.size).sum::<usize>();
                slow.deferred.extend(waiting);
                return Err(Error::driver_call(e, &format!("synchronising device {d} for freed pinned blocks")));
            }
        }
        let n = waiting.len();
        {
            let mut slow = self.slow.lock();
            slow.deferred_syncs += devices.len() as u64;
            slow.deferred_released += n as u64;
        }
        for (_, b) in waiting {
            let home = b.home.load(Ordering::Relaxed) as usize;
            Self::to_free_list(&mut self.stripes[home].0.lock(), b);
        }
        Ok(n)
    }

    /// Synchronises the devices stranded blocks wait for, and frees those blocks.
    fn release_stranded(&self) -> Result<(), Error> {
        let stranded = std::mem::take(&mut self.slow.lock().stranded);
        let mut devices: Vec<i32> = stranded.iter().map(|&(d, _)| d).collect();
        devices.sort_unstable();
        devices.dedup();
        for &d in &devices {
            if let Err(e) = self.driver.device_synchronize(d) {
                self.slow.lock().stranded.extend(stranded);
                return Err(Error::driver_call(e, &format!("synchronising device {d} for freed pinned blocks")));
            }
        }
        // A block stranded on several devices appears once per device.
        let mut done = rustc_hash::FxHashSet::default();
        for (_, b) in stranded {
            if done.insert(b.ptr) {
                let home = b.home.load(Ordering::Relaxed) as usize;
                Self::to_free_list(&mut self.stripes[home].0.lock(), b);
            }
        }
        Ok(())
    }
}

impl Drop for Inner {
    /// Gives every cached block's memory back, and the events kept for reuse. Blocks still
    /// handed out, or waiting for events, are left pinned: work may still use them.
    fn drop(&mut self) {
        if fork::check().is_err() {
            return;
        }
        let mut blocks = Vec::new();
        for stripe in self.stripes.iter() {
            let mut st = stripe.0.lock();
            for list in st.free.iter_mut() {
                blocks.extend(std::iter::from_fn(|| list.pop()));
            }
            for (device, ev) in st.idle_events.drain(..) {
                self.driver.event_destroy(device, ev);
            }
        }
        for b in blocks {
            let _ = self.unpin(b.ptr, b.origin);
        }
        if let Some((ptr, _, _)) = self.slow.get_mut().reserve {
            let _ = self.unpin(ptr, self.origin_now());
        }
    }
}
