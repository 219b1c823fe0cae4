//! Peak settles racing calls on other streams: a call's settle visits the shards one at a time
//! while the other streams go on (see `src/caching/accounting/peaks/`). Threads churn their own streams of
//! one device, one of them reaching new peaks again and again, while another thread reads the
//! statistics and resets the peaks: every snapshot is consistent, the invariant checker (which
//! holds every statistic to `P = G + sum(h) + R`) passes at the end, and once the calls no
//! longer overlap, the peaks are exact again.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{MIB, check, sim_with};
use gpupool::config::Config;

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn settles_racing_calls_keep_the_credit_exact_and_the_peaks_exact_once_calls_stop_overlapping() {
    for config in [Config::default(), Config::pytorch()] {
        let (a, _) = sim_with(1, 64 << 30, config);
        let a = Arc::new(a);
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reads = 0u64;
                // At least one read, however late this thread is scheduled (a loaded machine
                // may run every worker to its end first).
                while reads == 0 || !stop.load(Ordering::Relaxed) {
                    let s = a.stats(0).unwrap();
                    for arr in [s.allocation, s.active, s.allocated_bytes, s.active_bytes, s.reserved_bytes] {
                        for st in [arr.all, arr.small_pool, arr.large_pool] {
                            assert!(st.current <= st.peak, "{arr:?}");
                        }
                        assert!(arr.all.peak <= arr.small_pool.peak + arr.large_pool.peak, "{arr:?}");
                    }
                    reads += 1;
                    if reads % 50 == 0 {
                        a.reset_peak_stats(0).unwrap();
                    }
                }
                reads
            })
        };
        let workers: Vec<_> = (0..6u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                    let mut live = [0u64; 16];
                    for (i, p) in live.iter_mut().enumerate() {
                        *p = a.malloc(4096 << (i % 9), 0, 0x100 * (t as usize + 1)).unwrap();
                    }
                    for i in 0..20_000usize {
                        let k = i % 16;
                        a.free(live[k]).unwrap();
                        // Thread 0 grows now and then: new peaks, each a settle while the
                        // others churn.
                        let size = if t == 0 && i % 97 == 0 {
                            (1 + i / 97 % 64) * MIB
                        } else {
                            4096 << (xorshift(&mut rng) % 9)
                        };
                        live[k] = a.malloc(size, 0, 0x100 * (t as usize + 1)).unwrap();
                    }
                    for p in live {
                        a.free(p).unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        check(&a);
        assert!(a.peak_settles(0).unwrap() > 0);
        // The calls no longer overlap: after a reset, each peak is what the device reached.
        a.reset_peak_stats(0).unwrap();
        let base = a.stats(0).unwrap().allocated_bytes.all.current;
        assert_eq!(base, 0);
        let mut held = Vec::new();
        let mut high = 0i64;
        for (i, stream) in [0x100usize, 0x200, 0x300, 0x100, 0x400].into_iter().enumerate() {
            held.push(a.malloc((i + 1) * MIB, 0, stream).unwrap());
            high += ((i + 1) * MIB) as i64;
            if i == 2 {
                a.free(held.remove(0)).unwrap();
                high -= MIB as i64;
                held.push(a.malloc(3 * MIB, 0, 0x500).unwrap());
                high += 3 * MIB as i64;
            }
        }
        let s = a.stats(0).unwrap();
        assert_eq!(s.allocated_bytes.all.current, high);
        assert_eq!(s.allocated_bytes.all.peak, high, "each step a new peak, and none between");
        for p in held.drain(1..) {
            a.free(p).unwrap();
        }
        let s = a.stats(0).unwrap();
        assert_eq!(s.allocated_bytes.all.peak, high);
        a.free(held[0]).unwrap();
        check(&a);
    }
}
