//! The set of block sizes a pool holds free blocks of, for the best fit's first step: the
//! smallest size at or above a request (PyTorch's `BlockPool::blocks.lower_bound`, whose set
//! orders by size first).
//!
//! Sizes up to [`BITMAP_MAX`] that are multiples of [`UNIT`] (every block of the small pool,
//! and the large pool's up to 2 MiB: PyTorch rounds every size to 512 bytes, `kMinBlockSize`)
//! are bits of a bitmap with a summary word, so the search is two bit scans; others go to a
//! B-tree. A set of sizes in a B-tree alone cost the random working set about 370
//! instructions an allocation (callgrind, 16 live blocks of 4 KiB to 1 MiB): the search passed
//! bins that had emptied, and dropped and made them again.

use std::collections::BTreeSet;

/// The bitmap's granularity in bytes: PyTorch's `kMinBlockSize`.
const UNIT: usize = 512;
/// The largest size the bitmap holds: a small segment (PyTorch `kSmallBuffer`, 2 MiB).
pub(crate) const BITMAP_MAX: usize = 2 << 20;
const WORDS: usize = BITMAP_MAX / UNIT / 64;
const _: () = assert!(WORDS == 64, "the summary is one word");

/// A set of sizes in bytes.
#[derive(Debug, Clone)]
pub(crate) struct SizeSet {
    /// Bit `i` of word `w`: size `(64 w + i + 1) * UNIT` is in the set.
    words: [u64; WORDS],
    /// Bit `w`: word `w` is not zero.
    summary: u64,
    /// The sizes the bitmap does not hold.
    other: BTreeSet<usize>,
}

impl Default for SizeSet {
    fn default() -> Self {
        SizeSet { words: [0; WORDS], summary: 0, other: BTreeSet::new() }
    }
}

/// The bit of `size`, if the bitmap holds it.
#[inline(always)]
fn bit_of(size: usize) -> Option<usize> {
    (size > 0 && size <= BITMAP_MAX && size % UNIT == 0).then(|| size / UNIT - 1)
}

/// The size of bit `i`.
#[inline(always)]
fn size_of(i: usize) -> usize {
    (i + 1) * UNIT
}

impl SizeSet {
    /// Adds `size` (present already: no change).
    #[inline]
    pub fn insert(&mut self, size: usize) {
        match bit_of(size) {
            Some(i) => {
                self.words[i / 64] |= 1 << (i % 64);
                self.summary |= 1 << (i / 64);
            }
            None => {
                self.other.insert(size);
            }
        }
    }

    /// Removes `size` (absent: no change).
    #[inline]
    pub fn remove(&mut self, size: usize) {
        match bit_of(size) {
            Some(i) => {
                let w = &mut self.words[i / 64];
                *w &= !(1 << (i % 64));
                if *w == 0 {
                    self.summary &= !(1 << (i / 64));
                }
            }
            None => {
                self.other.remove(&size);
            }
        }
    }

