//! gpupool's high-water rule for expandable segments (`GPUPOOL_EXPANDABLE_RECLAIM`; not in
//! PyTorch, which unmaps pages only in `empty_cache` and on out of memory): what growing past
//! the device's high-water mark does first.

/// gpupool's rule for expandable segments (not in PyTorch, which unmaps pages only when the
/// cache is released): the device's reserved bytes do not pass their high-water mark while
/// wholly free pages are mapped anywhere on the device. Before an expandable segment grows
/// past the mark, free pages are unmapped instead (a device synchronisation, see
/// `ShardState::unmap_free_pages`), so that memory freed by one request or one stream holds
/// the next one's growth, wherever it must be mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reclaim {
    /// Grow without unmapping (the rule is off).
    Off,
    /// Unmap free pages of this shard, then grow.
    Shard,
    /// Unmap free pages of this shard; if that is not enough, answer [`Growth::PastMark`] so
    /// that the caller, holding no shard lock, unmaps other streams' pages first.
    Device,
}
