//! Pinned host memory's size classes on the simulated device: from 1 MiB up a request pins at
//! most 1.05 times its size (PyTorch's powers of two pin up to twice), a freed block serves
//! the next request of about its size, and the statistics count the blocks' exact sizes. The
//! simulated `cuMemHostAlloc` maps memory without reserving it, so the sizes are real ones.

use std::sync::Arc;

use gpupool::config::Config;
use gpupool::driver::Driver;
use gpupool::driver::sim::SimDriver;
use gpupool::host::{HostAllocator, rounded_size};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// The mix: the sizes of sglang PR #37285 and vLLM #56410 scaled from GiB to MiB where the
/// host would have to map them (20.4 MiB for 20.4 GiB), one of 1.2 GiB, and the worst case
/// of the rule (just over a step of a 32nd).
const MIX: [(&str, usize); 10] = [
    ("1 MiB", MIB),
    ("1 MiB + 1 B", MIB + 1),
    ("1.5 MiB", 3 * MIB / 2),
    ("3 MiB", 3 * MIB),
    ("20.4 MiB", 20 * MIB + 2 * MIB / 5),
    ("64 MiB + 1 B", 64 * MIB + 1),
    ("100 MiB", 100 * MIB),
    ("127 MiB + 4 KiB", 127 * MIB + 4096),
    ("300 MiB", 300 * MIB),
    ("1.2 GiB", 6 * GIB / 5),
];

fn host() -> (HostAllocator, Arc<SimDriver>) {
    let sim = Arc::new(SimDriver::new(1, 1 << 30));
    (HostAllocator::new(sim.clone() as Arc<dyn Driver>, &Config::default()), sim)
}

/// Allocates the mix; checks each block against its request; returns the blocks.
fn round_of_mix(h: &HostAllocator, sim: &SimDriver) -> Vec<(usize, usize)> {
    MIX.iter()
        .map(|&(name, size)| {
            let p = h.malloc(size).unwrap();
            let got = h.block_size(p).unwrap();
            assert!(got >= size && got as f64 / size as f64 <= 1.05, "{name}: {got} bytes pinned for {size}");
            assert!(sim.is_pinned(p, got), "{name}: the whole block is pinned");
            // SAFETY: the block holds `got` bytes.
            unsafe {
                (p as *mut u8).write(0x5a);
                ((p + got - 1) as *mut u8).write(0xa5);
            }
            (p, got)
        })
        .collect()
}

#[test]
fn a_mix_from_1_mib_up_pins_at_most_1_05_of_its_requests_and_is_reused_whole() {
    let (h, sim) = host();
    let blocks = round_of_mix(&h, &sim);
    let requested: usize = MIX.iter().map(|m| m.1).sum();
    let pinned: usize = blocks.iter().map(|b| b.1).sum();
    let st = h.stats();
    assert_eq!(st.allocated_bytes.current, pinned as i64, "allocated_bytes is the blocks' sizes, exactly");
    assert_eq!(st.active_bytes.current, pinned as i64);
    assert_eq!(st.allocations.current, MIX.len() as i64);
    assert!(pinned as f64 / requested as f64 <= 1.05, "{pinned} bytes pinned for {requested}");
    // PyTorch's powers of two for the same mix: 1.6x.
    let pow2: usize = MIX.iter().map(|m| m.1.next_power_of_two()).sum();
    assert!(pow2 as f64 / requested as f64 > 1.5);
    h.check_invariants();

    for &(p, _) in &blocks {
        h.free(p).unwrap();
    }
    let pinned_calls = sim.counts().host_alloc;
    let again = round_of_mix(&h, &sim);
    assert_eq!(sim.counts().host_alloc, pinned_calls, "the second round pins nothing new");
    let mut first: Vec<_> = blocks.clone();
    let mut second = again.clone();
    first.sort_unstable();
    second.sort_unstable();
    assert_eq!(first, second, "the same blocks, each its size");
    assert_eq!(h.stats().allocated_bytes.current, pinned as i64);
    h.check_invariants();
    for (p, _) in again {
        h.free(p).unwrap();
    }
    h.empty_cache().unwrap();
    assert_eq!(h.stats().allocated_bytes.current, 0);
    assert_eq!(sim.live_host(), (0, 0));
}

