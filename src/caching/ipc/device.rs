//! A device's blocks in IPC limbo (`export`) reclaimed on its out-of-memory path:
//! blocks freed while another process imported them, now held by no running process, are
//! freed before the cache is released, so that memory pressure does not wait for the
//! program's next `gpupool_ipc_*` call or `empty_cache`.

use super::export;
use crate::caching::device::DeviceAllocator;

impl DeviceAllocator {
    /// Frees this device's blocks in limbo that no running importer holds; returns how many.
    /// Takes no lock but each block's shard's, one at a time; call with none held.
    pub(in crate::caching) fn reclaim_ipc_limbo(&self) -> usize {
        let mine = |ptr| self.index.with_segment(ptr, |s| s.is_some_and(|e| e.device == self.device));
        let blocks = export::reclaimable_where(|ptr, e| e.device == self.device && mine(ptr));
        for &(ptr, _) in &blocks {
            let seg = self.index.with_segment(ptr, |s| s.map(|e| (e.owner.clone(), e.base)));
            if let Some((shard, base)) = seg {
                shard.lock().ipc_unmark(ptr);
                // The block is allocated and unmarked: an ordinary free now.
                let _ = self.free(&shard, ptr, base);
            }
            export::finish(ptr);
        }
        blocks.len()
    }
}
