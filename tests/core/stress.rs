//! Threads on several streams at once (two threads a stream, so shards see real contention),
//! with record_stream across streams, held streams and empty_cache calls, and some threads
//! routing their allocations to a private pool of their own for a while (pools released with
//! blocks still live); every block carries a cookie checked before it is freed, and the
//! invariant checker runs at the end.

use crate::common;

use std::sync::Arc;
use std::thread;

use common::{MIB, check, sim, sim_with};
use gpupool::config::Config;

const THREADS: usize = 8;
const OPS: usize = 20_000;

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn threads_on_several_streams_keep_every_invariant() {
    threads_on_several_streams(false);
}

#[test]
fn threads_on_several_streams_keep_every_invariant_with_expandable_segments() {
    threads_on_several_streams(true);
}

/// Fewer pages cached: before a segment grows past the peak, other streams' free pages are
/// unmapped, their locks taken one at a time while threads allocate on them.
#[test]
fn threads_on_several_streams_keep_every_invariant_with_the_high_water_rule() {
    for expandable_large_pages in [false, true] {
        threads_on_several_streams_with(Config {
            expandable_segments: true,
            expandable_reclaim: true,
            expandable_large_pages,
            ..Config::pytorch()
        });
    }
}

fn threads_on_several_streams(expandable_segments: bool) {
    threads_on_several_streams_with(Config { expandable_segments, ..Config::pytorch() });
}

fn threads_on_several_streams_with(config: Config) {
    let (a, drv) = sim_with(1, 2048 * MIB, config);
    let a = Arc::new(a);
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let a = a.clone();
            let drv = drv.clone();
            thread::spawn(move || {
                let stream = 0x100 * (t % 4 + 1);
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                let mut live: Vec<(u64, usize, u64)> = Vec::new();
                let mut pool = a.pool_create();
                let (mut routed, mut toggles) = (false, 0);
                for i in 0..OPS {
                    let r = xorshift(&mut rng);
                    if t % 4 == 3 && i % 200 == 0 {
                        if routed {
                            a.end_allocate_to_pool(0, pool).unwrap();
                        } else {
                            a.begin_allocate_to_pool_thread(0, pool).unwrap();
                        }
                        routed = !routed;
                        toggles += 1;
                        if !routed && toggles % 6 == 0 {
                            a.release_pool(0, pool).unwrap();
                            pool = a.pool_create();
                        }
                    }
                    if live.len() < 32 && (r % 3 != 0 || live.is_empty()) {
                        let size = match r % 10 {
                            0 => (r >> 8) as usize % (24 * MIB),
                            1..=3 => (r >> 8) as usize % (2 * MIB),
                            _ => (r >> 8) as usize % 16384 + 1,
                        }
                        .max(8);
                        let p = a.malloc(size, 0, stream).expect("malloc");
                        let cookie = ((t as u64) << 48) | i as u64;
                        // SAFETY: a live block of at least 8 bytes of host memory.
                        unsafe { (p as *mut u64).write_unaligned(cookie) };
                        if r % 17 == 0 {
                            a.record_stream(p, 0x100 * ((t + 1) % 4 + 1)).unwrap();
                        }
                        live.push((p, size, cookie));
                    } else {
                        let (p, _, cookie) = live.swap_remove((r >> 4) as usize % live.len());
                        // SAFETY: as above.
                        assert_eq!(
                            unsafe { (p as *const u64).read_unaligned() },
                            cookie,
                            "a live block was handed out twice"
                        );
                        a.free(p).unwrap();
                    }
                    if t == 0 && i % 997 == 0 {
                        drv.hold_stream(0x200);
                    }
                    if t == 1 && i % 1499 == 0 {
                        drv.release_stream(0x200);
                    }
                    if t == 2 && i % 4001 == 0 {
                        a.empty_cache(0).unwrap();
                    }
                }
                if routed {
                    a.end_allocate_to_pool(0, pool).unwrap();
                }
                a.release_pool(0, pool).unwrap();
                for (p, _, _) in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    drv.release_stream(0x200);
    check(&a);
    a.empty_cache(-1).unwrap();
    check(&a);
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocation.all.current, s.active.all.current, s.reserved_bytes.all.current), (0, 0, 0));
    assert_eq!(s.allocation.all.allocated, s.allocation.all.freed);
    assert!(s.allocation.all.peak >= 32, "peak {} below one thread's live set", s.allocation.all.peak);
    assert_eq!(drv.used(0), 0);
}

