//! The largest single request that would succeed now (`gpupool_largest_allocatable`; RMM's
//! `available_device_memory`, rapidsai/rmm#813; PyTorch has no equivalent): PyTorch's malloc
//! replayed on a copy of one stream's blocks, never on the allocator itself.
//!
//! A request of `R` bytes (rounded) on a stream succeeds when one of the attempts of
//! `DeviceAllocator::malloc` does, each on the state the previous ones leave:
//! 1. now, after `process_events` (blocks whose events have completed are free): the best
//!    cached fit of the stream's pool (`get_free_block`, with the `max_split_size` rules),
//!    else new memory from the driver: a segment of `get_allocation_size(R)` bytes, or the
//!    pages an expandable segment must map for it (`try_allocate_expandable_block`), within
//!    what the driver has free, the memory fraction and the default pools' limit allow
//!    (`caching::budget`, charged before the driver is asked);
//! 2. after the device synchronisation that blocks freed with `free_after_device_sync` await
//!    (only when some do): the same, with those blocks free;
//! 3. after release-and-retry (`release_cached_blocks`): every event waited for, every wholly
//!    free segment of every stream given back and every wholly free page of expandable
//!    segments unmapped: the same, with what was given back added to the driver's free memory
//!    and taken off the reserved bytes that the memory fraction counts, and the default pools'
//!    part off those their limit counts; the handles a failed unmap left to the driver
//!    (orphans, counted nowhere) are released too, free memory within the fraction. A request
//!    the limit refuses at every page size takes the limit's path instead (`budget::device`:
//!    the same waits, the default pools' cache released alone): that serves what this
//!    attempt does, the limit being the same, and where the device refuses it the device's
//!    path follows.
//!
//! The detours on the way (`release_available_cached_blocks` with `max_split_size`,
//! `garbage_collection_threshold`, the high-water rule of expandable segments) only give
//! back part of what step 3 gives back, so they add no request that step 3 would not serve;
//! out-of-memory observers are not modelled (what they free is not counted).
//!
//! Success is not monotone in the size: with 15 MiB free on the driver and nothing cached,
//! 12 MiB succeeds (a 12 MiB segment) and 5 MiB does not (requests from 1 to 10 MiB take a 20
//! MiB segment, PyTorch's `kLargeBuffer`). So the search does not bisect: the largest size
//! that succeeds lies at one of a few bounds (a cached block's size, the room left for new
//! memory, the size classes' edges), each tried from the largest down.
//!
//! Every part is here, in reading order: this file, the copy of a stream (`ShardModel`), the
//! attempts replayed on it and the search; `shard.rs`: a shard's blocks copied under its lock;
//! `device.rs`: the situation read from the device (its shards one at a time, the driver's
//! free memory, the memory fraction, captures); `allocator.rs`:
//! `Allocator::largest_allocatable`, over every device; `tests.rs`: the search on copies made
//! by hand. The search imports nothing of the allocator but the size rules and the layout of
//! expandable segments.

mod allocator;
mod device;
mod shard;
#[cfg(test)]
mod tests;

use super::rules::{self, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, PoolKind, ROUND_LARGE, SMALL_SIZE, SizeRules};
use super::shard::ExpandablePolicy;

/// What a block of the copy is (the allocator's `BlockState`, as the attempts see it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// In its pool's free list (or returned to it by `process_events` before the first attempt).
    Free,
    /// Freed, awaiting `record_stream` events that have not completed: free once release-and-retry
    /// has waited for them.
    Events,
    /// Freed with `free_after_device_sync`: free after the device synchronisation.
    Sync,
    /// Allocated.
    Used,
    /// Address space of an expandable segment with nothing mapped.
    Unmapped,
}

/// One segment of the copy. Sizes in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SegModel {
    /// Its address, for the order of [`ShardModel::segs`].
    pub base: u64,
    pub pool: PoolKind,
    /// An expandable segment's page size; `None` for an ordinary segment.
    pub page: Option<usize>,
    /// Whether its free memory goes back to the driver (not while a CUDA graph keeps it, nor
    /// while its pool sleeps or a sleep copies it).
    pub releasable: bool,
    /// Its blocks in address order: (bytes, kind).
    pub blocks: Vec<(usize, Kind)>,
}

/// One stream's segments, in address order (`find_expandable_block` takes the first fit by
/// address).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ShardModel {
    pub segs: Vec<SegModel>,
}

