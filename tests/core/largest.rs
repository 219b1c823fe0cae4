//! `Allocator::largest_allocatable` (`gpupool_largest_allocatable`) on the simulated device:
//! the answer changes nothing, a request of its size succeeds, and one byte more fails (the
//! answer is exact), in chosen situations (empty device, fragmented cache, memory fraction,
//! expandable segments, blocks on another stream or awaiting events or a synchronisation,
//! `max_split_size`, capture) and after random operation sequences under each configuration.
//!
//! A request changes the state it is asked of (a failure releases the cache), so each check
//! runs on its own allocator built by the same steps, and asks that allocator for its answer.

use crate::common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::sim::{SimDriver, SimOp};
use gpupool::driver::{CaptureMode, DevicePtr, DriverError};
use gpupool::{Allocator, Error};
use proptest::prelude::*;

/// The answer for `stream` on device 0, checked to change nothing: the statistics, the driver
/// calls that allocate, free, map or synchronise, and the invariants stay as they were.
fn ask(a: &Allocator, sim: &SimDriver, stream: usize) -> usize {
    let (stats, calls) = (a.stats(0).unwrap(), sim.counts());
    let answer = a.largest_allocatable(0, stream).unwrap();
    let after = sim.counts();
    assert_eq!(a.stats(0).unwrap(), stats, "asking changed the statistics");
    let moved = |c: gpupool::driver::sim::SimCounts| {
        (c.mem_alloc, c.mem_free, c.mem_create, c.mem_map, c.mem_unmap, c.device_synchronize, c.event_synchronize)
    };
    assert_eq!(moved(after), moved(calls), "asking called the driver for more than figures");
    assert_eq!(answer % 512, 0, "{answer} is not a size round_size keeps");
    check(a);
    answer
}

/// Builds the situation twice with `build`: on the first allocator a request of its answer
/// succeeds, on the second one of its answer plus one byte fails as out of memory. Returns the
/// first answer.
fn exact(build: &dyn Fn() -> (Allocator, Arc<SimDriver>), stream: usize) -> usize {
    let (a, sim) = build();
    let answer = ask(&a, &sim, stream);
    if answer > 0 {
        let p = a.malloc(answer, 0, stream);
        assert!(p.is_ok(), "a request of the answer, {answer} bytes, failed: {p:?}");
        a.free(p.unwrap()).unwrap();
    }
    check(&a);
    let (b, sim) = build();
    let answer_b = ask(&b, &sim, stream);
    match b.malloc(answer_b + 1, 0, stream) {
        Err(Error::OutOfMemory(_)) => {}
        other => panic!("a request of one byte more than the answer, {answer_b} + 1, gave {other:?}"),
    }
    check(&b);
    answer
}

/// `conf` on PyTorch's defaults: ordinary segments unless it says otherwise.
fn config(conf: &str) -> Config {
    Config::pytorch_conf(conf).unwrap()
}

#[test]
fn an_empty_device_answers_its_capacity_and_bad_arguments_are_refused() {
    let build = || sim_with(2, 1 << 30, Config::pytorch());
    assert_eq!(exact(&build, 0), 1 << 30);
    let (a, _) = build();
    let e = a.largest_allocatable(2, 0).unwrap_err();
    assert!(matches!(&e, Error::InvalidValue(m) if m.contains("device 2 is out of range")), "{e:?}");
    assert!(a.devices_in_use().is_empty(), "a refused call started a device");
}

#[test]
fn success_is_not_monotone_in_the_size() {
    // 15 MiB free: 14 MiB takes a 14 MiB segment, 5 MiB a 20 MiB one (PyTorch kLargeBuffer).
    let build = || sim_with(1, 15 * MIB, Config::pytorch());
    assert_eq!(exact(&build, 0), 14 * MIB);
    let (a, _) = build();
    assert!(matches!(a.malloc(5 * MIB, 0, 0), Err(Error::OutOfMemory(_))));
    assert!(a.malloc(MIB, 0, 0).is_ok(), "a small request takes a 2 MiB segment");
}

