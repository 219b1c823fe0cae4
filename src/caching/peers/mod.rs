//! Peer access to a device's mapped memory, as PyTorch grants it (`ExpandableSegment`'s
//! `peers_`, `setAccess` and `addPeer`; `DeviceCachingAllocator::addPeerAccess` and
//! `devices_with_peer_access_`; `CUDACachingAllocator::enablePeerAccess`). Memory mapped with
//! `cuMemMap` is reachable from exactly the devices named to `cuMemSetAccess`, and
//! `cudaDeviceEnablePeerAccess` does not apply to it; each device named costs the map a page
//! table update. So a page is mapped with access for the device that owns it and for the peers
//! the program enabled (`gpupool_enable_peer_access`), no others, and enabling a peer grants it
//! every range already mapped.
//!
//! - `mod.rs`: [`Peers`], a device's list of the devices granted access to its memory.
//! - `device.rs`: a peer enabled on one device: every mapped range of its streams granted, and
//!   undone when the driver refuses one.
//! - `allocator.rs`: `Allocator::enable_peer_access`, the checks, and the imports of other
//!   processes' expandable segments (PyTorch `ipcMemHandle_to_devptr`'s segments).
//!
//! Lock order: [`Peers`]'s list is a leaf (read under a shard's lock or the imports' lock by
//! every map); its `enabling` lock serialises the enables of one device and is held while the
//! enable takes each shard's lock in turn, then the imports' lock. Why no map misses a peer: the
//! list gains the peer before the enable takes any of those locks, and a map reads the list and
//! sets the access under one of them; so each map either ends before the enable visits its lock
//! (and the enable grants its range) or reads the list with the peer in it.

mod allocator;
mod device;

use parking_lot::Mutex;

/// The devices a device's memory is mapped for besides itself (PyTorch
/// `devices_with_peer_access_`), in the order they were enabled. Thread-safe.
#[derive(Default)]
pub(crate) struct Peers {
    list: Mutex<Vec<i32>>,
    /// Held by an enable from its first step to its last (see the module).
    enabling: Mutex<()>,
}

impl Peers {
    /// The devices a map on `owner` grants: `owner`, then each peer enabled. A short lock.
    pub fn access(&self, owner: i32) -> Vec<i32> {
        let list = self.list.lock();
        let mut all = Vec::with_capacity(list.len() + 1);
        all.push(owner);
        all.extend_from_slice(&list);
        all
    }

    /// The peers enabled, in order.
    pub fn enabled(&self) -> Vec<i32> {
        self.list.lock().clone()
    }

    /// Adds `peer`; false when it was there already.
    fn add(&self, peer: i32) -> bool {
        let mut list = self.list.lock();
        if list.contains(&peer) {
            return false;
        }
        list.push(peer);
        true
    }

    /// Takes `peer` out of the list.
    fn remove(&self, peer: i32) {
        self.list.lock().retain(|&p| p != peer);
    }
}

#[cfg(test)]
mod tests {
    use super::Peers;

    #[test]
    fn a_map_grants_the_owner_then_each_peer_once() {
        let p = Peers::default();
        assert_eq!(p.access(2), [2]);
        assert!(p.add(0) && p.add(3) && !p.add(0));
        assert_eq!(p.access(2), [2, 0, 3]);
        p.remove(0);
        assert_eq!((p.access(2), p.enabled()), (vec![2, 3], vec![3]));
    }
}
