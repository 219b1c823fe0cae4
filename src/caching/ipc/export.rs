//! The owner's side: every block of this process exported and not yet given back, by
//! address, with its handle, its record and the descriptors importers take; and the limbo of
//! blocks the program freed while another process still uses them (PyTorch
//! `CudaIPCSentDataLimbo`): such a block stays allocated (in its shard and in the statistics,
//! as PyTorch's does) until every importer has closed it or died, and is freed then by the
//! next reclaim (`Allocator::ipc_reclaim`: every `gpupool_ipc_*` call and `gpupool_empty_cache`;
//! a device's out-of-memory path reclaims its own first), never on the hit path.
//!
//! One table for the process, keyed by address (addresses of live blocks are unique in a
//! process), because the shard's free of an exported block asks it under the shard's lock
//! without knowing its allocator. Lock order: a shard's lock, then this table's.

use std::os::fd::OwnedFd;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::HANDLE_SIZE;
use super::record::Record;
use crate::driver::DevicePtr;

/// Where an export is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stage {
    /// The program still holds the block.
    Live,
    /// The program freed it while importers held it: it waits for them.
    Limbo,
    /// Being freed by a reclaim.
    Reclaiming,
}

/// One exported block.
pub(crate) struct Export {
    pub allocator: u64,
    pub device: i32,
    pub handle: [u8; HANDLE_SIZE],
    pub record: Record,
    /// The owner's descriptors of the pages, which importers take (the record lists their
    /// numbers); held open until the export ends, then closed by the drop.
    #[allow(dead_code)]
    pub pages: Vec<OwnedFd>,
    pub stage: Stage,
}

/// What the shard's free of an exported block does.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnFree {
    /// Importers hold it: it stays allocated, in limbo.
    Hold,
    /// Freed already (in limbo, or being reclaimed): a double free.
    DoubleFree,
    /// Nobody holds it: the export ended; free the block as usual.
    Proceed,
}

static EXPORTS: LazyLock<Mutex<FxHashMap<DevicePtr, Export>>> = LazyLock::new(Default::default);
/// Exports in limbo, of every allocator: a reclaim with none returns at once.
static LIMBO: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A new export id, unique in the process.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Calls `f` with the table, locked.
pub(crate) fn with<R>(f: impl FnOnce(&mut FxHashMap<DevicePtr, Export>) -> R) -> R {
    f(&mut EXPORTS.lock())
}

/// The free of the exported block at `ptr` (called by its shard, under the shard's lock).
pub(crate) fn on_free(ptr: DevicePtr) -> OnFree {
    let mut map = EXPORTS.lock();
    let Some(e) = map.get_mut(&ptr) else { return OnFree::Proceed };
    match e.stage {
        Stage::Limbo | Stage::Reclaiming => OnFree::DoubleFree,
        Stage::Live => {
            e.record.mark_freed();
            if e.record.holders() == 0 {
                map.remove(&ptr);
                OnFree::Proceed
            } else {
                e.stage = Stage::Limbo;
                LIMBO.fetch_add(1, Ordering::Relaxed);
                OnFree::Hold
            }
        }
    }
}

/// The blocks of `allocator` in limbo that no running importer holds any more, now marked
/// [`Stage::Reclaiming`]: the caller frees each and then calls [`finish`].
pub(crate) fn reclaimable(allocator: u64) -> Vec<(DevicePtr, i32)> {
    reclaimable_where(|_, e| e.allocator == allocator)
}

/// As [`reclaimable`], for the exports `pick` chooses (a device's, on its out-of-memory path).
pub(crate) fn reclaimable_where(pick: impl Fn(DevicePtr, &Export) -> bool) -> Vec<(DevicePtr, i32)> {
    if LIMBO.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    let mut map = EXPORTS.lock();
    let mut out = Vec::new();
    for (&ptr, e) in map.iter_mut() {
        if e.stage == Stage::Limbo && pick(ptr, e) && e.record.holders() == 0 {
            e.stage = Stage::Reclaiming;
            out.push((ptr, e.device));
        }
    }
    out
}

/// Ends the export at `ptr`, reclaimed (its descriptors closed, its record unmapped: an
/// importer that comes late finds it gone).
pub(crate) fn finish(ptr: DevicePtr) {
    if let Some(e) = EXPORTS.lock().remove(&ptr)
        && e.stage != Stage::Live
    {
        LIMBO.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Ends every export of `allocator` (it is dropped): importers keep what they mapped.
pub(crate) fn forget_allocator(allocator: u64) {
    let mut map = EXPORTS.lock();
    map.retain(|_, e| {
        if e.allocator != allocator {
            return true;
        }
        e.record.mark_freed();
        if e.stage != Stage::Live {
            LIMBO.fetch_sub(1, Ordering::Relaxed);
        }
        false
    });
}

/// Clears the slots of dead importers in every export of `allocator`, live ones included;
/// returns how many. A live export's slots are otherwise cleared only when it is freed or
/// listed, or by an import that finds them all taken: the owner's explicit reclaim gives them
/// back too, as docs/ipc.md says.
pub(crate) fn reap_dead(allocator: u64) -> usize {
    let map = EXPORTS.lock();
    map.values().filter(|e| e.allocator == allocator).map(|e| e.record.reap_dead()).sum()
}

/// The exports of `allocator`: (address, device, stage, uses held), for the consistency check
/// and for tests.
pub(crate) fn list(allocator: u64) -> Vec<(DevicePtr, i32, Stage, u64)> {
    let map = EXPORTS.lock();
    map.iter()
        .filter(|(_, e)| e.allocator == allocator)
        .map(|(&p, e)| (p, e.device, e.stage, e.record.holders()))
        .collect()
}