/// A 60 MiB segment cut into 20 (allocated), 20 (free), 10 (allocated) and 10 MiB (free).
fn fragmented(a: &Allocator) -> Vec<DevicePtr> {
    let p = a.malloc(60 * MIB, 0, 0).unwrap();
    a.free(p).unwrap();
    let q: Vec<DevicePtr> = [20, 20, 10].iter().map(|&m| a.malloc(m * MIB, 0, 0).unwrap()).collect();
    a.free(q[1]).unwrap();
    q
}

#[test]
fn a_fragmented_cache_under_a_memory_fraction_answers_its_largest_free_block() {
    // The fraction leaves 10 MiB to reserve; the split segment releases nothing.
    let build = || {
        let (a, sim) = sim_with(1, 100 * MIB, config("per_process_memory_fraction:0.7"));
        fragmented(&a);
        (a, sim)
    };
    assert_eq!(exact(&build, 0), 20 * MIB);
    // Another stream cannot use those blocks: only the 10 MiB the fraction leaves.
    assert_eq!(exact(&build, 1), 10 * MIB);
    // Without the fraction, the driver's 40 MiB free.
    let build = || {
        let (a, sim) = sim_with(1, 100 * MIB, Config::pytorch());
        fragmented(&a);
        (a, sim)
    };
    assert_eq!(exact(&build, 0), 40 * MIB);
}

#[test]
fn a_memory_fraction_bounds_the_answer() {
    let build = || sim_with(1, 1 << 30, config("per_process_memory_fraction:0.25"));
    assert_eq!(exact(&build, 0), 256 * MIB);
    let (a, sim) = build();
    a.set_memory_fraction(0.0, 0).unwrap();
    assert_eq!(ask(&a, &sim, 0), 0, "nothing may be reserved, nothing is cached");
}

#[test]
fn another_streams_cache_counts_as_what_release_and_retry_gives_back() {
    let build = |free: bool| {
        move || {
            let (a, sim) = sim_with(1, 128 * MIB, Config::pytorch());
            let p = a.malloc(100 * MIB, 0, 1).unwrap();
            if free {
                a.free(p).unwrap();
            }
            (a, sim)
        }
    };
    assert_eq!(exact(&build(false), 0), 28 * MIB);
    assert_eq!(exact(&build(true), 0), 128 * MIB);
    assert_eq!(exact(&build(true), 1), 128 * MIB);
}

#[test]
fn blocks_awaiting_events_or_a_synchronisation_count_once_waited_for() {
    // Freed while stream 7 still uses it: free once release-and-retry has waited.
    let held = || {
        let (a, sim) = sim_with(1, 128 * MIB, Config::pytorch());
        let p = a.malloc(100 * MIB, 0, 1).unwrap();
        a.record_stream(p, 7).unwrap();
        sim.hold_stream(7);
        a.free(p).unwrap();
        (a, sim)
    };
    assert_eq!(exact(&held, 1), 128 * MIB);
    // Its event has completed: returned before the first attempt, it serves from the cache.
    let (a, sim) = held();
    sim.release_stream(7);
    assert_eq!(ask(&a, &sim, 1), 128 * MIB);
    let deferred = || {
        let (a, sim) = sim_with(1, 30 * MIB, Config::pytorch());
        let p = a.malloc(20 * MIB, 0, 0).unwrap();
        a.free_after_device_sync(p).unwrap();
        (a, sim)
    };
    assert_eq!(exact(&deferred, 0), 30 * MIB);
}

#[test]
fn what_the_first_attempts_find_counts_where_release_and_retry_would_serve_less() {
    // 21 MiB segments for requests of 1 to 10 MiB, on a 21 MiB device: a 21 MiB cached block
    // serves 21 MiB, but once released, 21 MiB needs a 22 MiB segment and 20 MiB is the most.
    let build = |how: &'static str| {
        move || {
            let (a, sim) = sim_with(1, 21 * MIB, config("large_segment_size_mb:21"));
            let p = a.malloc(5 * MIB, 0, 1).unwrap();
            if how == "sync" {
                a.free_after_device_sync(p).unwrap();
                return (a, sim);
            }
            a.record_stream(p, 7).unwrap();
            sim.hold_stream(7);
            a.free(p).unwrap();
            if how == "completed" {
                sim.release_stream(7);
            }
            (a, sim)
        }
    };
    // Its event has completed: `process_events` returns it before the first attempt.
    assert_eq!(exact(&build("completed"), 1), 21 * MIB);
    // Still pending: free only once release-and-retry has waited, and released.
    assert_eq!(exact(&build("pending"), 1), 20 * MIB);
    // Awaiting a synchronisation: free after the one before release-and-retry.
    assert_eq!(exact(&build("sync"), 1), 21 * MIB);
}

