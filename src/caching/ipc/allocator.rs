//! Sharing blocks with other processes (see `caching::ipc`): the export of an allocated block, the
//! import of another process's, the close of an import, and the reclaim of blocks freed while
//! imported (limbo). None of it is on the hit path: a block's free reaches the export table
//! only through its shard's cold path (`shard`).

use std::os::fd::{AsRawFd, OwnedFd};

use super::export::{self, Export, Stage};
use super::handle::{HANDLE_SIZE, IpcHandle, Kind};
use super::record::{Fields, Record};
use super::shard::Shape;
use crate::caching::allocator::Allocator;
use crate::driver::DevicePtr;
use crate::error::Error;
use crate::os::process;

// Rust API only: cbindgen run over the whole crate would otherwise put it into gpupool.h.
/// The bytes of an IPC handle (`gpupool_ipc_handle_t`).
///
/// cbindgen:ignore
pub const IPC_HANDLE_SIZE: usize = HANDLE_SIZE;

impl Allocator {
    /// Exports the allocated block at `ptr` to other processes: returns the handle to send
    /// them (any pipe or socket), the same bytes for every export of the block until it is
    /// freed. The block's free then waits (in limbo, still counted allocated) until every
    /// process that imported it has closed it or exited. See `gpupool_ipc_export`.
    ///
    /// Errors: [`Error::InvalidPointer`] (not the start of a live block);
    /// [`Error::InvalidValue`] (a pool that sleeps, or whose segments come from the program's
    /// allocator); [`Error::DriverUnavailable`] (a driver that cannot share memory);
    /// [`Error::Cuda`], [`Error::OutOfMemory`] (the driver's or the system's failure to make
    /// the descriptors or the record). Nothing changes on failure.
    pub fn ipc_export(&self, ptr: DevicePtr) -> Result<[u8; IPC_HANDLE_SIZE], Error> {
        crate::caching::fork::check()?;
        self.reclaim_limbo();
        let found = self.index.with_segment(ptr, |seg| seg.map(|e| (e.device, e.owner.clone())));
        let Some((device, shard)) = found else {
            return Err(Error::InvalidPointer(format!("pointer {ptr:#x} was not allocated by gpupool")));
        };
        if shard.source.is_some() {
            return Err(Error::InvalidValue(format!(
                "pointer {ptr:#x} is in a pool whose segments come from the program's allocator: gpupool cannot \
                 export them"
            )));
        }
        let uuid = self.driver.device_uuid(device).map_err(|e| Error::driver(e, "reading the device's UUID"))?;
        let mut st = shard.lock();
        let block = st.ipc_block(ptr)?;
        if block.marked
            && let Some(h) = export::with(|m| m.get(&ptr).map(|e| (e.stage, e.handle)))
        {
            return match h {
                (Stage::Live, h) => Ok(h),
                _ => Err(Error::InvalidPointer(format!(
                    "pointer {ptr:#x} was freed: it waits for the processes that imported it to close it"
                ))),
            };
        }
        let drv = |what: &'static str| move |e| Error::driver(e, what);
        let (kind, offset, page_size, pages, segment) = match &block.shape {
            Shape::Pages { first, page, handles } => {
                let fds: Result<Vec<OwnedFd>, Error> = handles
                    .iter()
                    .map(|&h| self.driver.mem_export(device, h).map_err(drv("exporting a page of the block")))
                    .collect();
                (Kind::Pages, ptr - first, *page as u64, fds?, [0u8; 64])
            }
            Shape::Segment { base } => {
                let seg =
                    self.driver.ipc_get_mem_handle(device, *base).map_err(drv("exporting the block's segment"))?;
                (Kind::Segment, ptr - base, 0, Vec::new(), seg)
            }
        };
        let owner = process::me();
        let export_id = export::next_id();
        let fields = Fields { kind: kind as u32, owner, device, export_id, size: block.size as u64, offset, page_size };
        let raw: Vec<i32> = pages.iter().map(|f| f.as_raw_fd()).collect();
        let record = Record::create(&fields, &raw)
            .map_err(|e| Error::OutOfMemory(format!("the shared record of an export cannot be made: {e}")))?;
        let h = IpcHandle {
            kind,
            owner,
            record_fd: record.fd(),
            device,
            uuid,
            export_id,
            size: block.size as u64,
            offset,
            segment,
        }
        .encode();
        let entry = Export { allocator: self.id, device, handle: h, record, pages, stage: Stage::Live };
        // A sleep of the pool that began since the shard was checked: refused, what was made
        // dropped (the sleep reads the table after it began, so one of the two sees the other).
        let dev = self.device_or_init(device)?;
        export::with(|m| {
            if dev.sleep_begun(shard.pool) {
                return Err(Error::InvalidValue(format!(
                    "pointer {ptr:#x} is in a pool that sleeps or is going to sleep: wake it first"
                )));
            }
            m.insert(ptr, entry);
            Ok(())
        })?;
        st.ipc_mark(ptr);
        Ok(h)
    }

