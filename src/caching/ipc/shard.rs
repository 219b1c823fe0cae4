//! A shard's blocks exported to other processes (`gpupool_ipc_export`, `caching::ipc`): what an
//! export needs of a block (its pages' handles in an expandable segment, or its segment's
//! start), the mark that sends its free off the hit path, and that free.
//!
//! The mark is [`EXPORTED`] among the block's `stream_uses`: the hit path's free already
//! sends a block with stream uses to its cold path (`free_used`), so an exported block costs
//! the hit path nothing. There the process's export table decides (`export::on_free`):
//! the block stays allocated while importers hold it (PyTorch keeps a block freed while shared
//! allocated, in `CudaIPCSentDataLimbo`), or the export ends and the block is freed as usual.

use super::export::{self, OnFree};
use crate::caching::block::{BlockId, NIL};
use crate::caching::shard::ShardState;
use crate::driver::{DevicePtr, PhysHandle, StreamHandle};
use crate::error::Error;

/// The mark of an exported block among its stream uses: no stream's handle (CUDA streams are
/// pointers). A program that names it to `record_stream` anyway makes its block look exported:
/// its free then finds no export and frees it as usual.
pub(crate) const EXPORTED: StreamHandle = usize::MAX;

/// What the importer maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Pages of an expandable segment: the first page's address, bytes per page, each handle.
    Pages { first: DevicePtr, page: usize, handles: Vec<PhysHandle> },
    /// An ordinary segment, by its start.
    Segment { base: DevicePtr },
}

/// An allocated block as an export sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Exportable {
    pub addr: DevicePtr,
    pub size: usize,
    pub shape: Shape,
    /// Marked exported already.
    pub marked: bool,
}

impl ShardState {
    /// The allocated block at `ptr`, for an export.
    ///
    /// Errors: [`Error::InvalidPointer`] when `ptr` is not the start of an allocated block of
    /// this shard; [`Error::InvalidValue`] while the shard's pool sleeps (its pages are gone).
    pub fn ipc_block(&self, ptr: DevicePtr) -> Result<Exportable, Error> {
        let Some(id) = self.allocated(ptr) else {
            return Err(Error::InvalidPointer(format!(
                "pointer {ptr:#x} is not the start of a block allocated by gpupool: only a whole live block can be \
                 exported (not an interior pointer, nor a freed block)"
            )));
        };
        if self.is_asleep() {
            return Err(Error::InvalidValue(format!("pointer {ptr:#x} is in a pool that sleeps: wake it first")));
        }
        let b = &self.blocks[id];
        let (addr, size, marked) = (b.addr, b.size, b.stream_uses.contains(&EXPORTED));
        let mut head = id;
        while self.blocks[head].prev != NIL {
            head = self.blocks[head].prev;
        }
        let base = self.blocks[head].addr;
        let seg = self.segments.get(&base).ok_or_else(|| Error::Internal(format!("block {addr:#x} has no segment")))?;
        let shape = match &seg.exp {
            None => Shape::Segment { base },
            Some(exp) => {
                let first = (addr - exp.base) as usize / exp.page;
                let last = (addr - exp.base) as usize + size - 1;
                let handles: Option<Vec<_>> = (first..=last / exp.page).map(|i| exp.handle(i)).collect();
                let handles =
                    handles.ok_or_else(|| Error::Internal(format!("block {addr:#x} lies on unmapped pages")))?;
                Shape::Pages { first: exp.base + (first * exp.page) as u64, page: exp.page, handles }
            }
        };
        Ok(Exportable { addr, size, shape, marked })
    }

    /// Marks the allocated block at `ptr` exported (see the module docs).
    pub fn ipc_mark(&mut self, ptr: DevicePtr) {
        if let Some(id) = self.allocated(ptr)
            && !self.blocks[id].stream_uses.contains(&EXPORTED)
        {
            self.blocks[id].add_stream_use(EXPORTED);
        }
    }

    /// Takes the mark off the allocated block at `ptr` (a reclaim, before it frees the block).
    pub fn ipc_unmark(&mut self, ptr: DevicePtr) {
        if let Some(id) = self.allocated(ptr) {
            self.unmark(id);
        }
    }

    fn unmark(&mut self, id: BlockId) {
        let b = &mut self.blocks[id];
        if b.stream_uses.contains(&EXPORTED) {
            b.stream_uses = b.stream_uses.iter().copied().filter(|&s| s != EXPORTED).collect();
        }
    }

    /// The free of block `id` at `ptr`, if it is exported: `Ok(true)` when it stays allocated
    /// in limbo (importers hold it); `Ok(false)` when the caller frees it as usual (not
    /// exported, or the export ended now: the mark is off).
    ///
    /// Errors: [`Error::InvalidPointer`] for a second free of a block in limbo.
    pub(in crate::caching) fn ipc_free(&mut self, ptr: DevicePtr, id: BlockId) -> Result<bool, Error> {
        if !self.blocks[id].stream_uses.contains(&EXPORTED) {
            return Ok(false);
        }
        match export::on_free(ptr) {
            OnFree::Hold => Ok(true),
            OnFree::DoubleFree => Err(Error::InvalidPointer(format!(
                "pointer {ptr:#x} was freed already (double free): exported, it waits for the processes that \
                 imported it to close it"
            ))),
            OnFree::Proceed => {
                self.unmark(id);
                Ok(false)
            }
        }
    }

    /// Whether the allocated block at `ptr` is marked exported (for the consistency check).
    pub fn ipc_marked(&self, ptr: DevicePtr) -> bool {
        self.allocated(ptr).is_some_and(|id| self.blocks[id].stream_uses.contains(&EXPORTED))
    }
}