#[test]
fn expandable_segments_count_free_pages_and_unmapped_room() {
    // A 32 MiB range (an eighth of the device) holding 10 MiB allocated, then 10 MiB free and
    // 12 MiB unmapped; the fraction leaves 12 MiB to map. 22 MiB fits the run after the
    // allocated block by mapping its 12 unmapped MiB; 24 MiB would need a new range. 2 MiB
    // pages for every request (the proptest below covers large pages).
    let build = || {
        let conf = config("expandable_segments:True,per_process_memory_fraction:0.125");
        let (a, sim) = sim_with(1, 256 * MIB, Config { expandable_large_pages: false, ..conf });
        let _keep = a.malloc(10 * MIB, 0, 0).unwrap();
        let b = a.malloc(10 * MIB, 0, 0).unwrap();
        a.free(b).unwrap();
        (a, sim)
    };
    assert_eq!(exact(&build, 0), 22 * MIB);
    // Another stream: its own new range, within the 12 MiB, or 22 once the free pages are
    // unmapped by release-and-retry.
    assert_eq!(exact(&build, 1), 22 * MIB);
    let (a, sim) =
        sim_with(1, 256 * MIB, Config { expandable_large_pages: false, ..config("expandable_segments:True") });
    let _keep = a.malloc(10 * MIB, 0, 0).unwrap();
    assert_eq!(ask(&a, &sim, 0), 246 * MIB);
}

#[test]
fn an_oversize_cached_block_serves_only_requests_near_its_size() {
    // 200 MiB device, max_split_size 40 MiB: a cached 100 MiB block serves 81 to 100 MiB;
    // 10 MiB free on the driver, 110 MiB once the block is released.
    let build = || {
        let (a, sim) = sim_with(1, 200 * MIB, config("max_split_size_mb:40"));
        let p = a.malloc(100 * MIB, 0, 0).unwrap();
        let _keep = a.malloc(90 * MIB, 0, 0).unwrap();
        a.free(p).unwrap();
        (a, sim)
    };
    assert_eq!(exact(&build, 0), 110 * MIB);
}

#[test]
fn a_capturing_stream_counts_its_cached_blocks_only() {
    let (a, sim) = sim_with(1, 1 << 30, Config::pytorch());
    let p = a.malloc(20 * MIB, 0, 5).unwrap();
    a.free(p).unwrap();
    sim.begin_capture(5, CaptureMode::Relaxed).unwrap();
    assert_eq!(ask(&a, &sim, 5), 20 * MIB);
    assert!(a.malloc(20 * MIB, 0, 5).is_ok());
    assert!(matches!(a.malloc(20 * MIB + 1, 0, 5), Err(Error::Capture(_))));
    assert!(sim.end_capture(5).unwrap(), "asking broke the capture");
}

