//! The streams a shard's live blocks may be in use on besides their own (`record_stream`), so
//! that a retire of a stream none of them names looks at no block. Without it the retire read
//! every live block of the device under each shard's lock: 1.1 ms with 100,000 live blocks and
//! 38 ms with a million (`examples/c/retire_cost.c`, docs/rules.md), once per
//! `cudaStreamDestroy` under the LD_PRELOAD shim, every malloc and free of those shards
//! waiting meanwhile; with it, 0.13-0.25 us.
//!
//! A superset: a stream is noted when `record_stream` first names it for a block, and leaves
//! only when a retire finds no live block using it or forgets its uses, or when the set is
//! rebuilt from the live blocks (once it passes its bound, twice what the last rebuild kept, at
//! least 64), so a block freed or a use dropped otherwise leaves its stream noted until then.
//! No memory until a `record_stream`.

use rustc_hash::FxHashSet;

use crate::driver::StreamHandle;

/// Fewest streams noted before the set is rebuilt from the live blocks.
const FIRST_BOUND: usize = 64;

/// The streams noted (see the module). Not on the hit path: `record_stream` notes, the retire
/// reads and forgets.
#[derive(Default)]
pub(crate) struct UsedStreams {
    set: Option<Box<FxHashSet<StreamHandle>>>,
    /// Above this many streams (and [`FIRST_BOUND`]) the set is rebuilt.
    bound: usize,
}

impl UsedStreams {
    /// Whether `stream` may be in use by a live block of the shard; false means it is not.
    pub fn may_hold(&self, stream: StreamHandle) -> bool {
        self.set.as_ref().is_some_and(|s| s.contains(&stream))
    }

    /// Notes `stream`; returns whether the set has passed its bound and wants rebuilding
    /// ([`UsedStreams::rebuild`]).
    pub fn note(&mut self, stream: StreamHandle) -> bool {
        let set = self.set.get_or_insert_with(Box::default);
        set.insert(stream);
        set.len() > self.bound.max(FIRST_BOUND)
    }

    /// Forgets `stream`: no live block is in use on it any more.
    pub fn forget(&mut self, stream: StreamHandle) {
        if let Some(set) = &mut self.set {
            set.remove(&stream);
            if set.is_empty() {
                self.set = None;
            }
        }
    }

    /// Keeps exactly `streams` (those the live blocks are in use on), the bound twice as many.
    pub fn rebuild(&mut self, streams: impl Iterator<Item = StreamHandle>) {
        let set: FxHashSet<StreamHandle> = streams.collect();
        self.bound = 2 * set.len();
        self.set = (!set.is_empty()).then(|| Box::new(set));
    }

    /// How many streams are noted.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.set.as_ref().map_or(0, |s| s.len())
    }
}
