//! A cache-hit malloc+free loop on the simulated device, for instruction-level profiling:
//! `valgrind --tool=callgrind target/release/examples/hit_loop`.
use std::sync::Arc;

use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;

fn main() {
    let size: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(512);
    let a = Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
    for _ in 0..200_000 {
        let p = a.malloc(std::hint::black_box(size), 0, 0x10).unwrap();
        a.free(std::hint::black_box(p)).unwrap();
    }
}
