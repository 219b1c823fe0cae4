//! Pinned bytes against requested bytes for a mix of sizes from 1 MiB to 1.2 GiB, on the
//! simulated device (its `cuMemHostAlloc` maps memory without touching it): gpupool's size
//! classes against PyTorch's powers of two, then a second round of the same mix, which should
//! pin nothing new. `cargo run --release --example host_size_mix`.
use std::sync::Arc;

use gpupool::config::Config;
use gpupool::driver::Driver;
use gpupool::driver::sim::SimDriver;
use gpupool::host::{HostAllocator, rounded_size};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// The mix of `tests/host/sizes.rs`.
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

fn mib(bytes: usize) -> f64 {
    bytes as f64 / MIB as f64
}

fn main() {
    let sim = Arc::new(SimDriver::new(1, 1 << 30));
    let h = HostAllocator::new(sim.clone() as Arc<dyn Driver>, &Config::default());
    println!("{:<16} {:>12} {:>12} {:>7} {:>12} {:>7}", "request", "MiB", "gpupool", "ratio", "PyTorch", "ratio");
    let (mut requested, mut pinned, mut pow2) = (0usize, 0usize, 0usize);
    let mut blocks = Vec::new();
    for (name, size) in MIX {
        let p = h.malloc(size).expect("pinned");
        let got = h.block_size(p).expect("allocated");
        let pt = size.next_power_of_two();
        println!(
            "{name:<16} {:>12.3} {:>12.3} {:>7.4} {:>12.3} {:>7.4}",
            mib(size),
            mib(got),
            got as f64 / size as f64,
            mib(pt),
            pt as f64 / size as f64
        );
        requested += size;
        pinned += got;
        pow2 += pt;
        blocks.push(p);
    }
    let stats = h.stats();
    assert_eq!(stats.allocated_bytes.current, pinned as i64);
    println!(
        "{:<16} {:>12.3} {:>12.3} {:>7.4} {:>12.3} {:>7.4}",
        "mix",
        mib(requested),
        mib(pinned),
        pinned as f64 / requested as f64,
        mib(pow2),
        pow2 as f64 / requested as f64
    );
    for p in blocks {
        h.free(p).unwrap();
    }
    let calls = sim.counts().host_alloc;
    let again: Vec<_> = MIX.iter().map(|&(_, size)| h.malloc(size).unwrap()).collect();
    println!(
        "second round: {} new pinnings, allocated_bytes {:.3} MiB",
        sim.counts().host_alloc - calls,
        mib(h.stats().allocated_bytes.current as usize)
    );
    for p in again {
        h.free(p).unwrap();
    }
    let issue = 20 * GIB + 2 * GIB / 5;
    let r = rounded_size(issue).unwrap();
    println!(
        "20.4 GiB (sglang #37285): gpupool {:.3} GiB ({:.4}), PyTorch {} GiB ({:.4})",
        r as f64 / GIB as f64,
        r as f64 / issue as f64,
        issue.next_power_of_two() / GIB,
        issue.next_power_of_two() as f64 / issue as f64
    );
    h.empty_cache().unwrap();
}
