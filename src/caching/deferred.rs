//! Frees that wait for a device synchronisation instead of events
//! ([`crate::Allocator::free_after_device_sync`], the LD_PRELOAD shim's `cudaFree`), and the
//! epoch protocol that says which synchronisation covers which free. Not a PyTorch rule.
//!
//! The device counts a synchronisation epoch. A free reads the epoch `e` and lists its block
//! with it in its shard ([`DeferredList`]); a synchronisation first moves the epoch on (to
//! `e' + 1`, returning `e'`), then waits for the device, then releases every block listed with
//! an epoch up to `e'`: those frees happened before the synchronisation began, so the wait
//! covered the work queued before them. The load and the increment are `SeqCst`, so a free
//! that read epoch `e` is ordered before a synchronisation that moved the epoch past `e`.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use super::block::BlockId;

/// What awaits a device synchronisation on a device, and what synchronisations released so
/// far ([`crate::Allocator::deferred`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeferredStats {
    /// Blocks freed with `free_after_device_sync` and not yet released.
    pub blocks: i64,
    /// Their bytes (rounded block sizes).
    pub bytes: i64,
    /// Device synchronisations that released some.
    pub syncs: i64,
    /// Blocks those synchronisations released.
    pub released: i64,
}

/// The device's side: the epoch and the counts, as atomics (no lock).
#[derive(Debug, Default)]
pub(crate) struct DeferredFrees {
    blocks: AtomicI64,
    bytes: AtomicI64,
    syncs: AtomicI64,
    released: AtomicI64,
    epoch: AtomicU64,
}

impl DeferredFrees {
    /// The epoch a free happening now belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Counts a deferred block of `size` bytes; returns the device's deferred bytes.
    pub fn add(&self, size: usize) -> usize {
        self.blocks.fetch_add(1, Ordering::Relaxed);
        (self.bytes.fetch_add(size as i64, Ordering::Relaxed) + size as i64) as usize
    }

    /// Starts a synchronisation if any block awaits one: returns the epoch it covers.
    pub fn begin_sync(&self) -> Option<u64> {
        if self.blocks.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Some(self.epoch.fetch_add(1, Ordering::SeqCst))
    }

    /// Counts blocks a synchronisation returned to their pools.
    pub fn release(&self, blocks: usize, bytes: usize) {
        self.blocks.fetch_sub(blocks as i64, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes as i64, Ordering::Relaxed);
    }

    /// Counts a synchronisation that released `blocks` blocks in all.
    pub fn finish_sync(&self, blocks: usize) {
        if blocks > 0 {
            self.syncs.fetch_add(1, Ordering::Relaxed);
            self.released.fetch_add(blocks as i64, Ordering::Relaxed);
        }
    }

    /// The counts, read with no lock and no driver call.
    pub fn stats(&self) -> DeferredStats {
        let load = |a: &AtomicI64| a.load(Ordering::Relaxed);
        DeferredStats {
            blocks: load(&self.blocks),
            bytes: load(&self.bytes),
            syncs: load(&self.syncs),
            released: load(&self.released),
        }
    }
}

/// A shard's side: its deferred blocks with the epoch each was freed in.
#[derive(Debug, Default)]
pub(crate) struct DeferredList {
    entries: Vec<(BlockId, u64)>,
}

impl DeferredList {
    /// Lists `block`, freed in `epoch`.
    pub fn push(&mut self, block: BlockId, epoch: u64) {
        self.entries.push((block, epoch));
    }

    /// Takes out the blocks a synchronisation covering `epoch` released.
    pub fn take_synced(&mut self, epoch: u64) -> Vec<BlockId> {
        let mut synced = Vec::new();
        self.entries.retain(|&(id, e)| {
            let covered = e <= epoch;
            if covered {
                synced.push(id);
            }
            !covered
        });
        synced
    }

    /// Whether `block` is listed (for the consistency check).
    pub fn contains(&self, block: BlockId) -> bool {
        self.entries.iter().any(|&(id, _)| id == block)
    }

    /// Blocks listed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}