    /// The smallest size in the set of at least `size` bytes.
    #[inline]
    pub fn first_at_or_above(&self, size: usize) -> Option<usize> {
        let in_bits = if size <= BITMAP_MAX { self.first_bit_from(size.div_ceil(UNIT).max(1) - 1) } else { None };
        // The B-tree is consulted while it holds something: empty, as it is for the small
        // pool, it costs a length check.
        let in_tree = if self.other.is_empty() { None } else { self.other.range(size..).next().copied() };
        match (in_bits, in_tree) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The size of the first bit at or above bit `i`.
    #[inline(always)]
    fn first_bit_from(&self, i: usize) -> Option<usize> {
        let w = i / 64;
        let here = self.words[w] & (!0u64 << (i % 64));
        if here != 0 {
            return Some(size_of(w * 64 + here.trailing_zeros() as usize));
        }
        let above = if w + 1 < WORDS { self.summary & (!0u64 << (w + 1)) } else { 0 };
        if above == 0 {
            return None;
        }
        let w = above.trailing_zeros() as usize;
        Some(size_of(w * 64 + self.words[w].trailing_zeros() as usize))
    }

    /// The largest size in the set.
    pub fn last(&self) -> Option<usize> {
        if let Some(&s) = self.other.last()
            && s > BITMAP_MAX
        {
            return Some(s);
        }
        let in_bits = (self.summary != 0).then(|| {
            let w = 63 - self.summary.leading_zeros() as usize;
            size_of(w * 64 + 63 - self.words[w].leading_zeros() as usize)
        });
        in_bits.max(self.other.last().copied())
    }

    /// Every size, ascending.
    pub fn ascending(&self) -> Vec<usize> {
        let mut sizes: Vec<usize> = (0..WORDS)
            .filter(|&w| self.summary & (1 << w) != 0)
            .flat_map(|w| {
                let word = self.words[w];
                (0..64).filter(move |b| word & (1 << b) != 0).map(move |b| size_of(w * 64 + b))
            })
            .collect();
        sizes.extend(self.other.iter().copied());
        sizes.sort_unstable();
        sizes
    }

    /// Whether the summary word agrees with the bitmap (the consistency check's).
    pub fn summary_consistent(&self) -> bool {
        (0..WORDS).all(|w| (self.summary & (1 << w) != 0) == (self.words[w] != 0))
            && self.other.iter().all(|&s| bit_of(s).is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same questions asked of a plain B-tree.
    fn agrees(set: &SizeSet, model: &BTreeSet<usize>) {
        assert!(set.summary_consistent());
        assert_eq!(set.ascending(), model.iter().copied().collect::<Vec<_>>());
        assert_eq!(set.last(), model.last().copied());
        for probe in
            [0, 1, 511, 512, 513, 4096, 65_536, 1 << 20, BITMAP_MAX - 512, BITMAP_MAX, BITMAP_MAX + 1, 3 << 20, 1 << 40]
        {
            assert_eq!(set.first_at_or_above(probe), model.range(probe..).next().copied(), "at or above {probe}");
        }
        for &s in model {
            assert_eq!(set.first_at_or_above(s), Some(s));
            assert_eq!(set.first_at_or_above(s + 1), model.range(s + 1..).next().copied(), "just above {s}");
        }
    }

    #[test]
    fn answers_as_a_b_tree_of_the_same_sizes() {
        let mut set = SizeSet::default();
        let mut model = BTreeSet::new();
        // Every word edge, the bitmap's ends, odd sizes below and sizes above its range.
        let sizes = [512, 512 * 64, 512 * 65, 512 * 4095, BITMAP_MAX, BITMAP_MAX + 512, 777, 3 << 20, 1 << 33, 1536];
        for &s in &sizes {
            set.insert(s);
            model.insert(s);
            agrees(&set, &model);
        }
        set.insert(512);
        agrees(&set, &model);
        for &s in sizes.iter().rev() {
            set.remove(s);
            model.remove(&s);
            agrees(&set, &model);
        }
        set.remove(512);
        assert_eq!((set.first_at_or_above(0), set.last(), set.summary), (None, None, 0));
    }

    #[test]
    fn random_sizes_agree_with_a_b_tree() {
        let mut set = SizeSet::default();
        let mut model = BTreeSet::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let size =
                if x % 5 == 0 { (x >> 8) as usize % (8 << 20) + 1 } else { 512 * (1 + (x >> 8) as usize % 4200) };
            if x % 3 == 0 {
                set.remove(size);
                model.remove(&size);
            } else {
                set.insert(size);
                model.insert(size);
            }
            let probe = (x >> 20) as usize % (5 << 20);
            assert_eq!(set.first_at_or_above(probe), model.range(probe..).next().copied(), "at or above {probe}");
        }
        agrees(&set, &model);
    }
}
