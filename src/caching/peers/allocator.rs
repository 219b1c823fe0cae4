//! `Allocator::enable_peer_access` (`gpupool_enable_peer_access`; PyTorch
//! `CUDACachingAllocator::enablePeerAccess(dev, dev_to_access)`): the checks, the owner's
//! device told, and the imports of other processes' memory on the owner granted as well
//! (PyTorch grants the expandable segments of `ipcMemHandle_to_devptr` likewise).

use crate::caching::allocator::Allocator;
use crate::error::Error;

impl Allocator {
    /// Makes the memory gpupool maps on `peer` reachable from `device` (PyTorch's
    /// `enablePeerAccess(dev, dev_to_access)`, `dev` = `device`): every page of `peer`'s
    /// expandable segments, sleepable pools and expandable imports mapped now is granted read
    /// and write for `device` (`cuMemSetAccess`), and every page mapped from now on is mapped
    /// for it too. Returns false when it was enabled already (nothing done). Not undone: as in
    /// PyTorch, a peer stays enabled for the allocator's life. Ordinary segments
    /// (`cuMemAlloc`) are not gpupool's to grant: `cudaDeviceEnablePeerAccess` (which PyTorch's
    /// call also makes, and gpupool's does not) stays the program's job for them.
    ///
    /// Thread-safe: a page mapped on another thread during the call gets the access too (see
    /// `caching::peers`).
    ///
    /// Errors, each leaving every mapping as it was: [`Error::InvalidValue`] for a device out of
    /// range, `device == peer`, or a pair the driver says cannot reach each other
    /// (`cuDeviceCanAccessPeer`); [`Error::Cuda`] when the driver refuses a grant (naming both
    /// devices; the grants made are revoked and the peer is not enabled).
    pub fn enable_peer_access(&self, device: i32, peer: i32) -> Result<bool, Error> {
        let count = self.driver.device_count();
        for (what, d) in [("device", device), ("peer", peer)] {
            if !(0..count).contains(&d) {
                return Err(Error::InvalidValue(format!(
                    "{what} {d} is out of range: there are {count} devices (gpupool_enable_peer_access)"
                )));
            }
        }
        if device == peer {
            return Err(Error::InvalidValue(format!(
                "device {device} cannot be its own peer: its memory is always mapped for it (gpupool_enable_peer_access)"
            )));
        }
        let can = self.driver.can_access_peer(device, peer).map_err(|e| {
            Error::driver(e, &format!("asking whether device {device} can reach device {peer}'s memory"))
        })?;
        if !can {
            return Err(Error::InvalidValue(format!(
                "device {device} cannot reach device {peer}'s memory directly (cuDeviceCanAccessPeer is 0): no \
                 peer access between them"
            )));
        }
        let owner = self.device_or_init(peer)?;
        let imports = |accessor, rw| self.ipc_imports.set_peer_access(&*self.driver, peer, accessor, rw);
        owner.enable_peer(device, imports).map_err(|e| {
            Error::driver_call(e, &format!("granting device {device} access to the memory mapped on device {peer}"))
        })
    }

    /// The devices granted access to the memory gpupool maps on `device` besides `device`
    /// itself (those enabled by [`Allocator::enable_peer_access`]), in the order they were
    /// enabled. No driver call.
    ///
    /// Errors: [`Error::InvalidValue`] for a device out of range.
    pub fn peers_of(&self, device: i32) -> Result<Vec<i32>, Error> {
        Ok(self.device_or_init(device)?.peers_enabled())
    }
}
