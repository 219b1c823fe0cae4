//! Registration for transports (`gpupool_segment_mapped_range`): the whole mapped range of the
//! segment under a pointer gpupool handed out, and a dma-buf descriptor of it
//! (`cuMemGetHandleForAddressRange`), so that an RDMA or NVLink transfer engine (NIXL,
//! Mooncake, UCX, NCCL's user-buffer registration) registers each mapping once and never a
//! tensor. PyTorch has no such call; its transports ask the driver (`cuMemGetAddressRange`),
//! which on an expandable segment answers one physical allocation only, so that a
//! registration past it fails (Mooncake #2511, EINVAL from `ibv_reg_dmabuf_mr`).
//!
//! The rule, one range per mapped run:
//! - an ordinary segment (`cuMemAlloc`) is one run, the whole segment;
//! - an expandable segment's run is the stretch of pages mapped side by side around the
//!   pointer's page: CUDA lets one dma-buf span several physical allocations mapped
//!   contiguously, all of one device and with identical properties (gpupool's pages are), so
//!   the run is one descriptor however many pages it holds; a page unmapped in the middle (the
//!   cache released between live blocks) cuts the segment into runs, and each run is
//!   registered apart, since CUDA refuses a range that is not wholly mapped.
//!
//! A run changes as its segment grows and shrinks; the segment observers' `MAP` and `UNMAP`
//! events say when (`observers::segments`), `UNMAP` before the pages go: a transport drops the
//! registrations the event overlaps, and asks again for the run of a pointer when it next
//! needs one (CUDA asks for a new descriptor after the physical memory changes).
//!
//! - `shard.rs`: the run of a pointer, read under its shard's lock.
//! - `allocator.rs`: `Allocator::mapped_range` and `Allocator::mapped_range_dmabuf`, the checks
//!   and the driver's descriptor.

mod allocator;
mod shard;

use crate::driver::{DevicePtr, StreamHandle};

/// The mapped run under a pointer (see the module docs), in bytes of device address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    /// The device ordinal.
    pub device: i32,
    /// The run's first byte: a segment's start, or a page boundary of an expandable segment.
    pub base: DevicePtr,
    /// The run's length: the segment's size, or whole pages.
    pub bytes: usize,
    /// The segment's start.
    pub segment_base: DevicePtr,
    /// The segment's size: an expandable segment's whole reserved range, mapped or not.
    pub segment_bytes: usize,
    /// Whether the segment is expandable (its run may grow and shrink).
    pub expandable: bool,
    /// The stream whose pools own the segment.
    pub stream: StreamHandle,
    /// The segment's private pool; 0 for the default pools.
    pub pool: u64,
}
