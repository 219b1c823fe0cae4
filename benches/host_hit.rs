//! The pinned host allocator's hit path on the simulated device (no driver call is on it): a
//! cached `malloc`+`free` pair of one size (a power of two's class, and above 1 MiB one of a
//! 32nd of a power of two), on one thread and on several threads at once (each its own loop,
//! as threads staging for their own streams do).
//!
//! Beside gpupool's design (per-thread stripes, a lock-free block index), `pytorch_layout` is
//! PyTorch's lock layout rebuilt with the same primitives: one mutex over the pointer map that
//! every free takes (PyTorch looks a raw pointer up under `blocks_mutex_`), and one mutex per
//! size class over its free list. It caches nothing real; it is there to show what the layout
//! costs, one thread against many. GPU figures (with PyTorch's own allocator) come from
//! `examples/c/bench_host.c`.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpupool::config::Config;
use gpupool::driver::Driver;
use gpupool::driver::sim::SimDriver;
use gpupool::host::HostAllocator;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

/// PyTorch's layout: `blocks_mutex_` over the pointer map, a mutex per size class.
struct PytorchLayout {
    blocks: Mutex<FxHashMap<usize, (usize, bool)>>,
    free: Vec<Mutex<Vec<usize>>>,
}

impl PytorchLayout {
    fn new() -> Self {
        PytorchLayout {
            blocks: Mutex::new(FxHashMap::default()),
            free: (0..64).map(|_| Mutex::new(Vec::new())).collect(),
        }
    }

    fn malloc(&self, size: usize) -> usize {
        let rounded = size.next_power_of_two();
        let class = rounded.trailing_zeros() as usize;
        if let Some(p) = self.free[class].lock().pop() {
            return p;
        }
        let p = Box::leak(vec![0u8; rounded].into_boxed_slice()).as_ptr() as usize;
        self.blocks.lock().insert(p, (rounded, true));
        p
    }

    fn free(&self, p: usize) {
        let size = {
            let mut blocks = self.blocks.lock();
            let b = blocks.get_mut(&p).expect("ours");
            b.1 = false;
            b.0
        };
        self.free[size.trailing_zeros() as usize].lock().push(p);
    }
}

fn host() -> HostAllocator {
    HostAllocator::new(Arc::new(SimDriver::new(1, 1 << 30)) as Arc<dyn Driver>, &Config::default())
}

fn hit_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("host_hit_pair");
    // 20.4 MiB: a size class of a 32nd of a power of two (PyTorch: 32 MiB).
    for (name, size) in [("4KiB", 4096usize), ("1MiB", 1 << 20), ("20.4MiB", (20 << 20) + (2 << 20) / 5)] {
        let h = host();
        h.free(h.malloc(size).unwrap()).unwrap();
        g.bench_function(BenchmarkId::new("gpupool", name), |b| {
            b.iter(|| {
                let p = h.malloc(black_box(size)).unwrap();
                h.free(black_box(p)).unwrap();
            })
        });
        let pt = PytorchLayout::new();
        pt.free(pt.malloc(size));
        g.bench_function(BenchmarkId::new("pytorch_layout", name), |b| {
            b.iter(|| {
                let p = pt.malloc(black_box(size));
                pt.free(black_box(p));
            })
        });
    }
    g.finish();
}

/// `n` threads each run `pairs` pairs of 64 KiB; the time from the first thread's start to
/// the last one's end, each measured by the threads themselves (on a machine with fewer cores
/// than threads, the main thread may not run when they start).
fn threaded(n: usize, pairs: u64, pair: Arc<dyn Fn() + Send + Sync>) -> Duration {
    let start = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (start, pair) = (start.clone(), pair.clone());
            thread::spawn(move || {
                pair(); // warm: this thread's stripe gets its block
                start.wait();
                let t0 = Instant::now();
                for _ in 0..pairs {
                    pair();
                }
                (t0, Instant::now())
            })
        })
        .collect();
    let spans: Vec<(Instant, Instant)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let first = spans.iter().map(|s| s.0).min().expect("n > 0");
    let last = spans.iter().map(|s| s.1).max().expect("n > 0");
    last - first
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("host_threads");
    let max = thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    const PAIRS: u64 = 20_000;
    for n in [1usize, 2, 4, 8].into_iter().filter(|&n| n <= max) {
        g.throughput(Throughput::Elements(PAIRS * n as u64));
        let h = host();
        let gp: Arc<dyn Fn() + Send + Sync> = Arc::new(move || h.free(h.malloc(64 << 10).unwrap()).unwrap());
        g.bench_function(BenchmarkId::new("gpupool", n), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| threaded(n, PAIRS, gp.clone())).sum())
        });
        let pt = Arc::new(PytorchLayout::new());
        let ptf: Arc<dyn Fn() + Send + Sync> = Arc::new(move || pt.free(pt.malloc(64 << 10)));
        g.bench_function(BenchmarkId::new("pytorch_layout", n), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| threaded(n, PAIRS, ptf.clone())).sum())
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
