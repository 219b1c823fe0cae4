//! A peer enabled on one device (PyTorch `DeviceCachingAllocator::addPeerAccess`, then
//! `ExpandableSegment::addPeer` on each segment): every mapped range of the device's streams
//! granted to the peer, one `cuMemSetAccess` per run of mapped pages; when the driver refuses
//! one, the peer is taken out of the list and its grants so far revoked, so that the device's
//! memory is again mapped for exactly its owner and the peers enabled.

use crate::caching::device::DeviceAllocator;
use crate::caching::shard::ShardState;
use crate::driver::{Driver, DriverError};

impl DeviceAllocator {
    /// Grants `peer` access to every range of this device's memory mapped now and to come.
    /// `others` grants (or, with `false`, revokes) it over the mappings of this device's memory
    /// kept elsewhere (the imports of other processes' memory), after the streams'. Returns
    /// false when `peer` was enabled already (nothing is asked of the driver).
    ///
    /// Errors: the driver's first refusal, after the peer was taken out again and every grant
    /// of this call revoked (a revocation the driver refuses leaves that range reachable from
    /// the peer, which is harmless: more access, never less); a driver call that unwinds is
    /// undone likewise before it goes on.
    pub(crate) fn enable_peer(
        &self,
        peer: i32,
        others: impl Fn(i32, bool) -> Result<(), DriverError>,
    ) -> Result<bool, DriverError> {
        let _serial = self.peers.enabling.lock();
        if !self.peers.add(peer) {
            return Ok(false);
        }
        // A driver call that unwinds is undone as a refusal is, then goes on.
        let granted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.set_peer_access(peer, true).and_then(|()| others(peer, true))
        }));
        if let Ok(Ok(())) = granted {
            return Ok(true);
        }
        self.peers.remove(peer);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = self.set_peer_access(peer, false);
            let _ = others(peer, false);
        }));
        match granted {
            Ok(r) => r.map(|()| true),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// The peers this device's memory is mapped for, in the order they were enabled.
    pub(crate) fn peers_enabled(&self) -> Vec<i32> {
        self.peers.enabled()
    }

    /// `peer`'s access set over every mapped range of every stream of the device, each shard
    /// under its lock in turn. Every range is tried; returns the first failure.
    fn set_peer_access(&self, peer: i32, read_write: bool) -> Result<(), DriverError> {
        let mut first = Ok(());
        for shard in self.shards.all() {
            let st = shard.lock();
            first = first.and(set_access(&st, &*self.driver, self.device, peer, read_write));
        }
        first
    }
}

/// `peer`'s access set over each run of mapped pages of the shard's expandable segments.
/// Every run is tried; returns the first failure.
fn set_access(
    st: &ShardState,
    driver: &dyn Driver,
    device: i32,
    peer: i32,
    read_write: bool,
) -> Result<(), DriverError> {
    let mut first = Ok(());
    for seg in st.segments.values() {
        let Some(e) = seg.exp.as_deref() else { continue };
        let table = e.page_table();
        let mut i = 0;
        while i < table.len() {
            if table[i].is_none() {
                i += 1;
                continue;
            }
            let start = i;
            while i < table.len() && table[i].is_some() {
                i += 1;
            }
            let at = e.base + (start * e.page) as u64;
            first = first.and(driver.mem_set_access(device, at, (i - start) * e.page, &[peer], read_write));
        }
    }
    first
}
