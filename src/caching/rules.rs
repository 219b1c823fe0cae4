//! The size rules of PyTorch's CUDA caching allocator, one function each.
//!
//! Each constant carries the name it has in `c10/cuda/CUDACachingAllocator.cpp` or
//! `c10/core/AllocatorConfig.h`, so a reader can check the figures against PyTorch line by line.
//! Every size here is in bytes. The settings of `GPUPOOL_CONF` that these rules read are in
//! [`SizeRules`], taken from the allocator's [`Config`] when a device starts.

use crate::config::{Config, ROUNDUP_INTERVALS};

/// Requests are rounded up to a multiple of this (PyTorch `kMinBlockSize`).
pub(crate) const MIN_BLOCK_SIZE: usize = 512;
/// Requests of at most this size come from the small pool (PyTorch `kSmallSize`, 1 MiB).
pub(crate) const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool (PyTorch `kSmallBuffer`, 2 MiB).
pub(crate) const SMALL_BUFFER: usize = 2 << 20;
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

/// The settings of `GPUPOOL_CONF` that the size rules read, fixed for a device when it starts
/// (PyTorch reads them from `AcceleratorAllocatorConfig` at each call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SizeRules {
    /// PyTorch `max_split_size`: blocks of at least this size are never split (`usize::MAX`:
    /// none).
    pub max_split_size: usize,
    /// PyTorch `max_non_split_rounding_size`: how much larger than a request of at least
    /// `max_split_size` a cached block may be and still serve it (less than this).
    pub max_non_split_rounding: usize,
    /// PyTorch `large_segment_size`: the segment of a request over 1 MiB and under
    /// [`MIN_LARGE_ALLOC`] (`kLargeBuffer`, 20 MiB, before PyTorch 2.11 made it a setting).
    pub large_segment_size: usize,
    /// PyTorch `roundup_power2_divisions`, per size interval (see [`ROUNDUP_INTERVALS`]);
    /// `None` when no interval has more than one division (PyTorch's default), so that a
    /// request then rounds without looking its interval up.
    pub roundup_power2_divisions: Option<[usize; ROUNDUP_INTERVALS]>,
}

impl Default for SizeRules {
    /// PyTorch's defaults: no `max_split_size`, 20 MiB large segments and rounding, no
    /// power-of-two divisions.
    fn default() -> Self {
        SizeRules::from_config(&Config::default())
    }
}

impl SizeRules {
    /// The rules `c` sets (its `max_split_size_mb`, `max_non_split_rounding_mb`,
    /// `large_segment_size_mb` and `roundup_power2_divisions`, in bytes and counts).
    pub fn from_config(c: &Config) -> SizeRules {
        SizeRules {
            max_split_size: c.max_split_size,
            max_non_split_rounding: c.max_non_split_rounding,
            large_segment_size: c.large_segment_size,
            roundup_power2_divisions: Some(c.roundup_power2_divisions).filter(|t| t.iter().any(|&d| d > 1)),
        }
    }

    /// The divisions for a request of `size` bytes (PyTorch
    /// `AcceleratorAllocatorConfig::roundup_power2_divisions(size)`): the entry of the interval
    /// of `floor(log2(size))`, counted from 1 MiB; sizes under 2 MiB take the first, sizes of
    /// 32 GiB and more the last.
    pub fn divisions(&self, size: usize) -> usize {
        self.roundup_power2_divisions.map_or(0, |table| {
            let log = (usize::BITS - 1).saturating_sub(size.leading_zeros()) as usize;
            table[log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1)]
        })
    }
}

fn round_up(size: usize, multiple: usize) -> Option<usize> {
    size.checked_add(multiple - 1).map(|s| s / multiple * multiple)
}

/// Rounds `size` up to the next of `divisions` equal steps between the powers of two around it
/// (PyTorch `roundup_power2_next_division`): with 4 divisions, 1200 lies between 1024 and 2048,
/// whose steps are 1024, 1280, 1536 and 1792, so it becomes 1280. A power of two stays as it is;
/// `divisions` is a power of two of at least 2. `None` when the result overflows `usize`.
pub(crate) fn roundup_power2_next_division(size: usize, divisions: usize) -> Option<usize> {
    debug_assert!(divisions >= 2 && divisions.is_power_of_two());
    if size.is_power_of_two() {
        return Some(size);
    }
    let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let step = floor >> divisions.trailing_zeros();
    if step == 0 {
        // More divisions than the interval has bytes: the next power of two.
        return floor.checked_mul(2);
    }
    let down = size & !(step - 1);
    if down == size { Some(size) } else { down.checked_add(step) }
}

