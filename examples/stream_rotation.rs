//! Free+malloc pairs rotating over streams on the simulated device, for cache-simulating
//! counts (issue 42): `valgrind --tool=cachegrind --cache-sim=yes
//! target/release/examples/stream_rotation STREAMS PAIRS [GIB]`.
//!
//! Each of STREAMS (1,000) streams holds one block, whose size alternates between 512 B and
//! 1 KiB from one visit to the next (as `benches/streams.rs`'s `rotation`); two rounds are run
//! first, then PAIRS (100,000) pairs, each freeing the block of the next stream and allocating
//! it again on that stream. Run twice with different PAIRS and divide the difference for the
//! cost of one pair, start-up excluded. The configuration comes from `GPUPOOL_CONF`
//! (`expandable_segments:False` for ordinary segments). GIB (4): the device's capacity; small,
//! because each stream's expandable range reserves a 64th of it as host address space, more than
//! valgrind's address space holds at 1,000 streams of a 64 GiB device. Prints the time per pair.
use std::sync::Arc;
use std::time::Instant;

use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;

fn stream(i: usize) -> usize {
    0x1000 + 0x10 * i
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1_000);
    let pairs: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let gib: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(4);
    let config = Config::from_env().expect("GPUPOOL_CONF");
    let a = Allocator::new(Arc::new(SimDriver::new(1, gib << 30)), config);
    let mut live: Vec<u64> = (0..n).map(|i| a.malloc(512, 0, stream(i)).unwrap()).collect();
    let mut step = |k: usize| {
        let i = k % n;
        let size = if (k / n) % 2 == 0 { 1024 } else { 512 };
        a.free(live[i]).unwrap();
        live[i] = a.malloc(std::hint::black_box(size), 0, stream(i)).unwrap();
    };
    for k in 0..2 * n {
        step(k);
    }
    let t = Instant::now();
    for k in 2 * n..2 * n + pairs {
        step(k);
    }
    let ns = t.elapsed().as_nanos() as f64 / pairs as f64;
    println!("{n} streams, {pairs} pairs: {ns:.1} ns per free+malloc pair");
}