#[test]
fn the_rule_powers_of_two_to_1_mib_then_32_steps_per_power() {
    assert_eq!(rounded_size(0), None);
    assert_eq!(rounded_size(1000), Some(1024));
    assert_eq!(rounded_size(600 << 10), Some(MIB), "below 1 MiB: PyTorch's power of two");
    assert_eq!(rounded_size(MIB), Some(MIB));
    assert_eq!(rounded_size(MIB + 1), Some(MIB + (32 << 10)), "1 to 2 MiB: steps of 32 KiB");
    assert_eq!(rounded_size(3 * MIB / 2), Some(3 * MIB / 2));
    // The issue's figures: 20.4 GiB pinned 32 GiB, now 20.5 GiB; 1.2 GiB pinned 2 GiB.
    let issue = 20 * GIB + 2 * GIB / 5;
    assert_eq!(rounded_size(issue), Some(20 * GIB + GIB / 2));
    assert_eq!(rounded_size(6 * GIB / 5), Some(39 * 32 * MIB));
    assert_eq!(rounded_size(1 << 63), Some(1 << 63));
    assert_eq!(rounded_size((1 << 63) + 1), None);
    // From 1 MiB to 2^63, at both ends of each step: under 1/32 more.
    let mut size = MIB;
    while size < 1 << 62 {
        for s in [size, size + 1, size + size / 32, size + size / 32 + 1, 2 * size - 1] {
            let r = rounded_size(s).unwrap();
            assert!(r >= s && (r - s) < s / 32 + 1, "{s} rounds to {r}");
        }
        size *= 2;
    }
}

#[test]
fn a_freed_block_serves_a_smaller_request_at_most_5_percent_under_it() {
    let (h, sim) = host();
    let a = h.malloc(3 * MIB + 1).unwrap();
    assert_eq!(h.block_size(a), Some(3 * MIB + (64 << 10)));
    h.free(a).unwrap();
    // 3 MiB: 64 KiB (2.1%) under a's block, whose class is the next one.
    let b = h.malloc(3 * MIB).unwrap();
    assert_eq!(b, a, "the cached block of the next class serves it");
    assert_eq!(sim.counts().host_alloc, 1);
    assert_eq!(h.block_size(b), Some(3 * MIB + (64 << 10)));
    assert_eq!(h.stats().active_bytes.current, (3 * MIB + (64 << 10)) as i64, "the block's size is counted");
    h.free(b).unwrap();
    // 2.9 MiB: the block would be 7.9% over it; a block of its own is pinned.
    let c = h.malloc(29 * MIB / 10).unwrap();
    assert_ne!(c, a);
    assert_eq!(sim.counts().host_alloc, 2);
    assert_eq!(h.block_size(c), rounded_size(29 * MIB / 10));
    // Its own class is preferred to a larger one.
    h.free(c).unwrap();
    let d = h.malloc(29 * MIB / 10).unwrap();
    assert_eq!(d, c);
    h.free(d).unwrap();
    // Below 1 MiB nothing changes: a 2 KiB block does not serve 1000 bytes.
    let e = h.malloc(2048).unwrap();
    h.free(e).unwrap();
    assert_ne!(h.malloc(1000).unwrap(), e);
    h.check_invariants();
}

#[test]
fn a_deferred_block_of_a_nearby_class_is_synchronised_and_reused() {
    let (h, sim) = host();
    let a = h.malloc(3 * MIB + 1).unwrap();
    h.free_after_device_sync(a, 0).unwrap();
    h.check_invariants();
    let b = h.malloc(3 * MIB).unwrap();
    assert_eq!(b, a, "synchronised for, as its own class would be");
    assert_eq!((h.deferred().syncs, sim.counts().host_alloc), (1, 1));
    h.free(b).unwrap();
    // One that would be more than 5% over is not worth a synchronisation.
    let c = h.malloc(3 * MIB + 1).unwrap();
    h.free_after_device_sync(c, 0).unwrap();
    let d = h.malloc(2 * MIB).unwrap();
    assert_ne!(d, c);
    assert_eq!((h.deferred().syncs, h.deferred().blocks), (1, 1));
    h.check_invariants();
}
