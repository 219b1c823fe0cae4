//! Pinned host memory (`gpupool::host`, PyTorch's caching host allocator) on the simulated
//! device: rounding, reuse only after the recorded events, statistics, empty_cache, the
//! backings of the `pinned_*` keys, deferred frees, and a model of the reuse rule (its proptest
//! stays here, where tests/proptest-regressions/caching.txt is keyed). Bad input and driver
//! faults are in `caching_faults.rs`, threads in `caching_threads.rs`.

use gpupool::Error;
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};

use crate::support::{COPY, host, host_with};

#[test]
fn sizes_round_to_powers_of_two_each_with_its_own_cache() {
    let (h, sim) = host();
    assert_eq!(h.malloc(0).unwrap(), 0, "size 0 gives NULL, as PyTorch");
    let a = h.malloc(1000).unwrap();
    assert_eq!(h.block_size(a), Some(1024));
    let b = h.malloc(1025).unwrap();
    assert_eq!(h.block_size(b), Some(2048));
    let c = h.malloc(1).unwrap();
    assert_eq!(h.block_size(c), Some(1));
    assert!(sim.is_pinned(a, 1024) && sim.is_pinned(b, 2048) && sim.is_pinned(c, 1));
    h.free(a).unwrap();
    // Any request that rounds to 1024 takes the cached block; one of another class does not.
    let d = h.malloc(513).unwrap();
    assert_eq!(d, a);
    let e = h.malloc(512).unwrap();
    assert_ne!(e, a);
    assert_eq!(h.block_size(e), Some(512));
    assert_eq!(sim.counts().host_alloc, 4, "a, b, c and e pinned new memory; d was a hit");
    assert!(matches!(h.malloc(usize::MAX), Err(Error::InvalidValue(_))));
    assert!(matches!(h.malloc((1 << 63) + 1), Err(Error::InvalidValue(_))));
    for p in [b, c, d, e] {
        h.free(p).unwrap();
    }
    h.check_invariants();
}

#[test]
fn a_block_is_reused_only_after_the_events_of_its_streams_completed() {
    let (h, sim) = host();
    sim.hold_stream(COPY);
    let p = h.malloc(64 << 10).unwrap();
    h.record_event(p, COPY).unwrap();
    h.record_event(p, COPY).unwrap(); // named twice: one event
    let before = sim.counts();
    h.free(p).unwrap();
    assert_eq!(sim.counts().event_record - before.event_record, 1);
    let q = h.malloc(64 << 10).unwrap();
    assert_ne!(q, p, "the copy on the held stream may still read p");
    let st = h.stats();
    assert_eq!(st.active_requests.current, 2, "p counts as active until its event completes");
    h.check_invariants();
    sim.release_stream(COPY);
    let r = h.malloc(64 << 10).unwrap();
    assert_eq!(r, p, "the event completed: p is reused");
    // Events are pooled: the next free on the stream reuses the one created above.
    h.record_event(r, COPY).unwrap();
    let created = sim.counts().event_create;
    h.free(r).unwrap();
    assert_eq!(sim.counts().event_create, created);
    h.free(q).unwrap();
    h.check_invariants();
}

#[test]
fn events_of_several_streams_all_complete_before_reuse() {
    let (h, sim) = host();
    let (s1, s2) = (0x100, 0x200);
    sim.hold_stream(s1);
    sim.hold_stream(s2);
    let p = h.malloc(4096).unwrap();
    h.record_event(p, s1).unwrap();
    h.record_event(p, s2).unwrap();
    h.free(p).unwrap();
    sim.release_stream(s1);
    let q = h.malloc(4096).unwrap();
    assert_ne!(q, p, "s2 still uses p");
    sim.release_stream(s2);
    let r = h.malloc(4096).unwrap();
    assert_eq!(r, p);
    h.free(q).unwrap();
    h.free(r).unwrap();
    h.check_invariants();
}

