//! Size classes of pinned blocks: what a request is rounded up to, and which cached blocks may
//! serve it.
//!
//! PyTorch (`CachingHostAllocatorImpl::allocate` in `aten/src/ATen/core/CachingHostAllocator.h`)
//! rounds every request up to a power of two (`c10::llvm::PowerOf2Ceil`) and keeps one free list
//! per power (`size_index`, `Log2_64_Ceil`): a request of 20.4 GiB pins 32 GiB (1.57x), one of
//! 1.2 GiB pins 2 GiB (1.7x). gpupool keeps that rule up to 1 MiB, where it is cheap, and above
//! it divides each power of two into [`DIVISIONS`] equal steps (the rule of PyTorch's
//! `roundup_power2_divisions` for device memory, with 32 divisions): a request of more than
//! 1 MiB pins less than 1/32 (3.125%) more than it asked for, and each step has its own free list.
//! A cached block may also serve a smaller request of a lower class if it holds at most
//! [`SLACK_DIVISOR`]'s share (5%) more than that request asks for ([`serves`]): a freed block is
//! reused by requests of about its size, and no request is handed more than 1.05 times its size
//! from 1 MiB up.

/// Up to 2^20 bytes (1 MiB), requests round up to a power of two, as in PyTorch; the class of
/// 2^k is k there.
const SMALL_LOG2: u32 = 20;
/// The largest request rounded up to a power of two.
pub(super) const SMALL_MAX: usize = 1 << SMALL_LOG2;
/// Steps per power of two above 1 MiB, as log2: 32 steps.
const DIVISIONS_LOG2: u32 = 5;
/// Steps per power of two above 1 MiB.
pub(super) const DIVISIONS: usize = 1 << DIVISIONS_LOG2;
/// The largest request, and the largest class: 2^63 bytes (PyTorch `MAX_SIZE_INDEX` 64).
pub(super) const MAX_SIZE: usize = 1 << 63;
/// Classes: one per power of two up to 1 MiB (2^0 .. 2^20), then [`DIVISIONS`] per power up to
/// 2^63 (the class of 2^k, k >= 20, is `20 + (k - 20) * 32`).
pub(super) const CLASSES: usize = SMALL_LOG2 as usize + (63 - SMALL_LOG2 as usize) * DIVISIONS + 1;
/// A cached block of a larger class serves a request when it exceeds it by at most
/// `request / SLACK_DIVISOR` bytes: 5%.
pub(super) const SLACK_DIVISOR: usize = 20;

/// The class of a request of `size` bytes, 1 to [`SMALL_MAX`]: the base-2 logarithm of `size`
/// rounded up (a bit scan: `2 size - 1` has its top bit where the power of two above `size`
/// has its). The hit path's rounding, cheaper than PyTorch's `PowerOf2Ceil`.
#[inline(always)]
pub(super) fn small_class(size: usize) -> usize {
    debug_assert!((1..=SMALL_MAX).contains(&size));
    (2 * size - 1).ilog2() as usize
}

/// The class of a request of `size` bytes, more than [`SMALL_MAX`]: `size` in `(2^k, 2^(k+1)]`
/// rounds up to a multiple of `2^k / 32`. `None` past 2^63 bytes.
#[inline(always)]
pub(super) fn large_class(size: usize) -> Option<usize> {
    debug_assert!(size > SMALL_MAX);
    if size > MAX_SIZE {
        return None;
    }
    let k = usize::BITS - 1 - (size - 1).leading_zeros();
    let steps = ((size - 1) >> (k - DIVISIONS_LOG2)) + 1; // in (32, 64]
    Some(SMALL_LOG2 as usize + (k - SMALL_LOG2) as usize * DIVISIONS + (steps - DIVISIONS))
}

/// The class and the rounded size of a request of `size` bytes (at least 1); `None` past 2^63
/// bytes.
pub(super) fn round(size: usize) -> Option<(usize, usize)> {
    let class = if size <= SMALL_MAX { small_class(size) } else { large_class(size)? };
    Some((class, class_size(class)))
}

/// The size in bytes of the blocks of `class`.
pub(super) fn class_size(class: usize) -> usize {
    let small = SMALL_LOG2 as usize;
    if class <= small {
        return 1 << class;
    }
    let k = small + (class - small) / DIVISIONS;
    let step = (class - small) % DIVISIONS;
    (DIVISIONS + step) << (k - DIVISIONS_LOG2 as usize)
}

/// Whether a cached block of `block_class` (`block_size` bytes) may serve a request of `size`
/// bytes whose class is `class`: its own class, or a larger one at most 5% over `size`.
#[inline]
pub(super) fn serves(block_class: usize, block_size: usize, class: usize, size: usize) -> bool {
    block_class == class || (block_class > class && block_size - size <= size / SLACK_DIVISOR)
}

/// The largest class that may serve a request of `size` bytes of class `class` ([`serves`]).
pub(super) fn widest(class: usize, size: usize) -> usize {
    let mut last = class;
    while last + 1 < CLASSES && class_size(last + 1) - size <= size / SLACK_DIVISOR {
        last += 1;
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_increasing_and_round_trip() {
        let mut prev = 0;
        for class in 0..CLASSES {
            let s = class_size(class);
            assert!(s > prev, "class {class}");
            assert_eq!(round(s), Some((class, s)), "class {class}");
            if class > 0 {
                let below = class - usize::from(s - 1 == prev);
                assert_eq!(round(s - 1).map(|r| r.0), Some(below), "below class {class}");
            }
            prev = s;
        }
        assert_eq!(class_size(CLASSES - 1), MAX_SIZE);
        assert_eq!(round(MAX_SIZE + 1), None);
        assert_eq!(round(usize::MAX), None);
    }

    #[test]
    fn from_1_mib_a_request_is_rounded_by_less_than_a_32nd() {
        for k in 20..63 {
            for probe in [1usize, 2, 3, 1 << (k - 6), (1 << (k - 5)) - 1, (1 << (k - 5)) + 1, (1 << k) - 1] {
                let size = (1usize << k) + probe;
                let (class, rounded) = round(size).unwrap();
                assert!(rounded >= size && (rounded - size) * DIVISIONS < size, "{size}");
                assert!(class_size(class) == rounded);
                let last = widest(class, size);
                assert!(class_size(last) - size <= size / SLACK_DIVISOR, "{size}");
                assert!(last == CLASSES - 1 || class_size(last + 1) - size > size / SLACK_DIVISOR);
            }
        }
        // Below 1 MiB nothing is wider than its power of two.
        assert_eq!(widest(10, 600), 10);
        assert_eq!(widest(20, 600 << 10), 20);
    }
}