/// Every statistic of a snapshot: current within 0 and peak, allocated - freed = current, the
/// aggregate equal to the sum of the pools, and the aggregate peak at most the sum of the
/// pools' peaks (the aggregate is at every moment the sum of the pools, so its highest value
/// cannot exceed the sum of theirs). Returns what is wrong.
fn inconsistencies(s: &gpupool::stats::DeviceStats) -> Vec<String> {
    let mut wrong = Vec::new();
    let arrays = [
        ("allocation", s.allocation),
        ("segment", s.segment),
        ("active", s.active),
        ("inactive_split", s.inactive_split),
        ("allocated_bytes", s.allocated_bytes),
        ("reserved_bytes", s.reserved_bytes),
        ("active_bytes", s.active_bytes),
        ("inactive_split_bytes", s.inactive_split_bytes),
        ("requested_bytes", s.requested_bytes),
    ];
    for (name, a) in arrays {
        for (pool, x) in [("all", a.all), ("small_pool", a.small_pool), ("large_pool", a.large_pool)] {
            if x.current < 0 || x.current > x.peak || x.allocated - x.freed != x.current {
                wrong.push(format!("{name}.{pool}: {x:?}"));
            }
        }
        if a.all.current != a.small_pool.current + a.large_pool.current {
            wrong.push(format!("{name}: all.current is not the sum of the pools: {a:?}"));
        }
        if a.all.peak > a.small_pool.peak + a.large_pool.peak {
            wrong.push(format!(
                "{name}: all.peak {} > small_pool.peak {} + large_pool.peak {}",
                a.all.peak, a.small_pool.peak, a.large_pool.peak
            ));
        }
    }
    wrong
}

/// Statistics read while 8 threads allocate (both pools, so that every pool's figures move) on
/// their own streams and on four shared ones, use blocks on other streams (`record_stream`,
/// with streams held) and read the statistics themselves, while another thread reads them in
/// a loop, resets the peaks and empties the cache: every snapshot must be consistent. (An
/// aggregate peak above the sum of the pools' peaks was seen in a few snapshots of a long
/// soak; snapshots taken by several threads at once show it within a second.)
#[test]
fn concurrent_snapshots_are_consistent() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const OPS: usize = 400_000;
    let (a, drv) = sim(1, 64 << 30);
    let a = Arc::new(a);
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (a, done) = (a.clone(), done.clone());
        thread::spawn(move || {
            let (mut snapshots, mut wrong) = (0u64, Vec::new());
            while !done.load(Ordering::Relaxed) {
                let s = a.stats(0).unwrap();
                snapshots += 1;
                wrong.extend(inconsistencies(&s).into_iter().map(|w| format!("snapshot {snapshots}: {w}")));
                if snapshots.is_multiple_of(64) {
                    a.reset_peak_stats(0).unwrap();
                }
                if snapshots.is_multiple_of(512) {
                    a.empty_cache(0).unwrap();
                }
                thread::yield_now();
            }
            (snapshots, wrong)
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, drv) = (a.clone(), drv.clone());
            thread::spawn(move || {
                let own = 0x100 * (t + 1);
                let other = 0x100 * ((t + 1) % THREADS + 1);
                let mut rng = 0x51_7cc1_b727_220au64 ^ (t as u64 + 1);
                let mut live: Vec<u64> = Vec::new();
                let mut wrong = Vec::new();
                for i in 0..OPS {
                    let r = xorshift(&mut rng);
                    let stream = if r % 5 == 1 { 0x7000 + 0x10 * ((r >> 40) % 4) as usize } else { own };
                    if i % 256 == 0 {
                        let s = a.stats(0).unwrap();
                        wrong.extend(inconsistencies(&s).into_iter().map(|w| format!("thread {t}, op {i}: {w}")));
                    }
                    if live.len() < 24 && (r % 2 == 0 || live.is_empty()) {
                        let size = if r % 8 == 0 {
                            (r >> 8) as usize % (6 * MIB) + MIB
                        } else {
                            (r >> 8) as usize % 65536 + 1
                        };
                        let p = a.malloc(size, 0, stream).unwrap();
                        // Used on the next thread's stream too: once freed it awaits an event
                        // there (held a quarter of the time), and a later call on this stream
                        // returns it to the pool, moving several statistics in one call.
                        if r % 5 == 0 {
                            a.record_stream(p, other).unwrap();
                        }
                        live.push(p);
                    } else {
                        a.free(live.swap_remove((r >> 8) as usize % live.len())).unwrap();
                    }
                    match i % 4096 {
                        0 => drv.hold_stream(own),
                        1024 => drv.release_stream(own),
                        _ => {}
                    }
                }
                drv.release_stream(own);
                for p in live {
                    a.free(p).unwrap();
                }
                wrong
            })
        })
        .collect();
    let mut wrong = Vec::new();
    for w in workers {
        wrong.extend(w.join().unwrap());
    }
    done.store(true, Ordering::Relaxed);
    let (reader_snapshots, reader_wrong) = reader.join().unwrap();
    let snapshots = reader_snapshots + (THREADS * OPS / 256) as u64;
    wrong.extend(reader_wrong);
    let last = a.stats(0).unwrap();
    assert!(inconsistencies(&last).is_empty(), "{:?}", inconsistencies(&last));
    assert!(
        wrong.is_empty(),
        "{} of {snapshots} snapshots taken during the run were inconsistent; the first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    a.empty_cache(0).unwrap();
    check(&a);
    assert_eq!(drv.used(0), 0);
}