    /// Maps the block of another process's [`Allocator::ipc_export`] on `device` (-1: the
    /// calling thread's current device) and returns its address here; end it with
    /// [`Allocator::ipc_close`]. See `gpupool_ipc_import`.
    ///
    /// Errors: [`Error::InvalidValue`] for a handle that is damaged, of another device, of an
    /// owner that exited, of a block its owner freed, or this process's own;
    /// [`Error::DriverUnavailable`] where the owner's descriptors cannot be taken;
    /// [`Error::OutOfMemory`], [`Error::Cuda`] from the driver. Nothing changes on failure.
    pub fn ipc_import(&self, handle: &[u8; IPC_HANDLE_SIZE], device: i32) -> Result<DevicePtr, Error> {
        crate::caching::fork::check()?;
        self.reclaim_limbo();
        let h = IpcHandle::decode(handle)?;
        let dev = self.device_or_init(device)?;
        let uuid = self.driver.device_uuid(dev.device).map_err(|e| Error::driver(e, "reading the device's UUID"))?;
        h.check_device(dev.device, &uuid)?;
        self.ipc_imports.import(&*self.driver, dev.device, &dev.peers, &h)
    }

    /// Ends an import from [`Allocator::ipc_import`]: unmaps it here and lets the owner
    /// reuse the block once no other process holds it. See `gpupool_ipc_close`.
    ///
    /// Errors: [`Error::InvalidPointer`] (not an open import); [`Error::Cuda`] (the driver
    /// refused a step: the import stays, call again).
    pub fn ipc_close(&self, ptr: DevicePtr) -> Result<(), Error> {
        crate::caching::fork::check()?;
        self.ipc_imports.close(&*self.driver, ptr)?;
        self.reclaim_limbo();
        Ok(())
    }

    /// Frees the blocks in limbo that no running process holds any more (importers that
    /// closed them, or exited, or were killed); returns how many. Also clears, in the record
    /// of every export of this allocator (live ones too), the slots of importers that died, so
    /// that they serve new importers (an import that finds every slot taken clears them as
    /// well). `empty_cache` calls it; every `ipc_*` call reclaims the limbo, and a device's
    /// out-of-memory path its own; never the hit path.
    pub fn ipc_reclaim(&self) -> usize {
        // A forked child's copy of the table is the parent's business.
        if crate::caching::fork::check().is_err() {
            return 0;
        }
        export::reap_dead(self.id);
        self.reclaim_limbo()
    }

    /// The limbo part of [`Allocator::ipc_reclaim`], for the `ipc_*` calls: a sweep of every
    /// live export's importers (a read of `/proc` each) at every export or import would make
    /// many exports quadratic.
    pub(in crate::caching) fn reclaim_limbo(&self) -> usize {
        if crate::caching::fork::check().is_err() {
            return 0;
        }
        let blocks = export::reclaimable(self.id);
        for &(ptr, _) in &blocks {
            let shard = self.index.with_segment(ptr, |seg| seg.map(|e| e.owner.clone()));
            if let Some(shard) = shard {
                shard.lock().ipc_unmark(ptr);
            }
            // The block is allocated and unmarked: an ordinary free now.
            let _ = self.free(ptr);
            export::finish(ptr);
        }
        blocks.len()
    }

    /// Errors: [`Error::InvalidValue`] when `pool` on `device` holds exported blocks (live, or
    /// in limbo with importers): a sleep would give their pages back under the importers.
    /// Called once the sleep has begun (the caller reclaimed the limbo before it), so that an
    /// export racing the sleep is refused by one side or the other.
    pub(in crate::caching) fn ipc_refuse_sleep(&self, device: i32, pool: u64) -> Result<(), Error> {
        let in_pool = |ptr| self.index.with_segment(ptr, |s| s.is_some_and(|e| e.owner.pool == pool));
        let shared = export::list(self.id).into_iter().filter(|&(p, d, _, _)| d == device && in_pool(p)).count();
        if shared == 0 {
            return Ok(());
        }
        Err(Error::InvalidValue(format!(
            "pool {pool} on device {device} holds {shared} block(s) exported to other processes (gpupool_ipc_export): \
             its pages cannot be given back while another process may map them; free those blocks and let their \
             importers close them first"
        )))
    }

    /// The blocks exported and not yet given back: (address, device, whether in limbo, uses
    /// held by running importers). For tests and diagnostics.
    pub fn ipc_exports(&self) -> Vec<(DevicePtr, i32, bool, u64)> {
        export::list(self.id).into_iter().map(|(p, d, s, n)| (p, d, s != Stage::Live, n)).collect()
    }

    /// Imports open in this process through this allocator.
    pub fn ipc_import_count(&self) -> usize {
        self.ipc_imports.count()
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        export::forget_allocator(self.id);
        self.ipc_imports.close_all(&*self.driver);
    }
}
