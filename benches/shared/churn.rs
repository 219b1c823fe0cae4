//! The thread workload of the benchmarks (`../shared/GPU.md`, and `examples/c/bench.c` in C):
//! each thread on its own stream keeps a ring of 16 live blocks of 4 KiB to 1 MiB. Shared by
//! `benches/hit_path.rs` and `examples/settle_rate.rs` (included with `#[path]`: a file in a
//! subfolder of `benches/` is not a bench target of its own).

use gpupool::Allocator;

/// `ops` operations (half frees, half allocations) on `stream`, sizes drawn by xorshift from
/// `seed`.
pub fn churn(a: &Allocator, stream: usize, ops: u64, seed: u64) {
    let mut live = [0u64; 16];
    let mut rng = seed | 1;
    for (i, slot) in live.iter_mut().enumerate() {
        *slot = a.malloc(4096 << (i % 9), 0, stream).unwrap();
    }
    for i in 0..ops / 2 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let slot = (i % 16) as usize;
        a.free(live[slot]).unwrap();
        live[slot] = a.malloc(4096 << (rng % 9), 0, stream).unwrap();
    }
    for p in live {
        a.free(p).unwrap();
    }
}
