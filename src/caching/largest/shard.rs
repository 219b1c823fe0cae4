//! The shard's part of the largest-request search: its blocks copied for the search
//! (`largest/mod.rs`), read under its lock without changing anything.

use rustc_hash::FxHashMap;

use super::{Kind, SegModel, ShardModel};
use crate::caching::block::{BlockId, BlockState, NIL};
use crate::caching::shard::ShardState;
use crate::driver::Driver;
use crate::error::Error;

impl ShardState {
    /// The shard's segments as `caching::largest` sees them, in no order and with blocks
    /// returned by their events not yet merged ([`ShardModel::settled`] does both, once the
    /// lock is dropped). With
    /// `driver`, the blocks whose every pending event has completed (`cuEventQuery`) count as
    /// free, as `process_events` would make them before a request; without, as awaiting their
    /// events. Changes nothing: the events stay pending, the blocks where they are.
    ///
    /// Errors: [`Error::Cuda`] when an event query fails (a request would fail with it too).
    pub fn model(&self, driver: Option<&dyn Driver>) -> Result<ShardModel, Error> {
        let mut ready: FxHashMap<BlockId, u32> = FxHashMap::default();
        if let Some(driver) = driver.filter(|_| self.events_pending()) {
            let done = self
                .events
                .completed(driver)
                .map_err(|e| Error::driver_call(e, "querying the events of freed blocks"))?;
            for id in done {
                *ready.entry(id).or_default() += 1;
            }
        }
        let segs = self
            .segments
            .iter()
            .map(|(&base, seg)| {
                let mut blocks = Vec::new();
                let mut id = seg.head;
                while id != NIL {
                    let b = &self.blocks[id];
                    let kind = match b.state {
                        // The front cache is merged before this runs (`Shard::lock`).
                        BlockState::Free | BlockState::Cached => Kind::Free,
                        BlockState::Allocated => Kind::Used,
                        // A block freed during a capture has no event yet (`capture_deferred`).
                        BlockState::AwaitingEvents if b.event_count > 0 && ready.get(&id) == Some(&b.event_count) => {
                            Kind::Free
                        }
                        BlockState::AwaitingEvents => Kind::Events,
                        BlockState::AwaitingSync => Kind::Sync,
                        BlockState::Unmapped => Kind::Unmapped,
                    };
                    blocks.push((b.size, kind));
                    id = b.next;
                }
                let pool = self.blocks[seg.head].pool;
                // A sleeping pool's free pages are unmapped already, and one a sleep is copying
                // keeps them (`keeps_pages`): neither gives anything back to a request.
                let releasable = !seg.graph && !self.keeps_pages();
                SegModel { base, pool, page: seg.exp.as_deref().map(|e| e.page), releasable, blocks }
            })
            .collect();
        Ok(ShardModel { segs })
    }

    /// Bytes of the handles the shard's expandable segments hold for no page (orphans of a
    /// map undone, or of a page the driver would not unmap: `expandable/segment.rs`), counted
    /// in no statistic; release-and-retry releases them with the rest (`release_pages`).
    pub fn orphan_bytes(&self) -> usize {
        self.segments.values().filter_map(|s| s.exp.as_deref()).map(|e| e.orphan_bytes()).sum()
    }
}
