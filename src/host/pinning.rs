//! Pinning new memory on a miss (PyTorch `allocate_host_memory` and `free_block` of
//! `aten/src/ATen/cuda/CachingHostAllocator.cpp`): `cuMemHostAlloc`, or `malloc` with its pages
//! touched by the register threads and `cuMemHostRegister` (`allocWithCudaHostRegister`), or a
//! piece of the reserve segment (`get_reserve_segment`); and giving that memory back the way it
//! was pinned, timed for the statistics.

use std::sync::Arc;
use std::time::Instant;

use super::Inner;
use super::blocks::{Block, Origin};
use super::stats::StatExt;
use crate::caching::segment_index::SegmentEntry;
use crate::driver::{DriverError, HostPtr};
use crate::error::Error;

/// The page size the register path touches and the reserve segment rounds to (PyTorch: 4 KiB).
const PAGE: usize = 4096;

/// Writes one byte into every page of `[ptr, ptr + size)` from `threads` threads, so that the
/// kernel maps the pages before `cuMemHostRegister` locks them (PyTorch `mapPagesForRegister`:
/// faulting the pages in parallel is faster than letting the driver do it under its lock).
fn touch_pages(ptr: HostPtr, size: usize, threads: usize) {
    let touch = |start: usize, end: usize| {
        let mut p = start.next_multiple_of(PAGE);
        while p < end {
            // SAFETY: `p` lies in `[ptr, ptr + size)`, memory this allocator just allocated
            // and owns; a volatile write so that it is not optimised out.
            unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
            p += PAGE;
        }
    };
    // PyTorch's condition: more than one thread and at least a page for each.
    if threads > 1 && size >= PAGE * threads {
        std::thread::scope(|s| {
            for i in 0..threads {
                let start = ptr + size / threads * i;
                let end = if i == threads - 1 { ptr + size } else { start + size / threads };
                s.spawn(move || touch(start, end));
            }
        });
    } else {
        touch(ptr, ptr + size);
    }
}

fn micros(since: Instant) -> i64 {
    since.elapsed().as_micros().min(i64::MAX as u128) as i64
}

impl Inner {
    /// The device new pinned memory is allocated from: the one whose primary context is
    /// current, else the current device (PyTorch uses any device with a primary context,
    /// `getDeviceIndexWithPrimaryContext`; the memory is portable, so any works).
    fn alloc_device(&self) -> i32 {
        match self.driver.current_primary_device() {
            Ok(Some(d)) => d,
            _ => self.driver.current_device().unwrap_or(0),
        }
    }

    /// Pins `size` bytes as the configuration says; returns the memory and its origin, and
    /// counts the call.
    fn pin(&self, size: usize) -> Result<(HostPtr, Origin), Error> {
        let device = self.alloc_device();
        let start = Instant::now();
        let r = if self.backing.use_register {
            self.pin_registered(device, size).map(|p| (p, Origin::Registered { device }))
        } else {
            self.driver.host_alloc(device, size).map(|p| (p, Origin::HostAlloc { device }))
        };
        let (ptr, origin) = r.map_err(|e| match e {
            DriverError::OutOfMemory => Error::OutOfMemory(format!(
                "cannot pin {size} bytes of host memory: the host or the driver has no more page-locked memory \
                 (gpupool_host_empty_cache releases cached blocks)"
            )),
            e => Error::driver(e, &format!("pinning {size} bytes of host memory")),
        })?;
        let mut slow = self.slow.lock();
        slow.host_alloc_time.add(micros(start));
        slow.num_host_alloc += 1;
        Ok((ptr, origin))
    }

    /// `posix_memalign`, the pages touched, then `cuMemHostRegister` (PyTorch
    /// `allocWithCudaHostRegister`, which uses `malloc`; page alignment lets the driver lock
    /// exactly the block's pages).
    fn pin_registered(&self, device: i32, size: usize) -> Result<HostPtr, DriverError> {
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; PAGE is a power of two and a multiple of the pointer size.
        if unsafe { libc::posix_memalign(&mut p, PAGE, size) } != 0 || p.is_null() {
            return Err(DriverError::OutOfMemory);
        }
        let ptr = p as HostPtr;
        touch_pages(ptr, size, self.backing.register_threads);
        if let Err(e) = self.driver.host_register(device, ptr, size) {
            // SAFETY: memory from posix_memalign above, registered nowhere.
            unsafe { libc::free(p) };
            return Err(e);
        }
        Ok(ptr)
    }

    /// A new block of `rounded` bytes (PyTorch's slow path, `allocate_host_memory`): from the
    /// reserve segment while it has room, else newly pinned memory.
    pub(super) fn new_block(&self, rounded: usize, class: usize) -> Result<Arc<Block>, Error> {
        let (ptr, origin) = match self.carve_reserve(rounded)? {
            Some(p) => (p, Origin::Reserve),
            None => self.pin(rounded)?,
        };
        let block = Arc::new(Block::new(ptr, rounded, class, origin));
        self.index.insert(SegmentEntry { base: ptr as u64, size: rounded, device: -1, owner: block.clone() });
        let mut slow = self.slow.lock();
        slow.allocations.increase(1);
        slow.allocated_bytes.increase(rounded as i64);
        Ok(block)
    }

    /// `rounded` bytes from the reserve segment (pinned at the first call, PyTorch
    /// `get_reserve_segment`), 4 KiB aligned; `None` without a reserve or when it is used up.
    fn carve_reserve(&self, rounded: usize) -> Result<Option<HostPtr>, Error> {
        let size = self.backing.reserve_size;
        if size == 0 {
            return Ok(None);
        }
        if self.slow.lock().reserve.is_none() {
            let (ptr, _) = self.pin(size)?;
            let mut slow = self.slow.lock();
            if slow.reserve.is_none() {
                slow.reserve = Some((ptr, size, 0));
            } else {
                // Another thread pinned it meanwhile: this one goes back.
                drop(slow);
                self.unpin(ptr, self.origin_now())?;
            }
        }
        let mut slow = self.slow.lock();
        let (start, total, used) = slow.reserve.as_mut().expect("pinned above");
        let take = rounded.next_multiple_of(PAGE);
        if *used + take > *total {
            return Ok(None);
        }
        let p = *start + *used;
        *used += take;
        Ok(Some(p))
    }

    /// The origin new memory has under the configuration, for memory pinned by [`Inner::pin`]
    /// and given back at once.
    pub(super) fn origin_now(&self) -> Origin {
        let device = self.alloc_device();
        if self.backing.use_register { Origin::Registered { device } } else { Origin::HostAlloc { device } }
    }

    /// Gives pinned memory back the way it was pinned, and counts it.
    pub(super) fn unpin(&self, ptr: HostPtr, origin: Origin) -> Result<(), Error> {
        let start = Instant::now();
        let r = match origin {
            Origin::HostAlloc { device } => self.driver.host_free(device, ptr),
            Origin::Registered { device } => self.driver.host_unregister(device, ptr).map(|()| {
                // SAFETY: memory from posix_memalign in pin_registered, now unregistered.
                unsafe { libc::free(ptr as *mut libc::c_void) }
            }),
            Origin::Reserve => return Ok(()),
        };
        r.map_err(|e| Error::driver_call(e, &format!("releasing the pinned host memory at {ptr:#x}")))?;
        let mut slow = self.slow.lock();
        slow.host_free_time.add(micros(start));
        slow.num_host_free += 1;
        Ok(())
    }
}
