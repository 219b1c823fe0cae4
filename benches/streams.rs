//! The cost of many streams, on the simulated device (no driver call on the measured path):
//!
//! - `rotation/N`: a free+malloc pair on stream `i` of `N` in rotation, each stream holding one
//!   block whose size alternates between 512 B and 1 KiB from one visit to the next, so every
//!   call moves the device's statistics and may have to settle its peaks. Each shard is
//!   visited once every `N` pairs: what a call costs beyond its own shard shows here.
//! - `stats/N`: one `Allocator::stats` with `N` streams in use.
//!
//! N is 1, 10, 100, 1,000 and 10,000. Not 100,000: each stream holds a 2 MiB segment, one
//! `mmap` each on the simulated device, and 100,000 mappings pass Linux's default
//! `vm.max_map_count` (65,530). Each N also prints the share of calls that settled the peaks.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;

const COUNTS: [usize; 5] = [1, 10, 100, 1_000, 10_000];

fn stream(i: usize) -> usize {
    0x1000 + 0x10 * i
}

/// An allocator with `n` streams, each holding one block of 512 B.
fn with_streams(n: usize) -> (Allocator, Vec<u64>) {
    let a = Allocator::new(Arc::new(SimDriver::new(1, 64 << 30)), Config::default());
    let live = (0..n).map(|i| a.malloc(512, 0, stream(i)).unwrap()).collect();
    (a, live)
}

/// The state of a rotation: the next stream and how many times the rotation went round.
struct Rotation {
    a: Allocator,
    live: Vec<u64>,
    next: usize,
    round: usize,
}

impl Rotation {
    #[inline]
    fn step(&mut self) {
        let i = self.next;
        let size = if self.round % 2 == 0 { 1024 } else { 512 };
        self.a.free(self.live[i]).unwrap();
        self.live[i] = self.a.malloc(black_box(size), 0, stream(i)).unwrap();
        self.next += 1;
        if self.next == self.live.len() {
            self.next = 0;
            self.round += 1;
        }
    }
}

fn rotation(c: &mut Criterion) {
    let mut g = c.benchmark_group("rotation");
    g.throughput(Throughput::Elements(1));
    for n in COUNTS {
        let (a, live) = with_streams(n);
        let mut r = Rotation { a, live, next: 0, round: 0 };
        // Two rounds first (the first takes the device to new peaks, one settle a call), then
        // 1,000 pairs counted.
        for _ in 0..2 * n {
            r.step();
        }
        let settles = r.a.peak_settles(0).unwrap();
        let pairs = 1_000;
        for _ in 0..pairs {
            r.step();
        }
        let settled = r.a.peak_settles(0).unwrap() - settles;
        eprintln!(
            "rotation/{n}: {:.1}% of {} calls settled the peaks",
            100.0 * settled as f64 / (2 * pairs) as f64,
            2 * pairs
        );
        if n >= 1_000 {
            g.sample_size(20);
        }
        g.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| r.step()));
    }
    g.finish();
}

fn stats(c: &mut Criterion) {
    let mut g = c.benchmark_group("stats");
    for n in COUNTS {
        let (a, _live) = with_streams(n);
        if n >= 1_000 {
            g.sample_size(20);
        }
        g.bench_function(BenchmarkId::from_parameter(n), |b| b.iter(|| black_box(a.stats(0).unwrap())));
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = rotation, stats
}
criterion_main!(benches);
