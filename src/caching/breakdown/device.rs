//! A device's [`Breakdown`]: where its reserved bytes go, every shard read under its lock
//! (see `stats::breakdown`).

use parking_lot::MutexGuard;

use crate::caching::device::DeviceAllocator;
use crate::caching::shard::ShardState;
use crate::stats::breakdown::Breakdown;

impl DeviceAllocator {
    /// Where the device's reserved bytes go, with every shard locked at once (one consistent
    /// state, as a snapshot takes it), the front caches read as they are: nothing changes.
    pub fn breakdown(&self) -> Breakdown {
        let list = self.shards.all();
        let guards: Vec<MutexGuard<'_, ShardState>> = list.iter().map(|s| s.lock_hot()).collect();
        let mut out = Breakdown::default();
        for (shard, st) in list.iter().zip(&guards) {
            st.breakdown_into(shard.stream, &mut out);
        }
        drop(guards);
        out.held = self.pages.held_by_page().into_iter().filter(|h| h.1 > 0).collect();
        out
    }
}