#[test]
fn statistics_follow_pytorch_host_stats() {
    let (h, sim) = host();
    let a = h.malloc(3000).unwrap(); // 4096
    let b = h.malloc(5000).unwrap(); // 8192
    h.free(a).unwrap();
    let c = h.malloc(4000).unwrap(); // a again
    assert_eq!(c, a);
    let st = h.stats();
    assert_eq!((st.active_requests.current, st.active_requests.peak), (2, 2));
    assert_eq!((st.active_bytes.current, st.active_bytes.peak), (4096 + 8192, 4096 + 8192));
    assert_eq!((st.active_requests.allocated, st.active_requests.freed), (3, 1));
    assert_eq!((st.allocations.current, st.allocated_bytes.current), (2, 4096 + 8192));
    assert_eq!((st.num_host_alloc, st.num_host_free), (2, 0));
    assert_eq!(st.host_alloc_time.count, 2);
    h.free(b).unwrap();
    h.free(c).unwrap();
    h.reset_peak_stats();
    let st = h.stats();
    assert_eq!((st.active_requests.current, st.active_requests.peak), (0, 0));
    assert_eq!(st.allocations.peak, 2, "the blocks are still cached");
    h.empty_cache().unwrap();
    let st = h.stats();
    assert_eq!((st.allocations.current, st.allocated_bytes.current), (0, 0));
    assert_eq!((st.num_host_alloc, st.num_host_free, st.host_free_time.count), (2, 2, 2));
    assert_eq!(sim.live_host(), (0, 0));
    h.check_invariants();
}

#[test]
fn empty_cache_releases_free_blocks_only() {
    let (h, sim) = host();
    sim.hold_stream(COPY);
    let used = h.malloc(1 << 20).unwrap();
    let waiting = h.malloc(1 << 20).unwrap();
    let free = h.malloc(1 << 20).unwrap();
    h.record_event(waiting, COPY).unwrap();
    h.free(waiting).unwrap();
    h.free(free).unwrap();
    let events_before = sim.live_events();
    h.empty_cache().unwrap();
    assert_eq!(sim.live_host(), (2, 0), "the block in use and the one awaiting its event stay");
    assert!(!h.owns(free) && h.owns(used) && h.owns(waiting));
    assert_eq!(sim.live_events(), events_before, "the pending event stays");
    sim.release_stream(COPY);
    h.empty_cache().unwrap();
    assert_eq!(sim.live_host(), (1, 0));
    assert_eq!(sim.live_events(), 0, "pooled events are destroyed");
    h.free(used).unwrap();
    h.empty_cache().unwrap();
    assert_eq!(sim.live_host(), (0, 0));
    h.check_invariants();
}

#[test]
fn host_register_backs_blocks_when_configured() {
    let config = Config { pinned_use_cuda_host_register: true, pinned_num_register_threads: 4, ..Config::default() };
    let (h, sim) = host_with(config);
    let p = h.malloc(1 << 20).unwrap();
    // The pages were touched (written) before registration, and the memory is usable.
    unsafe { std::ptr::write_bytes(p as *mut u8, 0x5a, 1 << 20) };
    assert!(sim.is_pinned(p, 1 << 20));
    assert_eq!((sim.counts().host_alloc, sim.counts().host_register), (0, 1));
    assert_eq!(p % 4096, 0);
    h.free(p).unwrap();
    h.empty_cache().unwrap();
    assert_eq!(sim.counts().host_unregister, 1);
    assert_eq!(sim.live_host(), (0, 0));
    // A failed registration gives the memory back and reports the driver's error.
    sim.inject(SimOp::HostRegister, 0, SimFault::Fail(DriverError::OutOfMemory));
    assert!(matches!(h.malloc(4096), Err(Error::OutOfMemory(_))));
    assert_eq!(h.stats().allocations.current, 0);
    h.check_invariants();
}