/// Rounds a request up to the block size that will serve it (PyTorch `round_size`): under 512
/// bytes, 512; when the size's interval has more than one division (`roundup_power2_divisions`)
/// and the size is more than 512 bytes times them, the next division
/// ([`roundup_power2_next_division`]); else a multiple of 512. `None` when the rounding
/// overflows `usize`.
pub(crate) fn round_size(size: usize, rules: &SizeRules) -> Option<usize> {
    if size < MIN_BLOCK_SIZE {
        return Some(MIN_BLOCK_SIZE);
    }
    let divisions = rules.divisions(size);
    if divisions > 1 && size > MIN_BLOCK_SIZE.saturating_mul(divisions) {
        roundup_power2_next_division(size, divisions)
    } else {
        round_up(size, MIN_BLOCK_SIZE)
    }
}

/// The pool a rounded size is served from (PyTorch `get_pool`: `size <= kSmallSize`).
pub(crate) fn pool_for(rounded: usize) -> PoolKind {
    if rounded <= SMALL_SIZE { PoolKind::Small } else { PoolKind::Large }
}

/// The size of the segment asked of the driver when no cached block fits (PyTorch
/// `get_allocation_size`): 2 MiB for the small pool, `large_segment_size` (20 MiB by default)
/// below 10 MiB, else the request rounded up to 2 MiB. `None` when that rounding overflows.
pub(crate) fn segment_size(rounded: usize, rules: &SizeRules) -> Option<usize> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_BUFFER)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(rules.large_segment_size)
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

