//! Peer access to the memory gpupool maps (`gpupool_enable_peer_access`; PyTorch
//! `CUDACachingAllocator::enablePeerAccess`).

use std::ffi::c_int;

use super::runtime;
use super::status::{boundary, gpupool_status};

/// Makes the memory gpupool maps on device `peer` reachable from kernels and copies on
/// `device`: mirrors PyTorch's `CUDACachingAllocator::enablePeerAccess(dev, dev_to_access)`
/// (`device` = `dev`, `peer` = `dev_to_access`), as the argument order of
/// `cudaDeviceEnablePeerAccess(peer)` called on `device` ("`device` may access `peer`'s
/// memory"). One-way: call it again with the devices swapped for the other direction.
///
/// The rule, PyTorch's for expandable segments: memory on CUDA's virtual memory API (expandable
/// segments, sleepable pools, imported expandable segments of other processes) is reachable
/// from exactly the devices `cuMemSetAccess` names, and `cudaDeviceEnablePeerAccess` does not
/// apply to it. gpupool maps each page for the device that owns it and for the peers enabled by
/// this call, no others: a map costs the same on a host of eight GPUs as on one, until the
/// program enables peers. This call grants `device` every page of `peer` mapped now (one
/// `cuMemSetAccess` per run of mapped pages; PyTorch's `ExpandableSegment::addPeer`) and every
/// page mapped from now on, a page mapped by another thread during the call included; it stays
/// enabled for the process's life, as in PyTorch. A second call for the same pair does nothing.
/// Unlike PyTorch's, it does not call `cudaDeviceEnablePeerAccess`: memory of ordinary segments
/// (`cuMemAlloc`, `expandable_segments:False`) and the program's own memory still need it from
/// the program. Under PyTorch's pluggable allocator (`gpupool_torch.h`) PyTorch's
/// `enablePeerAccess` does not reach gpupool (`CUDAPluggableAllocator` has no hook for it): a
/// program that copies or reads across devices calls this (Python: `gpupool.enable_peer_access`).
///
/// Errors, each leaving every mapping as it was: `GPUPOOL_ERROR_INVALID_VALUE` for a device or
/// peer out of range, `device == peer`, or a pair that cannot reach each other
/// (`cuDeviceCanAccessPeer` is 0); `GPUPOOL_ERROR_CUDA` when the driver refuses a grant, naming
/// both devices: the grants of the call are revoked and the peer is not enabled (call again).
///
/// Thread-safe; takes each of `peer`'s stream locks in turn (an allocation on `peer` that maps
/// pages waits for it), never two at once.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_enable_peer_access(device: c_int, peer: c_int) -> gpupool_status {
    boundary("gpupool_enable_peer_access", || runtime()?.allocator.enable_peer_access(device, peer).map(|_| ()))
}
