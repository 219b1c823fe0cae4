//! PyTorch's `garbage_collection_threshold` on the simulated device: with a memory fraction
//! set, a request that finds no cached block while reserved bytes are over the threshold first
//! releases the oldest whole free segments of the large pool.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;

const SEG: usize = 100 * MIB;

/// Three 100 MiB segments freed in order, then a 150 MiB request that none of them fits:
/// with a limit of 512 MiB and a threshold of 0.5 (256 MiB), 300 MiB reserved is 44 MiB over,
/// so the oldest segment goes back to the driver first, and only it.
#[test]
fn the_oldest_whole_free_segment_is_released_before_the_device_grows() {
    for threshold in [0.5, 0.0] {
        let config =
            Config { garbage_collection_threshold: threshold, per_process_memory_fraction: 0.5, ..Config::pytorch() };
        let (a, drv) = sim_with(1, 1024 * MIB, config);
        let blocks: Vec<u64> = (0..3).map(|_| a.malloc(SEG, 0, 0x10).unwrap()).collect();
        for &b in &blocks {
            a.free(b).unwrap();
        }
        let big = a.malloc(150 * MIB, 0, 0x10).unwrap();
        let s = a.stats(0).unwrap();
        assert_eq!(s.num_alloc_retries, 0, "no out-of-memory path");
        if threshold > 0.0 {
            assert_eq!(s.reserved_bytes.all.current, (2 * SEG + 150 * MIB) as i64);
            assert_eq!(drv.live_allocations(), 3);
            // The oldest (first freed) is gone: the two younger serve 100 MiB requests.
            let mut again = [a.malloc(SEG, 0, 0x10).unwrap(), a.malloc(SEG, 0, 0x10).unwrap()];
            again.sort();
            let mut younger = [blocks[1], blocks[2]];
            younger.sort();
            assert_eq!(again, younger);
            assert_eq!(drv.live_allocations(), 3, "served from the cache");
        } else {
            assert_eq!(s.reserved_bytes.all.current, (3 * SEG + 150 * MIB) as i64);
            assert_eq!(drv.live_allocations(), 4);
        }
        check(&a);
        a.free(big).unwrap();
    }
}

/// Without a memory fraction there is no limit to take a share of: nothing is collected, as
/// in PyTorch (`set_fraction` is false).
#[test]
fn without_a_memory_fraction_nothing_is_collected() {
    let config = Config { garbage_collection_threshold: 0.1, ..Config::pytorch() };
    let (a, drv) = sim_with(1, 1024 * MIB, config);
    let b = a.malloc(SEG, 0, 0x10).unwrap();
    a.free(b).unwrap();
    let big = a.malloc(150 * MIB, 0, 0x10).unwrap();
    assert_eq!(drv.live_allocations(), 2);
    a.free(big).unwrap();
    check(&a);
}

/// Segments cached by other streams are collected too, and split segments are not (they hold
/// live blocks, or are partly free: PyTorch frees only `!is_split()` blocks).
#[test]
fn other_streams_segments_are_collected_and_split_ones_kept() {
    let config = Config { garbage_collection_threshold: 0.2, per_process_memory_fraction: 0.5, ..Config::pytorch() };
    let (a, drv) = sim_with(1, 1024 * MIB, config);
    let other = a.malloc(SEG, 0, 0x20).unwrap();
    // Requests of 1 to 10 MiB share 20 MiB segments (PyTorch `kLargeBuffer`).
    let split = a.malloc(4 * MIB, 0, 0x10).unwrap();
    let kept = a.malloc(6 * MIB, 0, 0x10).unwrap();
    assert_eq!(kept, split + 4 * MIB as u64, "two blocks of one segment");
    a.free(other).unwrap();
    a.free(split).unwrap();
    // 100 MiB + 20 MiB reserved is over 0.2 of 512 MiB: the other stream's segment goes, the
    // split one stays.
    let big = a.malloc(150 * MIB, 0, 0x10).unwrap();
    assert_eq!(drv.live_allocations(), 2, "the split segment and the new one");
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, (20 + 150) as i64 * MIB as i64);
    check(&a);
    for p in [kept, big] {
        a.free(p).unwrap();
    }
    check(&a);
}