impl ShardModel {
    /// A copy made from segments in any order whose blocks may have free neighbours: in
    /// address order, merged. Separate from the copying so that a shard's lock is held for
    /// the copying only.
    pub fn settled(mut self) -> ShardModel {
        self.segs.sort_unstable_by_key(|s| s.base);
        self.segs.iter_mut().for_each(|seg| merge(&mut seg.blocks, Kind::Free));
        self
    }

    /// The copy with the blocks of kind `to_free` free, each merged with its free neighbours
    /// (`free_block`, `try_merge_blocks`).
    pub fn freeing(&self, to_free: &[Kind]) -> ShardModel {
        let mut out = self.clone();
        for seg in &mut out.segs {
            for b in &mut seg.blocks {
                if to_free.contains(&b.1) {
                    b.1 = Kind::Free;
                }
            }
            merge(&mut seg.blocks, Kind::Free);
        }
        out
    }

    /// PyTorch `release_blocks` on the copy (its events already waited for): every wholly free
    /// ordinary segment goes back, every whole page inside a free block of an expandable
    /// segment is unmapped, and a range left with nothing mapped is given back. Returns the
    /// copy after it and the bytes given back to the driver.
    pub fn released(&self) -> (ShardModel, usize) {
        let mut freed = 0;
        let mut segs = Vec::with_capacity(self.segs.len());
        for seg in &self.segs {
            let Some(page) = seg.page else {
                if seg.releasable && matches!(seg.blocks[..], [(_, Kind::Free)]) {
                    freed += seg.blocks[0].0;
                } else {
                    segs.push(seg.clone());
                }
                continue;
            };
            if !seg.releasable {
                // Its free pages stay mapped (a CUDA graph's, see `unmap_free_pages`), or are
                // unmapped already and kept for a wake (a sleeping pool's).
                segs.push(seg.clone());
                continue;
            }
            let mut blocks = Vec::with_capacity(seg.blocks.len() + 2);
            let mut at = 0usize;
            for &(size, kind) in &seg.blocks {
                let (lo, hi) = (at.next_multiple_of(page), (at + size) / page * page);
                if kind == Kind::Free && hi > lo {
                    blocks.extend([(lo - at, Kind::Free), (hi - lo, Kind::Unmapped), (at + size - hi, Kind::Free)]);
                    freed += hi - lo;
                } else {
                    blocks.push((size, kind));
                }
                at += size;
            }
            blocks.retain(|b| b.0 > 0);
            merge(&mut blocks, Kind::Unmapped);
            if blocks.iter().any(|b| b.1 != Kind::Unmapped) {
                segs.push(SegModel { blocks, ..seg.clone() });
            }
        }
        (ShardModel { segs }, freed)
    }

    /// The bytes release-and-retry gives back to the driver from this stream.
    pub fn release_bytes(&self) -> usize {
        self.freeing(&[Kind::Events, Kind::Sync]).released().1
    }

    /// Sizes of the free blocks of each pool, ascending: `[small, large]`.
    fn free_sizes(&self) -> [Vec<usize>; 2] {
        let mut free = [Vec::new(), Vec::new()];
        for seg in &self.segs {
            let sizes = seg.blocks.iter().filter(|b| b.1 == Kind::Free).map(|b| b.0);
            free[seg.pool as usize].extend(sizes);
        }
        free.iter_mut().for_each(|f| f.sort_unstable());
        free
    }

    /// Each run of free and unmapped blocks of `pool`'s expandable segments of `page`-byte
    /// pages that `find_expandable_block` considers, in its order: the blocks from the free
    /// block before an unmapped one (if any) on while free or unmapped.
    fn runs(&self, pool: PoolKind, page: usize) -> impl Iterator<Item = &[(usize, Kind)]> {
        self.segs.iter().filter(move |s| s.page == Some(page) && s.pool == pool).flat_map(|s| {
            let b = &s.blocks;
            let usable = |k: Kind| matches!(k, Kind::Free | Kind::Unmapped);
            (0..b.len()).filter(|&j| b[j].1 == Kind::Unmapped).map(move |j| {
                let start = if j > 0 && b[j - 1].1 == Kind::Free { j - 1 } else { j };
                let len = b[start..].iter().take_while(|x| usable(x.1)).count();
                &b[start..start + len]
            })
        })
    }
}

/// Merges neighbouring blocks of `kind` into one.
fn merge(blocks: &mut Vec<(usize, Kind)>, kind: Kind) {
    let mut out: Vec<(usize, Kind)> = Vec::with_capacity(blocks.len());
    for &b in blocks.iter() {
        match out.last_mut() {
            Some(last) if last.1 == kind && b.1 == kind => last.0 += b.0,
            _ => out.push(b),
        }
    }
    *blocks = out;
}

