//! What gpupool keeps per stream, and what its cost depends on: many streams, idle streams
//! given back by empty_cache, dropping an allocator, and peaks read while streams overlap.

use crate::common;

use std::sync::Arc;

use common::{MIB, check, sim};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;

#[test]
fn ten_thousand_streams_used_and_emptied_leave_no_state_behind() {
    let (a, drv) = sim(1, 64 << 30);
    for stream in 1..=10_000usize {
        let p = a.malloc(512 + 512 * (stream % 2), 0, stream).unwrap();
        a.free(p).unwrap();
    }
    assert_eq!(a.stream_count(0).unwrap(), 10_000);
    let settles = a.peak_settles(0).unwrap();
    assert!(settles <= 10_000, "{settles} settles for 20,000 calls");
    a.empty_cache(0).unwrap();
    assert_eq!(a.stream_count(0).unwrap(), 0, "idle streams keep no state after empty_cache");
    assert_eq!(drv.used(0), 0);
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocation.all.allocated, s.allocation.all.freed), (10_000, 10_000), "totals survive");
    assert_eq!(s.allocated_bytes.all.peak, 1024, "one block at a time: the peak is the larger block");
    check(&a);
    // A stream used again after its state was reclaimed gets new state, counted as before.
    let p = a.malloc(4096, 0, 7).unwrap();
    assert_eq!(a.stream_count(0).unwrap(), 1);
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 1);
    a.free(p).unwrap();
    check(&a);
}

#[test]
fn a_stream_holding_memory_keeps_its_state_through_empty_cache() {
    let (a, _) = sim(1, 1 << 30);
    let held = a.malloc(4096, 0, 1).unwrap();
    let p = a.malloc(4096, 0, 2).unwrap();
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(a.stream_count(0).unwrap(), 1);
    a.free(held).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(a.stream_count(0).unwrap(), 0);
    check(&a);
}

#[test]
fn settles_do_not_grow_with_the_streams_in_rotation() {
    // N streams each holding a block, freed and allocated again in rotation with sizes
    // alternating 512 B and 1 KiB: the settle rate must not grow with N.
    let rate = |n: usize| {
        let (a, _) = sim(1, 64 << 30);
        let mut live: Vec<u64> = (0..n).map(|s| a.malloc(512, 0, s + 1).unwrap()).collect();
        let mut pair = |i: usize| {
            let s = i % n;
            a.free(live[s]).unwrap();
            live[s] = a.malloc(512 * (1 + (i / n) % 2), 0, s + 1).unwrap();
        };
        // The first round of 1 KiB blocks takes the device to new peaks, one settle each.
        let warm = 2 * n;
        (0..warm).for_each(&mut pair);
        let before = a.peak_settles(0).unwrap();
        let calls = 40_000;
        (warm..warm + calls / 2).for_each(&mut pair);
        let settles = a.peak_settles(0).unwrap() - before;
        check(&a);
        settles as f64 / calls as f64
    };
    // Past the first round the device never passes its peak: no call needs a settle (a
    // quarter of them did when credit stayed with the streams that freed it).
    let (few, many) = (rate(10), rate(2_000));
    assert!(few < 0.001 && many < 0.001, "settle rate {few} at 10 streams, {many} at 2,000");
}

#[test]
fn dropping_an_allocator_gives_back_what_is_free() {
    let drv = Arc::new(SimDriver::new(1, 1 << 30));
    {
        let a = Allocator::new(drv.clone(), Config::default());
        let p = a.malloc(23 * MIB, 0, 1).unwrap();
        let q = a.malloc(4096, 0, 2).unwrap();
        a.record_stream(q, 3).unwrap();
        drv.hold_stream(3);
        a.free(q).unwrap();
        a.free(p).unwrap();
        drv.release_stream(3);
    }
    assert_eq!(drv.used(0), 0, "cached segments go back to the driver");
    assert_eq!(drv.live_events(), 0, "and so do idle events");
}

#[test]
fn concurrent_readers_see_consistent_peaks() {
    let (a, _) = sim(1, 8 << 30);
    let a = Arc::new(a);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                let mut live = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    if live.len() < 32 && rng % 3 != 0 {
                        let size =
                            if rng % 5 == 0 { 2 * MIB + (rng % 8) as usize * MIB } else { 512 * (rng % 2048) as usize };
                        live.push(a.malloc(size, 0, 1 + (t as usize) * 2 + (rng % 2) as usize).unwrap());
                    } else if let Some(p) = live.pop() {
                        a.free(p).unwrap();
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for _ in 0..3_000 {
        let s = a.stats(0).unwrap();
        for arr in [s.allocation, s.active, s.inactive_split, s.allocated_bytes, s.active_bytes, s.requested_bytes] {
            assert!(arr.all.peak <= arr.small_pool.peak + arr.large_pool.peak, "{arr:?}");
            assert!(arr.all.peak >= arr.small_pool.peak.max(arr.large_pool.peak), "{arr:?}");
            for st in [arr.all, arr.small_pool, arr.large_pool] {
                assert!(st.current <= st.peak, "{arr:?}");
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    check(&a);
}
