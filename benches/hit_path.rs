//! The allocator's own cost on the simulated device, where no driver call is on the measured
//! path: a cache-hit malloc+free pair by size, and total throughput of threads that each
//! allocate on their own stream (the workload of `../shared/GPU.md`: sizes 4 KiB to 1 MiB, 16
//! live a thread). Figures on a GPU come from the C benchmark (examples/c), which also runs
//! PyTorch's allocator and cudaMallocAsync beside gpupool.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;

#[path = "shared/churn.rs"]
mod churn;
use churn::churn;

fn allocator() -> Allocator {
    Allocator::new(Arc::new(SimDriver::new(1, 64 << 30)), Config::default())
}

fn hit_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("hit_pair");
    for (name, size) in [("512B", 512usize), ("1MiB", 1 << 20), ("16MiB", 16 << 20)] {
        let a = allocator();
        let p = a.malloc(size, 0, 0x10).unwrap();
        a.free(p).unwrap();
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                let p = a.malloc(black_box(size), 0, 0x10).unwrap();
                a.free(black_box(p)).unwrap();
            })
        });
    }
    g.finish();
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads_own_streams");
    let max = thread::available_parallelism().map_or(2, |n| n.get()).min(16);
    for n in [1usize, 2, 4, 8, 16].into_iter().filter(|&n| n <= max.max(2)) {
        const OPS: u64 = 20_000;
        g.throughput(Throughput::Elements(OPS * n as u64));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            let a = Arc::new(allocator());
            for t in 0..n {
                churn(&a, 0x100 * (t + 1), 1000, t as u64);
            }
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Arc::new(Barrier::new(n + 1));
                    let handles: Vec<_> = (0..n)
                        .map(|t| {
                            let (a, start) = (a.clone(), start.clone());
                            thread::spawn(move || {
                                start.wait();
                                churn(&a, 0x100 * (t + 1), OPS, t as u64 + 7);
                            })
                        })
                        .collect();
                    start.wait();
                    let t0 = Instant::now();
                    for h in handles {
                        h.join().unwrap();
                    }
                    total += t0.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hit_pair, threads
}
criterion_main!(benches);
