//! A cache-hit pinned-host malloc+free loop on the simulated device, for instruction-level
//! profiling: `valgrind --tool=callgrind target/release/examples/host_hit_loop [SIZE]`.
//! Prints the time per pair (SIZE bytes, default 65536).
use std::sync::Arc;
use std::time::Instant;

use gpupool::config::Config;
use gpupool::driver::Driver;
use gpupool::driver::sim::SimDriver;
use gpupool::host::HostAllocator;

const PAIRS: u32 = 1_000_000;

fn main() {
    let size: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(65536);
    let h = HostAllocator::new(Arc::new(SimDriver::new(1, 1 << 30)) as Arc<dyn Driver>, &Config::default());
    h.free(h.malloc(size).unwrap()).unwrap();
    let t0 = Instant::now();
    for _ in 0..PAIRS {
        let p = h.malloc(std::hint::black_box(size)).unwrap();
        h.free(std::hint::black_box(p)).unwrap();
    }
    println!("{:.1} ns per pair", t0.elapsed().as_nanos() as f64 / f64::from(PAIRS));
}
