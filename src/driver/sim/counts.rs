//! The simulated driver's count of each call it was asked ([`SimCounts`]).

/// How often each driver call was made, for tests that check what the allocator asked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounts {
    pub mem_alloc: u64,
    pub mem_free: u64,
    pub event_create: u64,
    pub event_record: u64,
    pub event_query: u64,
    pub event_synchronize: u64,
    pub event_destroy: u64,
    pub device_synchronize: u64,
    pub address_reserve: u64,
    pub mem_create: u64,
    pub mem_map: u64,
    /// Successful `mem_map`s of a handle at the address where it was last mapped (its
    /// granules last mapped by it, in order): a multi-mapping allocator (GMLake) would have
    /// left it mapped there and made no call. With `map_returnable` and `map_new`, each
    /// successful map counted once (see `multimap`).
    pub map_same: u64,
    /// Successful `mem_map`s at an address whose last handle (the same size, over the same
    /// granules) is alive and mapped nowhere now: a multi-mapping allocator would have given
    /// the address that handle back without a call. Optimistic: a handle left at several
    /// addresses is returnable at each.
    pub map_returnable: u64,
    /// The other successful `mem_map`s: at an address never mapped, or whose last handle is
    /// mapped elsewhere now or was released. A multi-mapping allocator would map too.
    pub map_new: u64,
    /// Of `map_new`, the maps whose first granule was never mapped before (since reserved);
    /// the others' last handle is mapped elsewhere now or was released.
    pub map_fresh: u64,
    /// Runs of maps granted access by one `mem_set_access` (one growth of a segment).
    pub map_runs: u64,
    /// Of `map_runs`, those whose every map was `map_same` or `map_returnable`: a bound that
    /// needs a growth's pages all spared at once.
    pub map_runs_spared: u64,
    /// 2 MiB granules of address space mapped for the first time (since reserved): the
    /// address space a multi-mapping allocator would keep mapped.
    pub va_pages_first_mapped: u64,
    pub mem_set_access: u64,
    /// Devices named over all `mem_set_access` calls (the access descriptors): what the calls
    /// cost grows with, one page table per device.
    pub mem_access_descs: u64,
    pub mem_unmap: u64,
    /// `mem_release` calls (`cuMemRelease`), failed ones included, as the other counts.
    pub mem_release: u64,
    pub host_alloc: u64,
    pub host_free: u64,
    pub host_register: u64,
    pub host_unregister: u64,
    /// `host_map` and `host_unmap` calls (a sleeping pool's pageable host copy).
    pub host_map: u64,
    pub host_unmap: u64,
    /// Copies through [`SimDriver::memcpy_htod_async`] whose source was not wholly pinned: on
    /// a GPU they would be synchronous staging copies, not asynchronous DMA.
    pub unpinned_copies: u64,
    /// Streams made by `stream_create` (gpupool's copy streams).
    pub stream_create: u64,
    /// `stream_synchronize` calls (each a `cuStreamSynchronize`), failed ones included.
    pub stream_synchronize: u64,
    /// Copies queued by `memcpy_dtoh_async` and `memcpy_htod_async`, and their bytes.
    pub copies: u64,
    pub copied_bytes: u64,
    /// `stream_capture_status` calls (each a `cuStreamGetCaptureInfo`).
    pub capture_info: u64,
    /// Calls that CUDA forbids while a stream captures, made while one did: each failed and
    /// invalidated a capture. A capture-safe allocator keeps this at 0.
    pub capture_violations: u64,
    /// `mem_range_dmabuf` calls (each a `cuMemGetHandleForAddressRange`), failed ones included.
    pub dmabufs: u64,
}
