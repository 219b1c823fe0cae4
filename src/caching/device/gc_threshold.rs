//! PyTorch's `garbage_collection_threshold` (`garbage_collect_cached_blocks` in
//! `CUDACachingAllocator.cpp`): with a memory fraction set, once the device's reserved bytes
//! pass that share of its limit, a request that finds no cached block first releases whole
//! free segments of the large pool, the oldest first, until reserved is back under the
//! threshold, rather than waiting for the out-of-memory path to release the whole cache.
//!
//! Where gpupool differs: PyTorch's pool is the device's; gpupool's pools are per stream, so
//! the candidates of every stream are gathered (each shard locked in turn, with none held by
//! the caller), and a block's age counts the blocks its stream freed since it was freed rather
//! than the pool's lookups (the hit path keeps no clock when the threshold is off).

use super::DeviceAllocator;

impl DeviceAllocator {
    /// Whether a request that found no cached block must collect first: a threshold and a
    /// memory fraction are set and reserved bytes are over their product.
    pub(super) fn gc_due(&self) -> bool {
        self.gc_threshold > 0.0
            && self.limit.get().is_some_and(|l| self.limit.reserved() as f64 > self.gc_threshold * l as f64)
    }

    /// PyTorch `garbage_collect_cached_blocks`: while reserved bytes are over the threshold,
    /// releases the physical pages held for expandable segments (`page_pool`; not in
    /// PyTorch, which holds none), then the whole free segments whose age is at least the
    /// average age of those left,
    /// and again with the new average, until enough is released or nothing more is. A driver
    /// failure stops the collection (the out-of-memory path, if it comes to that, tries
    /// again). Returns the bytes released.
    pub(super) fn collect_garbage(&self) -> usize {
        let Some(limit) = self.limit.get() else { return 0 };
        let threshold = (self.gc_threshold * limit as f64) as i64;
        let target = (self.limit.reserved() - threshold).max(0) as usize;
        // Held pages first: they count against the limit and hold nothing a stream cached.
        let held = self.pages.held();
        let (mut released, failure) =
            self.pages.release(&*self.driver, self.device, &self.limit, held.saturating_sub(target), None);
        if failure.is_some() || released >= target {
            return released;
        }
        let mut candidates = Vec::new();
        let mut owners = Vec::new();
        for shard in self.shards.all() {
            let before = candidates.len();
            let st = shard.lock();
            st.collectable(&mut candidates);
            drop(st);
            owners.extend(std::iter::repeat_n(shard, candidates.len() - before));
        }
        let mut left: Vec<usize> = (0..candidates.len()).collect();
        while released < target && !left.is_empty() {
            let total: u64 = left.iter().map(|&i| u64::from(candidates[i].2)).sum();
            let average = total as f64 / left.len() as f64;
            let (mut old, young): (Vec<usize>, Vec<usize>) =
                left.iter().partition(|&&i| f64::from(candidates[i].2) >= average);
            // The oldest first: the pass may stop once enough is released (PyTorch releases
            // every block of the pass).
            old.sort_by_key(|&i| std::cmp::Reverse(candidates[i].2));
            for &i in &old {
                if released >= target {
                    break;
                }
                let shard = &owners[i];
                let ctx = self.ctx(shard);
                let mut st = self.shards.lock_for_change(shard);
                match st.release_if_free(&ctx, candidates[i].0) {
                    Ok(bytes) => released += bytes,
                    Err(_) => {
                        self.finish(st, ());
                        return released;
                    }
                }
                self.finish(st, ());
            }
            left = young;
        }
        released
    }
}