/// The device allocation counters agree with the segment statistics in every snapshot: three
/// threads allocate on 48 streams each (so that a read often meets a stream whose state is
/// being created) while a fourth empties the cache (segments given back, idle streams'
/// state reclaimed) and the test reads the statistics 500 times. Each read must have
/// `num_device_alloc - num_device_free == segment.all.current`, and no more bytes allocated
/// or active than reserved. (Before the device counters were kept in the shards, 9% to 18%
/// of the reads on two cores counted a segment in one and not the other.)
#[test]
fn device_counters_agree_with_segments_in_every_snapshot() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    const READS: usize = 500;
    let (a, _drv) = sim(1, 64 << 30);
    let a = Arc::new(a);
    let done = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicUsize::new(0));
    let mut threads: Vec<_> = (0..3u64)
        .map(|t| {
            let (a, done, ops) = (a.clone(), done.clone(), ops.clone());
            thread::spawn(move || {
                let mut rng = 0x2545_f491_4f6c_dd1du64 ^ (t + 1);
                let mut live: Vec<u64> = Vec::new();
                while !done.load(Ordering::Relaxed) {
                    ops.fetch_add(1, Ordering::Relaxed);
                    let r = xorshift(&mut rng);
                    if live.len() < 8 && r % 2 == 0 {
                        let stream = 0x1000 * (t as usize + 1) + 0x10 * (r >> 32) as usize % 48;
                        let size = if r % 3 == 0 { 4 * MIB } else { 4096 };
                        live.push(a.malloc(size, 0, stream).unwrap());
                    } else if !live.is_empty() {
                        a.free(live.swap_remove((r >> 8) as usize % live.len())).unwrap();
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    threads.push({
        let (a, done) = (a.clone(), done.clone());
        thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                a.empty_cache(0).unwrap();
                thread::yield_now();
            }
        })
    });
    // Each read waits for the threads to have made some calls since the one before, so that
    // reads and calls interleave however the threads are scheduled.
    let mut wrong = Vec::new();
    for i in 0..READS {
        let after = ops.load(Ordering::Relaxed) + 16;
        while ops.load(Ordering::Relaxed) < after {
            thread::yield_now();
        }
        let s = a.stats(0).unwrap();
        let segments = s.num_device_alloc - s.num_device_free;
        if segments != s.segment.all.current {
            wrong.push(format!(
                "read {i}: num_device_alloc {} - num_device_free {} = {segments}, segment.all.current {}",
                s.num_device_alloc, s.num_device_free, s.segment.all.current
            ));
        }
        let reserved = s.reserved_bytes.all.current;
        if s.allocated_bytes.all.current > reserved || s.active_bytes.all.current > reserved {
            wrong.push(format!("read {i}: more allocated or active than reserved: {s:?}"));
        }
    }
    done.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        wrong.is_empty(),
        "{} of {READS} reads were inconsistent; the first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
    a.empty_cache(0).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.segment.all.current, s.num_device_alloc - s.num_device_free, s.reserved_bytes.all.current),
        (0, 0, 0)
    );
    check(&a);
}

/// A device's trace is in time order: four threads on their own streams (two cores, so that
/// they contend for the trace and are preempted) record 360,000 events with the history on, four
/// times over (the trace cleared in between, so that it grows again: a growth holds the trace
/// longest), and each event's `time_us` is at least that of the event before it. (Before the
/// time was read under the trace's lock, each of 12 runs found 4 to 634 events earlier than the
/// one before, by up to 16 ms.)
#[test]
fn trace_events_are_in_time_order() {
    use gpupool::history::{HistoryContext, HistorySettings};
    const PAIRS: usize = 30_000;
    let (a, _drv) = sim(1, 64 << 30);
    let a = Arc::new(a);
    let mut late = Vec::new();
    for round in 0..4 {
        a.record_history(None).unwrap();
        a.record_history(Some(HistorySettings {
            max_entries: 1 << 20,
            context: HistoryContext::None,
            stacks: Default::default(),
        }))
        .unwrap();
        let start = Arc::new(std::sync::Barrier::new(4));
        let threads: Vec<_> = (0..4usize)
            .map(|t| {
                let (a, start) = (a.clone(), start.clone());
                thread::spawn(move || {
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                    start.wait();
                    for _ in 0..PAIRS {
                        let size = (xorshift(&mut rng) % 65536) as usize + 1;
                        let p = a.malloc(size, 0, 0x100 * (t + 1)).unwrap();
                        a.free(p).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let trace = &a.snapshot().unwrap().device_traces[0];
        assert!(trace.len() >= 12 * PAIRS, "round {round}: {} events", trace.len());
        late.extend(trace.windows(2).enumerate().filter(|(_, w)| w[1].time_us < w[0].time_us).map(|(i, w)| {
            format!("round {round}, event {} at {} us after one at {} us", i + 1, w[1].time_us, w[0].time_us)
        }));
    }
    assert!(late.is_empty(), "{} events are earlier than the one before: {:?}", late.len(), &late[..late.len().min(3)]);
}