/// What the search needs to know of a device and one of its streams.
#[derive(Clone, Debug)]
pub(crate) struct Situation {
    pub rules: SizeRules,
    /// How expandable segments are laid out (the page a request grows); `None`: ordinary
    /// segments.
    pub pages: Option<ExpandablePolicy>,
    /// The stream's blocks as the first attempt finds them (after `process_events`).
    pub now: ShardModel,
    /// Bytes new memory may take now: the driver's free memory (`cuMemGetInfo`), or less
    /// where the memory fraction leaves less.
    pub room: usize,
    /// The device's page pool: (page bytes, bytes held) for each page size. A growth maps held
    /// handles of its page size before it takes new memory; release-and-retry gives every
    /// held handle back to the driver.
    pub held: Vec<(usize, usize)>,
    /// Bytes release-and-retry gives back from the device's other streams and private pools.
    pub others_release: usize,
    /// Bytes the default pools' limit (`gpupool_pool_set_limit` with pool 0) lets them
    /// reserve more now; `usize::MAX` without one. A growth of the default pools is charged
    /// there first: one past it is refused whatever the driver has free.
    pub budget: usize,
    /// The room release-and-retry adds by releasing the handles the device's expandable
    /// segments hold for no page (orphans, counted in no statistic, nor by the memory
    /// fraction, so within what the fraction leaves).
    pub orphans: usize,
    /// Of `others_release`, the bytes of the default pools (other streams' shards of pool 0):
    /// what the limit stops counting once they are given back, with the stream's own.
    pub others_release_default: usize,
    /// Whether a miss may take new memory (not while the stream captures a CUDA graph).
    pub grow: bool,
    /// Whether release-and-retry may run (not while a capture may be under way).
    pub release: bool,
    /// Whether blocks of the device await a device synchronisation.
    pub deferred: bool,
}

/// One attempt: the stream's blocks, the room new memory may take, the held pages a growth
/// maps first, (page bytes, bytes held), and the bytes the default pools' limit lets a growth
/// take (held pages mapped included: the limit counts every page mapped).
struct Attempt {
    shard: ShardModel,
    free: [Vec<usize>; 2],
    room: usize,
    held: Vec<(usize, usize)>,
    budget: usize,
}

impl Attempt {
    fn new(shard: ShardModel, room: usize, held: Vec<(usize, usize)>, budget: usize) -> Attempt {
        Attempt { free: shard.free_sizes(), shard, room, held, budget }
    }

    /// The bytes a growth in `page`-byte pages may map: new memory and the held pages of that
    /// size, within the default pools' limit.
    fn room_for(&self, page: usize) -> usize {
        self.held.iter().filter(|h| h.0 == page).fold(self.room, |r, h| r.saturating_add(h.1)).min(self.budget)
    }

    /// The bytes a new ordinary segment may take: new memory within the limit.
    fn segment_room(&self) -> usize {
        self.room.min(self.budget)
    }

    /// Whether this attempt serves a request of `rounded` bytes (a size `round_size` keeps).
    fn serves(&self, rounded: usize, s: &Situation) -> bool {
        let pool = rules::pool_for(rounded);
        let free = &self.free[pool as usize];
        // PyTorch `get_free_block`: the best fit only; refused by the rules, the cache misses.
        if let Some(&block) = free.get(free.partition_point(|&b| b < rounded))
            && rules::fits_oversize_rules(block, rounded, &s.rules)
        {
            return true;
        }
        if !s.grow {
            return false;
        }
        match s.pages {
            // A growth the device has no room for tries the ladder's smaller pages.
            Some(p) => {
                p.pages_tried(pool, rounded).any(|page| self.pages_to_map(pool, page, rounded) <= self.room_for(page))
            }
            None => rules::segment_size(rounded, &s.rules).is_some_and(|seg| seg <= self.segment_room()),
        }
    }

    /// Bytes `try_allocate_expandable_block` maps for `rounded` bytes in ranges of `page`-byte
    /// pages: in the first run that holds them, the unmapped blocks' pages from its start
    /// until the run holds `rounded` (`map_block`); in a new range if none does.
    fn pages_to_map(&self, pool: PoolKind, page: usize, rounded: usize) -> usize {
        for run in self.shard.runs(pool, page) {
            if run.iter().map(|b| b.0).sum::<usize>() < rounded {
                continue;
            }
            let (mut have, mut bytes) = (0, 0);
            for &(size, kind) in run {
                if have >= rounded {
                    break;
                }
                if kind == Kind::Unmapped {
                    let map = (rounded - have).next_multiple_of(page).min(size);
                    bytes += map;
                    have += map;
                } else {
                    have += size;
                }
            }
            return bytes;
        }
        rounded.next_multiple_of(page)
    }