/// Whether a cached block may serve a request, by PyTorch 2.11's `max_split_size` rules in
/// `get_free_block`: an oversize block (`>= max_split_size`) never serves a request under
/// `max_split_size`, and serves a larger request only if `block_size < size +
/// max_non_split_rounding` (20 MiB by default). With `max_split_size` unset (`usize::MAX`,
/// PyTorch's default) every fitting block may serve.
pub(crate) fn fits_oversize_rules(block_size: usize, size: usize, rules: &SizeRules) -> bool {
    if size < rules.max_split_size {
        block_size < rules.max_split_size
    } else {
        block_size < size.saturating_add(rules.max_non_split_rounding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const LARGE_BUFFER: usize = 20 * MIB;

    fn with_divisions(table: [usize; ROUNDUP_INTERVALS]) -> SizeRules {
        SizeRules::from_config(&Config { roundup_power2_divisions: table, ..Config::default() })
    }

    #[test]
    fn rounding_follows_pytorch() {
        let r = SizeRules::default();
        assert_eq!(round_size(0, &r), Some(512));
        assert_eq!(round_size(1, &r), Some(512));
        assert_eq!(round_size(512, &r), Some(512));
        assert_eq!(round_size(513, &r), Some(1024));
        assert_eq!(round_size(1200 << 10, &r), Some(1200 << 10));
        assert_eq!(round_size(usize::MAX, &r), None);
    }

    #[test]
    fn next_division_follows_pytorch() {
        // PyTorch's own example: 1200 with 4 divisions lies between 1024 and 2048, whose steps
        // are 1024, 1280, 1536, 1792.
        assert_eq!(roundup_power2_next_division(1200, 4), Some(1280));
        // 1200 KiB: between 1 MiB and 2 MiB, steps of 256 KiB.
        assert_eq!(roundup_power2_next_division(1200 << 10, 4), Some(1280 << 10));
        // On a step, and on a power of two, the size stays.
        assert_eq!(roundup_power2_next_division(1536 << 10, 4), Some(1536 << 10));
        assert_eq!(roundup_power2_next_division(1 << 30, 8), Some(1 << 30));
        // One byte past a step goes to the next; past the last step, to the next power of two.
        assert_eq!(roundup_power2_next_division((1280 << 10) + 1, 4), Some(1536 << 10));
        assert_eq!(roundup_power2_next_division((1792 << 10) + 1, 4), Some(2 << 20));
        // 2 divisions: 300 MiB lies between 256 and 512, steps 256 and 384.
        assert_eq!(roundup_power2_next_division(300 * MIB, 2), Some(384 * MIB));
        // More divisions than the interval has bytes: the next power of two.
        assert_eq!(roundup_power2_next_division(3, 4), Some(4));
        assert_eq!(roundup_power2_next_division(usize::MAX, 2), None);
    }

    #[test]
    fn round_size_uses_the_divisions_of_the_sizes_interval() {
        let r = with_divisions([4; ROUNDUP_INTERVALS]);
        // Under 512 bytes, 512; up to 512 * 4 bytes, multiples of 512 (PyTorch: `size >
        // kMinBlockSize * divisions`).
        assert_eq!(round_size(100, &r), Some(512));
        assert_eq!(round_size(2000, &r), Some(2048));
        assert_eq!(round_size(2048, &r), Some(2048));
        assert_eq!(round_size(2049, &r), Some(2560));
        assert_eq!(round_size(3000, &r), Some(3072));
        assert_eq!(round_size(1200 << 10, &r), Some(1280 << 10));
        assert_eq!(round_size(5 * MIB, &r), Some(5 * MIB));
        assert_eq!(round_size(5 * MIB + 1, &r), Some(6 * MIB));
        assert_eq!(round_size(300 * MIB, &r), Some(320 * MIB));
        // 0 and 1 leave the 512-byte rounding.
        for d in [0, 1] {
            let r = with_divisions([d; ROUNDUP_INTERVALS]);
            assert_eq!(round_size(1200 << 10, &r), Some(1200 << 10));
            assert_eq!(round_size(3000, &r), Some(3072));
        }
        // [256:1,512:2,1024:4,>:8]: intervals 0..=8 (under 512 MiB) 1, [512 MiB, 1 GiB) 2,
        // [1 GiB, 2 GiB) 4, from 2 GiB 8.
        let r = with_divisions([1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]);
        assert_eq!(round_size(300 * MIB + 1, &r), Some(300 * MIB + 512));
        assert_eq!(round_size(600 * MIB, &r), Some(768 * MIB));
        assert_eq!(round_size(1100 * MIB, &r), Some(1280 * MIB));
        assert_eq!(round_size(2100 * MIB, &r), Some(2304 * MIB));
        assert_eq!(round_size(40 << 30, &r), Some(40 << 30));
        // 40 GiB lies between 32 and 64 GiB, 8 steps of 4 GiB.
        assert_eq!(round_size((40 << 30) + 1, &r), Some(44 << 30));
    }

    #[test]
    fn divisions_are_looked_up_by_power_of_two_interval_from_1mib() {
        let mut t = [0; ROUNDUP_INTERVALS];
        for (i, d) in t.iter_mut().enumerate() {
            *d = i + 100;
        }
        let r = with_divisions(t);
        assert_eq!(r.divisions(512), 100, "under 1 MiB: the first interval");
        assert_eq!(r.divisions(2 * MIB - 1), 100);
        assert_eq!(r.divisions(2 * MIB), 101);
        assert_eq!(r.divisions(256 * MIB), 108);
        assert_eq!(r.divisions(512 * MIB - 1), 108);
        assert_eq!(r.divisions(32 << 30), 115);
        assert_eq!(r.divisions(usize::MAX), 115, "beyond 64 GiB: the last interval");
    }

    #[test]
    fn pools_and_segments_follow_pytorch() {
        let r = SizeRules::default();
        assert_eq!(pool_for(SMALL_SIZE), PoolKind::Small);
        assert_eq!(pool_for(SMALL_SIZE + 512), PoolKind::Large);
        assert_eq!(segment_size(512, &r), Some(SMALL_BUFFER));
        assert_eq!(segment_size(SMALL_SIZE, &r), Some(SMALL_BUFFER));
        assert_eq!(segment_size(SMALL_SIZE + 512, &r), Some(LARGE_BUFFER));
        assert_eq!(segment_size(MIN_LARGE_ALLOC - 512, &r), Some(LARGE_BUFFER));
        assert_eq!(segment_size(MIN_LARGE_ALLOC, &r), Some(MIN_LARGE_ALLOC));
        assert_eq!(segment_size(MIN_LARGE_ALLOC + 1, &r), Some(12 << 20));
        assert_eq!(segment_size(usize::MAX - 100, &r), None);
        // large_segment_size_mb changes the segments of the requests between 1 and 10 MiB only.
        let r = SizeRules { large_segment_size: 64 * MIB, ..r };
        assert_eq!(segment_size(SMALL_SIZE, &r), Some(SMALL_BUFFER));
        assert_eq!(segment_size(SMALL_SIZE + 512, &r), Some(64 * MIB));
        assert_eq!(segment_size(MIN_LARGE_ALLOC - 512, &r), Some(64 * MIB));
        assert_eq!(segment_size(MIN_LARGE_ALLOC, &r), Some(MIN_LARGE_ALLOC));
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
        let r = SizeRules { max_split_size: 64 * MIB, ..SizeRules::default() };
        assert!(fits_oversize_rules(8 * MIB, 4 * MIB, &r));
        assert!(!fits_oversize_rules(64 * MIB, 4 * MIB, &r));
        // A request of at least max_split_size: the block must be under request + 20 MiB.
        assert!(fits_oversize_rules(80 * MIB, 64 * MIB, &r));
        assert!(fits_oversize_rules(84 * MIB - 1, 64 * MIB, &r));
        assert!(!fits_oversize_rules(84 * MIB, 64 * MIB, &r));
        // max_non_split_rounding_mb moves that bound.
        let wide = SizeRules { max_non_split_rounding: 40 * MIB, ..r };
        assert!(fits_oversize_rules(100 * MIB, 64 * MIB, &wide));
        assert!(!fits_oversize_rules(104 * MIB, 64 * MIB, &wide));
        assert!(!fits_oversize_rules(64 * MIB, 4 * MIB, &wide), "small requests still never take oversize blocks");
        assert!(fits_oversize_rules(usize::MAX - 1, 1 << 20, &SizeRules::default()));
    }
}