#[test]
fn the_reserve_segment_serves_the_first_misses_and_is_never_released() {
    let config = Config { pinned_reserve_segment_size: 1 << 20, ..Config::default() };
    let (h, sim) = host_with(config);
    let a = h.malloc(100).unwrap(); // 128 bytes, carved as a page
    let b = h.malloc(256 << 10).unwrap();
    assert_eq!(b, a + 4096, "carved one after the other, 4 KiB aligned");
    assert_eq!(sim.counts().host_alloc, 1, "one segment pinned for both");
    let c = h.malloc(1 << 20).unwrap(); // no room left
    assert_eq!(sim.counts().host_alloc, 2);
    assert!(c < a || c >= a + (1 << 20));
    for p in [a, b, c] {
        h.free(p).unwrap();
    }
    h.empty_cache().unwrap();
    assert_eq!(sim.counts().host_free, 1, "only c's memory goes back");
    assert_eq!(h.malloc(128).unwrap(), a, "the reserve's blocks stay cached");
    h.check_invariants();
}
#[test]
fn deferred_frees_wait_for_a_device_synchronisation() {
    let (h, sim) = host();
    let p = h.malloc(4096).unwrap();
    assert_eq!(h.free_after_device_sync(p, 1).unwrap(), 4096);
    assert!(matches!(h.free(p), Err(Error::InvalidPointer(_))), "freed already");
    let syncs = sim.counts().device_synchronize;
    let q = h.malloc(8192).unwrap(); // another class: no reason to wait
    assert_eq!(sim.counts().device_synchronize, syncs);
    // A miss of p's class synchronises the device and takes p.
    let r = h.malloc(4096).unwrap();
    assert_eq!(r, p);
    assert_eq!(sim.counts().device_synchronize, syncs + 1);
    let d = h.deferred();
    assert_eq!((d.blocks, d.bytes, d.syncs, d.released), (0, 0, 1, 1));
    h.free(q).unwrap();
    h.free(r).unwrap();
    h.check_invariants();
}
mod model {
    //! Random sequences of host calls against a model of what may not be reused: a block freed
    //! after a record on a held stream stays out of reach until that stream is released. The
    //! invariant checker runs after every step; faults are injected into the calls whose
    //! failure must not weaken that rule.
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Malloc { size: usize },
        Free { pick: usize },
        BadFree { pick: usize, offset: usize },
        Record { pick: usize, stream: usize },
        Hold { stream: usize },
        Release { stream: usize },
        EmptyCache,
        Inject { kind: usize, skip: u32 },
    }

    /// Faults that may fire without loosening the reuse rule (a failed event create or record
    /// falls back to a device synchronisation, which the simulated device cannot model).
    const FAULTS: [SimOp; 6] = [
        SimOp::HostAlloc,
        SimOp::HostFree,
        SimOp::EventQuery,
        SimOp::StreamDevice,
        SimOp::HostRegister,
        SimOp::HostUnregister,
    ];

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (1usize..(4 << 20)).prop_map(|size| Op::Malloc { size }),
            5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
            1 => (any::<usize>(), 1usize..64).prop_map(|(pick, offset)| Op::BadFree { pick, offset }),
            4 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Op::Record { pick, stream }),
            2 => (0usize..3).prop_map(|stream| Op::Hold { stream }),
            2 => (0usize..3).prop_map(|stream| Op::Release { stream }),
            1 => Just(Op::EmptyCache),
            1 => (0..FAULTS.len(), 0u32..4).prop_map(|(kind, skip)| Op::Inject { kind, skip }),
        ]
    }

    fn run(ops: Vec<Op>, register: bool) {
        let config = Config { pinned_use_cuda_host_register: register, ..Config::default() };
        let (h, sim) = host_with(config);
        let streams = [0x100usize, 0x200, 0x300];
        let mut held = [false; 3];
        // Live blocks: (ptr, size, streams recorded, cookie).
        let mut live: Vec<(usize, usize, HashSet<usize>, u64)> = Vec::new();
        // Freed blocks still read by held streams: (ptr, size, the held streams).
        let mut busy: Vec<(usize, usize, HashSet<usize>)> = Vec::new();
        let mut freed: Vec<usize> = Vec::new();
        let mut cookie = 1u64;
        for op in ops {
            match op {
                Op::Malloc { size } => {
                    if let Ok(p) = h.malloc(size) {
                        let rounded = h.block_size(p).expect("allocated");
                        let want = gpupool::host::rounded_size(size).unwrap();
                        // Its class, or a cached block of a larger class at most 5% over.
                        assert!(
                            rounded == want || (rounded > want && rounded - size <= size / 20),
                            "{size} got {rounded}"
                        );
                        for &(q, qs, _) in &busy {
                            assert!(p + rounded <= q || q + qs <= p, "{p:#x} reused while a held stream reads {q:#x}");
                        }
                        for &(q, qs, _, _) in &live {
                            assert!(p + rounded <= q || q + qs <= p, "{p:#x} overlaps live {q:#x}");
                        }
                        // SAFETY: the block holds at least 8 bytes (sizes from 1 round up, and
                        // the write is skipped below 8).
                        if rounded >= 8 {
                            unsafe { (p as *mut u64).write(cookie) };
                        }
                        live.push((p, rounded, HashSet::new(), cookie));
                        freed.retain(|&f| f != p);
                        cookie += 1;
                    }
                }
                Op::Free { pick } if !live.is_empty() => {
                    let (p, size, recorded, c) = live.swap_remove(pick % live.len());
                    if size >= 8 {
                        assert_eq!(unsafe { (p as *const u64).read() }, c, "a live block was overwritten");
                    }
                    h.free(p).unwrap();
                    let holding: HashSet<usize> = recorded.into_iter().filter(|&s| held[s]).collect();
                    if !holding.is_empty() {
                        busy.push((p, size, holding));
                    }
                    freed.push(p);
                }
                Op::Free { .. } => {}
                Op::BadFree { pick, offset } => {
                    let before = h.stats();
                    if let Some(&(p, size, _, _)) = live.get(pick % live.len().max(1)) {
                        if offset < size {
                            assert!(matches!(h.free(p + offset), Err(Error::InvalidPointer(_))));
                        }
                    }
                    if let Some(&p) = freed.get(pick % freed.len().max(1)) {
                        assert!(matches!(h.free(p), Err(Error::InvalidPointer(_))));
                    }
                    assert_eq!(h.stats(), before, "a refused free changed something");
                }
                Op::Record { pick, stream } if !live.is_empty() => {
                    let n = live.len();
                    let entry = &mut live[pick % n];
                    if h.record_event(entry.0, streams[stream]).is_ok() {
                        entry.2.insert(stream);
                    }
                }
                Op::Record { .. } => {}
                Op::Hold { stream } => {
                    sim.hold_stream(streams[stream]);
                    held[stream] = true;
                }
                Op::Release { stream } => {
                    sim.release_stream(streams[stream]);
                    held[stream] = false;
                    for b in &mut busy {
                        b.2.remove(&stream);
                    }
                    busy.retain(|b| !b.2.is_empty());
                }
                Op::EmptyCache => {
                    let _ = h.empty_cache();
                }
                Op::Inject { kind, skip } => {
                    sim.inject(FAULTS[kind], skip, SimFault::Fail(DriverError::OutOfMemory));
                }
            }
            h.check_invariants();
        }
        sim.clear_faults();
        for s in streams {
            sim.release_stream(s);
        }
        for (p, ..) in live {
            h.free(p).unwrap();
        }
        h.empty_cache().unwrap();
        h.check_invariants();
        let st = h.stats();
        assert_eq!((st.allocations.current, st.active_requests.current), (0, 0));
        assert_eq!(sim.live_host(), (0, 0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn no_block_is_reused_while_a_held_stream_reads_it(ops in prop::collection::vec(op(), 1..200), register: bool) {
            run(ops, register);
        }
    }
}

#[test]
fn a_miss_polls_past_a_busy_event_before_pinning_new_memory() {
    let (h, sim) = host();
    let (slow, fast) = (0x100, 0x200);
    sim.hold_stream(slow);
    sim.hold_stream(fast);
    let a = h.malloc(4096).unwrap();
    let b = h.malloc(4096).unwrap();
    h.record_event(a, slow).unwrap();
    h.record_event(b, fast).unwrap();
    h.free(a).unwrap(); // the older event, on the stream that stays busy
    h.free(b).unwrap();
    sim.release_stream(fast);
    let pinned = sim.counts().host_alloc;
    assert_eq!(h.malloc(4096).unwrap(), b, "b's copy finished behind a's busy one");
    assert_eq!(sim.counts().host_alloc, pinned);
    sim.release_stream(slow);
    h.check_invariants();
}
