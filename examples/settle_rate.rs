//! How often exact peaks cost a settle that locks every stream: threads each churning 16 live
//! blocks of 4 KiB to 1 MiB on their own stream (the benchmark's thread workload), simulated
//! device. `cargo run --release --example settle_rate`.
use std::sync::Arc;

use gpupool::{Allocator, config::Config, driver::sim::SimDriver};

fn main() {
    for n in [1usize, 4, 16] {
        let a = Arc::new(Allocator::new(Arc::new(SimDriver::new(1, 64 << 30)), Config::default()));
        let ops = 200_000u64;
        let threads: Vec<_> = (0..n)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let stream = 0x100 * (t + 1);
                    let mut rng = (t as u64 + 7) | 1;
                    let mut live = [0u64; 16];
                    for (i, slot) in live.iter_mut().enumerate() {
                        *slot = a.malloc(4096 << (i % 9), 0, stream).unwrap();
                    }
                    for i in 0..ops / 2 {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let k = (i % 16) as usize;
                        a.free(live[k]).unwrap();
                        live[k] = a.malloc(4096 << (rng % 9), 0, stream).unwrap();
                    }
                    for p in live {
                        a.free(p).unwrap();
                    }
                })
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