    /// Sizes past which this attempt's answer changes: the free blocks, the room for new
    /// memory, and for expandable segments each run's length and how far the room takes it.
    fn bounds(&self, s: &Situation, out: &mut Vec<usize>) {
        for free in &self.free {
            // Ascending: each size once.
            out.extend(free.iter().enumerate().filter(|&(i, b)| i == 0 || free[i - 1] != *b).map(|(_, &b)| b));
        }
        if !s.grow {
            return;
        }
        let room = self.segment_room();
        out.extend([room, room / ROUND_LARGE * ROUND_LARGE]);
        let Some(p) = s.pages else { return };
        for (pool, page) in p.page_sizes() {
            let room = self.room_for(page);
            out.push(room / page * page);
            for run in self.shard.runs(pool, page) {
                let (mut reach, mut left) = (0, room);
                for &(size, kind) in run {
                    let add = if kind == Kind::Unmapped { size.min(left / page * page) } else { size };
                    reach += add;
                    if kind == Kind::Unmapped {
                        left -= add;
                        if add < size {
                            break;
                        }
                    }
                }
                out.extend([reach, run.iter().map(|b| b.0).sum()]);
            }
        }
    }
}

/// The largest size `round_size` keeps that is at most `x` (the largest request whose block
/// is at most `x` bytes), if any.
pub(crate) fn largest_rounded_within(x: usize, rules: &SizeRules) -> Option<usize> {
    if x < MIN_BLOCK_SIZE {
        return None;
    }
    if rules.roundup_power2_divisions.is_none() {
        return Some(x / MIN_BLOCK_SIZE * MIN_BLOCK_SIZE);
    }
    // `round_size` never decreases: bisect for the last size that rounds to at most `x` (a
    // size `round_size` keeps, since its rounding is at most `x` too).
    let within = |s: usize| rules::round_size(s, rules).is_some_and(|r| r <= x);
    let (mut lo, mut hi) = (MIN_BLOCK_SIZE, x);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if within(mid) { lo = mid } else { hi = mid - 1 }
    }
    Some(lo)
}

/// The largest request in bytes that one of malloc's attempts serves in situation `s`; 0
/// when none does (every request fails, but a request of 0 bytes).
pub(crate) fn largest(s: &Situation) -> usize {
    let mut attempts = vec![Attempt::new(s.now.clone(), s.room, s.held.clone(), s.budget)];
    if s.release && s.grow {
        if s.deferred {
            attempts.push(Attempt::new(s.now.freeing(&[Kind::Sync]), s.room, s.held.clone(), s.budget));
        }
        // Release-and-retry unmaps the free pages into the pool and gives every held handle back;
        // the limit stops counting what the default pools gave back.
        let (after, freed) = s.now.freeing(&[Kind::Events, Kind::Sync]).released();
        let held: usize = s.held.iter().map(|h| h.1).sum();
        let room = s.room.saturating_add(s.others_release).saturating_add(freed).saturating_add(held);
        let room = room.saturating_add(s.orphans);
        let budget = s.budget.saturating_add(freed).saturating_add(s.others_release_default);
        attempts.push(Attempt::new(after, room, Vec::new(), budget));
    }
    let mut bounds = Vec::new();
    for a in &attempts {
        a.bounds(s, &mut bounds);
    }
    // Each bound, and the edges where the rules change (the small pool's largest size, the
    // last size of `large_segment_size` segments, the last under `max_split_size`, the last
    // before each change of a growth's page) below the
    // largest bound: a bound cut to an edge is the edge. `largest_rounded_within` never
    // decreases, so the sizes stay in order.
    let top = bounds.iter().copied().max().unwrap_or(0);
    // With large pages, requests from each of the page edges on grow other ranges than those
    // below it.
    let pages = s.pages.iter().flat_map(|p| p.page_edges()).map(|e| e - 1);
    let edges = [SMALL_SIZE, MIN_LARGE_ALLOC - 1, s.rules.max_split_size - 1].into_iter().chain(pages);
    bounds.extend(edges.filter(|&e| e <= top));
    bounds.sort_unstable_by(|a, b| b.cmp(a));
    bounds.dedup();
    let mut sizes: Vec<usize> = bounds.into_iter().filter_map(|x| largest_rounded_within(x, &s.rules)).collect();
    sizes.dedup();
    sizes.into_iter().find(|&r| attempts.iter().any(|a| a.serves(r, s))).unwrap_or(0)
}
