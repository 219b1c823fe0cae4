//! The operations of the random sequences (`Op`) and their strategies, and what both runners
//! (`run`, `faults::run_with_faults`) check with: the statistics' currents and peaks in a
//! fixed order, cookies stamped into live blocks, and each case's configuration.

use gpupool::config::Config;
use gpupool::stats::{DeviceStats, Stat};
use proptest::prelude::*;

#[derive(Clone, Debug)]
pub(crate) enum Op {
    Malloc {
        size: usize,
        stream: usize,
    },
    Free {
        pick: usize,
    },
    FreeAfterSync {
        pick: usize,
    },
    ReleaseDeferred,
    RecordStream {
        pick: usize,
        stream: usize,
    },
    Hold {
        stream: usize,
    },
    Release {
        stream: usize,
    },
    EmptyCache,
    ResetPeaks,
    /// Routes `stream` to a pool and begins capturing it (global or relaxed mode).
    Capture {
        stream: usize,
        pool: usize,
        global: bool,
    },
    /// Ends the capture under way, and its route.
    EndCapture,
    /// Routes the thread's allocations to a pool (`use_mem_pool`).
    RouteThread {
        pool: usize,
    },
    EndRoutes {
        pool: usize,
    },
    /// Releases a pool; a new one takes its place.
    ReleasePool {
        pool: usize,
    },
    /// Sets the limit of the default pools (0) or of a private pool (1, 2) in MiB; `None`
    /// removes it (`gpupool_pool_set_limit`, issue 43).
    SetLimit {
        pool: usize,
        mib: Option<u64>,
    },
}

pub(crate) fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..4096,
        3 => 4096usize..(1 << 20),
        2 => (1usize << 20)..(12 << 20),
        1 => (12usize << 20)..(48 << 20),
    ]
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (size(), 0usize..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => any::<usize>().prop_map(|pick| Op::FreeAfterSync { pick }),
        1 => Just(Op::ReleaseDeferred),
        2 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0usize..3).prop_map(|stream| Op::Hold { stream }),
        1 => (0usize..3).prop_map(|stream| Op::Release { stream }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeaks),
        1 => (0usize..3, 0usize..2, any::<bool>()).prop_map(|(stream, pool, global)| Op::Capture { stream, pool, global }),
        1 => Just(Op::EndCapture),
        1 => (0usize..2).prop_map(|pool| Op::RouteThread { pool }),
        1 => (0usize..2).prop_map(|pool| Op::EndRoutes { pool }),
        1 => (0usize..2).prop_map(|pool| Op::ReleasePool { pool }),
        1 => (0usize..3, proptest::option::of(0u64..96)).prop_map(|(pool, mib)| Op::SetLimit { pool, mib }),
    ]
}

/// One field (`current` or `peak`) of every statistic that has a peak, in a fixed order.
pub(crate) fn field(s: &DeviceStats, pick: fn(&Stat) -> i64) -> Vec<i64> {
    let arrays = [
        s.allocation,
        s.segment,
        s.active,
        s.inactive_split,
        s.allocated_bytes,
        s.reserved_bytes,
        s.active_bytes,
        s.inactive_split_bytes,
        s.requested_bytes,
    ];
    let mut v: Vec<i64> =
        arrays.iter().flat_map(|a| [pick(&a.all), pick(&a.small_pool), pick(&a.large_pool)]).collect();
    v.extend([pick(&s.oversize_allocations), pick(&s.oversize_segments)]);
    v
}

pub(crate) fn currents(s: &DeviceStats) -> Vec<i64> {
    field(s, |x| x.current)
}

pub(crate) fn peaks(s: &DeviceStats) -> Vec<i64> {
    field(s, |x| x.peak)
}

/// Stamps a block's first and last bytes with a cookie (the simulated device's memory is host
/// memory), so overlapping live blocks show as a clobbered cookie.
pub(crate) fn stamp(ptr: u64, size: usize, cookie: u64) {
    let p = ptr as *mut u8;
    // SAFETY: `ptr` is a live block of at least `size` bytes of mapped host memory.
    unsafe {
        p.copy_from_nonoverlapping(cookie.to_le_bytes().as_ptr(), size.min(8));
        if size >= 16 {
            p.add(size - 8).copy_from_nonoverlapping(cookie.to_le_bytes().as_ptr(), 8);
        }
    }
}

pub(crate) fn stamped(ptr: u64, size: usize, cookie: u64) -> bool {
    let mut head = [0u8; 8];
    let mut tail = [0u8; 8];
    let n = size.min(8);
    // SAFETY: as in `stamp`.
    unsafe {
        (ptr as *const u8).copy_to_nonoverlapping(head.as_mut_ptr(), n);
        (ptr as *const u8).add(size - n).copy_to_nonoverlapping(tail.as_mut_ptr(), n);
    }
    head[..n] == cookie.to_le_bytes()[..n] && (size < 16 || tail == cookie.to_le_bytes())
}

/// The configuration of a case of `n` operations: gpupool's own options crossed, each on in
/// half the cases (the high-water rule for expandable segments; releasing unused streams'
/// cache before growing past the mark; large requests in ranges of 20 MiB pages).
pub(crate) fn case_config(n: usize, max_split_size: usize, expandable_segments: bool) -> Config {
    Config {
        max_split_size,
        expandable_segments,
        expandable_reclaim: n % 2 == 0,
        release_unused_streams: n % 4 < 2,
        expandable_large_pages: n % 8 < 4,
        ..Config::default()
    }
}
