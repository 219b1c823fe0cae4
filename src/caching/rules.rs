//! The size rules of PyTorch's CUDA caching allocator, one function each.
//!
//! Each constant carries the name it has in `c10/cuda/CUDACachingAllocator.cpp`, so a reader can
//! check the figures against PyTorch line by line. Every size here is in bytes.

/// Requests are rounded up to a multiple of this (PyTorch `kMinBlockSize`).
pub(crate) const MIN_BLOCK_SIZE: usize = 512;
/// Requests of at most this size come from the small pool (PyTorch `kSmallSize`, 1 MiB).
pub(crate) const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool (PyTorch `kSmallBuffer`, 2 MiB).
pub(crate) const SMALL_BUFFER: usize = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`] (PyTorch `kLargeBuffer`, 20 MiB).
pub(crate) const LARGE_BUFFER: usize = 20 << 20;
/// Large requests from this size on get a segment of their own size (PyTorch `kMinLargeAlloc`).
pub(crate) const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Large segments are rounded up to a multiple of this (PyTorch `kRoundLarge`, 2 MiB).
pub(crate) const ROUND_LARGE: usize = 2 << 20;

/// Which of a stream's two pools a block belongs to (PyTorch `BlockPool::is_small`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum PoolKind {
    /// Blocks of at most [`SMALL_SIZE`] bytes, carved from [`SMALL_BUFFER`] segments.
    Small,
    /// Everything larger.
    Large,
}

fn round_up(size: usize, multiple: usize) -> Option<usize> {
    size.checked_add(multiple - 1).map(|s| s / multiple * multiple)
}

/// Rounds a request up to the block size that will serve it (PyTorch `round_size`, with
/// `roundup_power2_divisions` unset): at least 512 bytes, in multiples of 512.
/// `None` when the rounding overflows `usize`.
pub(crate) fn round_size(size: usize) -> Option<usize> {
    if size < MIN_BLOCK_SIZE { Some(MIN_BLOCK_SIZE) } else { round_up(size, MIN_BLOCK_SIZE) }
}

/// The pool a rounded size is served from (PyTorch `get_pool`: `size <= kSmallSize`).
pub(crate) fn pool_for(rounded: usize) -> PoolKind {
    if rounded <= SMALL_SIZE { PoolKind::Small } else { PoolKind::Large }
}

/// The size of the segment asked of the driver when no cached block fits (PyTorch
/// `get_allocation_size`): 2 MiB for the small pool, 20 MiB below 10 MiB, else the request
/// rounded up to 2 MiB. `None` when that rounding overflows.
pub(crate) fn segment_size(rounded: usize) -> Option<usize> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_BUFFER)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(LARGE_BUFFER)
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

/// Whether a free block of `block_size` bytes that serves a request of `size` bytes is split,
/// the rest going back to the pool (PyTorch `should_split`): in the small pool, or in an
/// expandable segment, when at least 512 bytes remain; in the large pool when more than 1 MiB
/// remains and the request is under `max_split_size`. PyTorch asks whether expandable
/// segments are configured; gpupool asks whether the block is in one, which is the same but
/// where the device cannot map memory and falls back to ordinary segments.
pub(crate) fn should_split(
    pool: PoolKind,
    block_size: usize,
    size: usize,
    max_split_size: usize,
    expandable: bool,
) -> bool {
    let remaining = block_size - size;
    if pool == PoolKind::Small || expandable {
        return remaining >= MIN_BLOCK_SIZE;
    }
    size < max_split_size && remaining > SMALL_SIZE
}

/// Whether a cached block may serve a request, by PyTorch's `max_split_size` rules in
/// `get_free_block`: an oversize block (`>= max_split_size`) never serves a request under
/// `max_split_size`, and serves a larger request only if it wastes less than 20 MiB.
/// With `max_split_size` unset (`usize::MAX`, PyTorch's default) every fitting block may serve.
pub(crate) fn fits_oversize_rules(block_size: usize, size: usize, max_split_size: usize) -> bool {
    if size < max_split_size { block_size < max_split_size } else { block_size < size.saturating_add(LARGE_BUFFER) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_follows_pytorch() {
        assert_eq!(round_size(0), Some(512));
        assert_eq!(round_size(1), Some(512));
        assert_eq!(round_size(512), Some(512));
        assert_eq!(round_size(513), Some(1024));
        assert_eq!(round_size(usize::MAX), None);
    }

    #[test]
    fn pools_and_segments_follow_pytorch() {
        assert_eq!(pool_for(SMALL_SIZE), PoolKind::Small);
        assert_eq!(pool_for(SMALL_SIZE + 512), PoolKind::Large);
        assert_eq!(segment_size(512), Some(SMALL_BUFFER));
        assert_eq!(segment_size(SMALL_SIZE), Some(SMALL_BUFFER));
        assert_eq!(segment_size(SMALL_SIZE + 512), Some(LARGE_BUFFER));
        assert_eq!(segment_size(MIN_LARGE_ALLOC - 512), Some(LARGE_BUFFER));
        assert_eq!(segment_size(MIN_LARGE_ALLOC), Some(MIN_LARGE_ALLOC));
        assert_eq!(segment_size(MIN_LARGE_ALLOC + 1), Some(12 << 20));
        assert_eq!(segment_size(usize::MAX - 100), None);
    }

    #[test]
    fn split_rules_follow_pytorch() {
        assert!(should_split(PoolKind::Small, 2 << 20, 1 << 20, usize::MAX, false));
        assert!(!should_split(PoolKind::Small, 1024, 1024, usize::MAX, false));
        assert!(should_split(PoolKind::Small, 1024, 512, usize::MAX, false));
        // Large pool: the remainder must exceed 1 MiB.
        assert!(!should_split(PoolKind::Large, 3 << 20, 2 << 20, usize::MAX, false));
        // In an expandable segment, 512 bytes left are enough.
        assert!(should_split(PoolKind::Large, (2 << 20) + 512, 2 << 20, usize::MAX, true));
        assert!(should_split(PoolKind::Large, (3 << 20) + 512, 2 << 20, usize::MAX, false));
        // ... and the request must be under max_split_size.
        assert!(!should_split(PoolKind::Large, 40 << 20, 30 << 20, 25 << 20, false));
    }

    #[test]
    fn oversize_rules_follow_pytorch() {
        let max = 64 << 20;
        assert!(fits_oversize_rules(8 << 20, 4 << 20, max));
        assert!(!fits_oversize_rules(64 << 20, 4 << 20, max));
        assert!(fits_oversize_rules(80 << 20, 64 << 20, max));
        assert!(!fits_oversize_rules(84 << 20, 64 << 20, max));
        assert!(fits_oversize_rules(usize::MAX - 1, 1 << 20, usize::MAX));
    }
}
