//! How often exact peaks cost a settle that locks every stream: threads each churning 16 live
//! blocks of 4 KiB to 1 MiB on their own stream (the benchmark's thread workload), simulated
//! device. `cargo run --release --example settle_rate`.
use std::sync::Arc;

use gpupool::{Allocator, config::Config, driver::sim::SimDriver};

#[path = "../benches/shared/churn.rs"]
mod churn;
use churn::churn;

fn main() {
    for n in [1usize, 4, 16] {
        let a = Arc::new(Allocator::new(Arc::new(SimDriver::new(1, 64 << 30)), Config::default()));
        let ops = 200_000u64;
        let threads: Vec<_> = (0..n)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || churn(&a, 0x100 * (t + 1), ops, t as u64 + 7))
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let settles = a.peak_settles(0).unwrap();
        let total = n as u64 * ops;
        println!(
            "{n:2} threads: {settles} settles in {total} operations ({:.5} a call)",
            settles as f64 / total as f64
        );
    }
}