#[test]
fn a_failing_or_panicking_driver_call_changes_nothing() {
    // A 100 MiB block freed while stream 7 still uses it, its event completed: asking queries it.
    let (a, sim) = sim_with(1, 128 * MIB, Config::pytorch());
    let p = a.malloc(100 * MIB, 0, 1).unwrap();
    a.record_stream(p, 7).unwrap();
    a.free(p).unwrap();
    let (answer, stats) = (ask(&a, &sim, 1), a.stats(0).unwrap());
    let doing = [
        (SimOp::MemInfo, "reading the device's free memory"),
        (SimOp::StreamGetCaptureInfo, "asking whether the stream captures"),
        (SimOp::EventQuery, "querying the events of freed blocks"),
    ];
    for (op, what) in doing {
        // Out of memory in a call that allocates nothing is a CUDA error, not an answer.
        sim.inject_fault(op, 0, DriverError::OutOfMemory);
        let e = a.largest_allocatable(0, 1).unwrap_err();
        assert!(matches!(&e, Error::Cuda(m) if m.contains(what)), "{op:?}: {e:?}");
        sim.inject_panic(op, 0);
        let r = catch_unwind(AssertUnwindSafe(|| a.largest_allocatable(0, 1)));
        assert!(r.is_err(), "{op:?}: the injected panic was not raised");
        assert_eq!(sim.pending_faults(), 0, "{op:?}: not called");
        assert_eq!(a.stats(0).unwrap(), stats, "{op:?}");
        check(&a);
        assert_eq!(ask(&a, &sim, 1), answer, "{op:?}");
    }
}

#[derive(Clone, Debug)]
enum Op {
    Malloc { size: usize, stream: usize },
    Free { pick: usize },
    FreeAfterSync { pick: usize },
    RecordStream { pick: usize },
    Hold,
    Release,
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1usize..=MIB, MIB..12 * MIB, 12 * MIB..80 * MIB];
    prop_oneof![
        6 => (size, 0usize..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::FreeAfterSync { pick }),
        1 => any::<usize>().prop_map(|pick| Op::RecordStream { pick }),
        1 => Just(Op::Hold),
        1 => Just(Op::Release),
        1 => Just(Op::EmptyCache),
    ]
}

/// The configurations the sequences run under.
const CONFS: [&str; 9] = [
    "",
    "max_split_size_mb:40",
    "expandable_segments:True",
    "per_process_memory_fraction:0.6",
    "roundup_power2_divisions:4",
    "expandable_segments:True,per_process_memory_fraction:0.5",
    "large_segment_size_mb:16,max_split_size_mb:24,max_non_split_rounding_mb:16",
    "per_process_memory_fraction:0.8,garbage_collection_threshold:0.5",
    "large_segment_size_mb:21",
];

/// An allocator of `capacity` bytes under `conf` after `ops` (failures ignored). Stream 7,
/// which `RecordStream` names, is held and released by `Hold` and `Release`.
fn replay(conf: &str, pages: (bool, bool, usize), capacity: usize, ops: &[Op]) -> (Allocator, Arc<SimDriver>) {
    let (expandable_reclaim, expandable_large_pages, expandable_pages_per_request) = pages;
    let config = Config { expandable_reclaim, expandable_large_pages, expandable_pages_per_request, ..config(conf) };
    let (a, sim) = sim_with(1, capacity, config);
    let mut live: Vec<DevicePtr> = Vec::new();
    for op in ops {
        match *op {
            Op::Malloc { size, stream } => live.extend(a.malloc(size, 0, stream)),
            Op::Free { pick } if !live.is_empty() => a.free(live.swap_remove(pick % live.len())).unwrap(),
            Op::FreeAfterSync { pick } if !live.is_empty() => {
                a.free_after_device_sync(live.swap_remove(pick % live.len())).unwrap();
            }
            Op::RecordStream { pick } if !live.is_empty() => a.record_stream(live[pick % live.len()], 7).unwrap(),
            Op::Hold => sim.hold_stream(7),
            Op::Release => sim.release_stream(7),
            Op::EmptyCache => a.empty_cache(0).unwrap(),
            _ => {}
        }
    }
    (a, sim)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_answer_is_exact_after_any_sequence(
        ops in proptest::collection::vec(op(), 0..40),
        conf in 0..CONFS.len(),
        reclaim in any::<bool>(),
        large_pages in any::<bool>(),
        // 2 pages a request: the ladder's larger pages from 40 MiB on.
        per_request in prop_oneof![Just(0usize), Just(2), Just(16)],
        capacity in prop_oneof![Just(64 * MIB), Just(200 * MIB), Just(512 * MIB)],
        stream in 0usize..4,
    ) {
        exact(&|| replay(CONFS[conf], (reclaim, large_pages, per_request), capacity, &ops), stream);
    }
}
