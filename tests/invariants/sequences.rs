//! Random operation sequences on the simulated device, with every invariant checked after every
//! operation: live blocks never overlap and keep their contents, every byte of a segment
//! belongs to one block, statistics (peaks included) equal a recount, reserved equals what the
//! driver handed out, and after freeing everything and `empty_cache` reserved is 0.
//!
//! The same with driver faults: errors and panics (cudarc panics when `libcuda.so.1` lacks a
//! symbol) injected into random calls of every kind. After each operation, whatever it
//! returned or however it unwound, the invariants hold and the driver holds exactly what the
//! allocator counts as reserved; once the faults stop, everything can be freed, the cache
//! emptied, and the memory fraction's whole allowance allocated again. And an allocator that is
//! dropped gives the driver back all its memory and events.
//!
//! With the allocation history on, the same, and after every operation a snapshot that agrees
//! with the statistics and with a replay of the whole trace (faults and panics included: no
//! event for what was undone).
//!
//! The operations include private pools (routes by stream and by thread, release) and CUDA
//! graph captures on the simulated device: gpupool never makes a call that CUDA forbids during
//! capture (the simulated driver counts them), every capture ends valid, and a released pool
//! gives its memory back.

use crate::common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use common::history::{record_all, snapshot_agrees};
use common::{MIB, check, sim, sim_with};
use gpupool::config::Config;
use gpupool::driver::sim::{SIM_PANIC_MARK, SimFault, SimOp};
use gpupool::driver::{CaptureMode, DriverError};
use gpupool::history::HistoryContext;
use gpupool::stats::{DeviceStats, Stat};
use gpupool::{Error, SleepMode};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        size: usize,
        stream: usize,
    },
    Free {
        pick: usize,
    },
    FreeAfterSync {
        pick: usize,
    },
    ReleaseDeferred,
    RecordStream {
        pick: usize,
        stream: usize,
    },
    Hold {
        stream: usize,
    },
    Release {
        stream: usize,
    },
    EmptyCache,
    ResetPeaks,
    /// Routes `stream` to a pool and begins capturing it (global or relaxed mode).
    Capture {
        stream: usize,
        pool: usize,
        global: bool,
    },
    /// Ends the capture under way, and its route.
    EndCapture,
    /// Routes the thread's allocations to a pool (`use_mem_pool`).
    RouteThread {
        pool: usize,
    },
    EndRoutes {
        pool: usize,
    },
    /// Releases a pool; a new one takes its place.
    ReleasePool {
        pool: usize,
    },
    /// Sets the limit of the default pools (0) or of a private pool (1, 2) in MiB; `None`
    /// removes it (`gpupool_pool_set_limit`, issue 43).
    SetLimit {
        pool: usize,
        mib: Option<u64>,
    },
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..4096,
        3 => 4096usize..(1 << 20),
        2 => (1usize << 20)..(12 << 20),
        1 => (12usize << 20)..(48 << 20),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (size(), 0usize..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => any::<usize>().prop_map(|pick| Op::FreeAfterSync { pick }),
        1 => Just(Op::ReleaseDeferred),
        2 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0usize..3).prop_map(|stream| Op::Hold { stream }),
        1 => (0usize..3).prop_map(|stream| Op::Release { stream }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeaks),
        1 => (0usize..3, 0usize..2, any::<bool>()).prop_map(|(stream, pool, global)| Op::Capture { stream, pool, global }),
        1 => Just(Op::EndCapture),
        1 => (0usize..2).prop_map(|pool| Op::RouteThread { pool }),
        1 => (0usize..2).prop_map(|pool| Op::EndRoutes { pool }),
        1 => (0usize..2).prop_map(|pool| Op::ReleasePool { pool }),
        1 => (0usize..3, proptest::option::of(0u64..96)).prop_map(|(pool, mib)| Op::SetLimit { pool, mib }),
    ]
}

/// One field (`current` or `peak`) of every statistic that has a peak, in a fixed order.
fn field(s: &DeviceStats, pick: fn(&Stat) -> i64) -> Vec<i64> {
    let arrays = [
        s.allocation,
        s.segment,
        s.active,
        s.inactive_split,
        s.allocated_bytes,
        s.reserved_bytes,
        s.active_bytes,
        s.inactive_split_bytes,
        s.requested_bytes,
    ];
    let mut v: Vec<i64> =
        arrays.iter().flat_map(|a| [pick(&a.all), pick(&a.small_pool), pick(&a.large_pool)]).collect();
    v.extend([pick(&s.oversize_allocations), pick(&s.oversize_segments)]);
    v
}

fn currents(s: &DeviceStats) -> Vec<i64> {
    field(s, |x| x.current)
}

fn peaks(s: &DeviceStats) -> Vec<i64> {
    field(s, |x| x.peak)
}

/// Stamps a block's first and last bytes with a cookie (the simulated device's memory is host
/// memory), so overlapping live blocks show as a clobbered cookie.
fn stamp(ptr: u64, size: usize, cookie: u64) {
    let p = ptr as *mut u8;
    // SAFETY: `ptr` is a live block of at least `size` bytes of mapped host memory.
    unsafe {
        p.copy_from_nonoverlapping(cookie.to_le_bytes().as_ptr(), size.min(8));
        if size >= 16 {
            p.add(size - 8).copy_from_nonoverlapping(cookie.to_le_bytes().as_ptr(), 8);
        }
    }
}

fn stamped(ptr: u64, size: usize, cookie: u64) -> bool {
    let mut head = [0u8; 8];
    let mut tail = [0u8; 8];
    let n = size.min(8);
    // SAFETY: as in `stamp`.
    unsafe {
        (ptr as *const u8).copy_to_nonoverlapping(head.as_mut_ptr(), n);
        (ptr as *const u8).add(size - n).copy_to_nonoverlapping(tail.as_mut_ptr(), n);
    }
    head[..n] == cookie.to_le_bytes()[..n] && (size < 16 || tail == cookie.to_le_bytes())
}

/// The configuration of a case of `n` operations: gpupool's own options crossed, each on in
/// half the cases (the high-water rule for expandable segments; releasing unused streams'
/// cache before growing past the mark; large requests in ranges of 20 MiB pages).
fn case_config(n: usize, max_split_size: usize, expandable_segments: bool) -> Config {
    Config {
        max_split_size,
        expandable_segments,
        expandable_reclaim: n % 2 == 0,
        release_unused_streams: n % 4 < 2,
        expandable_large_pages: n % 8 < 4,
        ..Config::default()
    }
}

fn run(ops: Vec<Op>, max_split_size: usize, expandable_segments: bool, history: bool) {
    let streams = [0usize, 0x1000, 0x2000];
    let (a, drv) = sim_with(1, 160 * MIB, case_config(ops.len(), max_split_size, expandable_segments));
    if history {
        record_all(&a, HistoryContext::All);
    }
    let mut live: Vec<(u64, usize, u64)> = Vec::new();
    let mut model_peak = currents(&a.stats(0).unwrap());
    let mut cookie = 1u64;
    // Blocks freed with free_after_device_sync since the last device synchronisation: gpupool
    // must not hand them out, so their contents stay as they were.
    let mut deferred: Vec<(u64, usize, u64)> = Vec::new();
    // The second pool is a fallback that never splits (`gpupool_pool_create_ex`): the default
    // pools' out-of-memory requests take its cache.
    let flagged = gpupool::POOL_USE_ON_OOM | gpupool::POOL_NO_SPLIT;
    let create = |i: usize| if i == 1 { a.pool_create_ex(flagged).unwrap() } else { a.pool_create() };
    let mut pools = [create(0), create(1)];
    // The capture under way: its stream, pool index and mode. Meanwhile the program allocates
    // only on the capturing stream, and neither empties the cache nor asks for a device
    // synchronisation: those are its own calls that CUDA forbids (a new segment for another
    // stream, made on this thread, or the out-of-memory path's synchronisation), which gpupool
    // cannot see coming once no route is active (PyTorch's rule too). Nor does it end the
    // capturing pool's routes or release it before the capture ends: gpupool would then give
    // its memory back during the capture, since it asks no stream after the fact (a stream the
    // program destroyed would crash the driver).
    let mut capture: Option<(usize, usize, bool)> = None;
    // The pool this thread's route takes its allocations to, if any (`RouteThread`).
    let mut route: Option<usize> = None;
    for op in ops {
        let before = (a.stats(0).unwrap().num_alloc_retries, drv.counts());
        let mut simple = true;
        match op {
            Op::Malloc { stream, .. } if capture.is_some_and(|c| c.0 != stream) => {}
            Op::EmptyCache | Op::ReleaseDeferred if capture.is_some() => {}
            Op::EndRoutes { pool } | Op::ReleasePool { pool } if capture.is_some_and(|c| c.1 == pool) => {}
            Op::Capture { stream, pool, global }
                if capture.is_none() && a.begin_allocate_to_pool(0, pools[pool], streams[stream]).is_ok() =>
            {
                let mode = if global { CaptureMode::Global } else { CaptureMode::Relaxed };
                drv.begin_capture(streams[stream], mode).unwrap();
                capture = Some((stream, pool, global));
            }
            Op::EndCapture => {
                if let Some((stream, pool, _)) = capture.take() {
                    assert!(drv.end_capture(streams[stream]).unwrap(), "a capture was invalidated");
                    // Every route to the pool ends, this thread's too (as `EndRoutes`).
                    a.end_allocate_to_pool(0, pools[pool]).unwrap();
                    route = route.filter(|&r| r != pool);
                    simple = false;
                }
            }
            Op::RouteThread { pool } if a.begin_allocate_to_pool_thread(0, pools[pool]).is_ok() => {
                route = Some(pool);
            }
            Op::EndRoutes { pool } => {
                let _ = a.end_allocate_to_pool(0, pools[pool]);
                route = route.filter(|&r| r != pool);
                simple = false;
            }
            Op::ReleasePool { pool } => {
                route = route.filter(|&r| r != pool);
                a.release_pool(0, pools[pool]).unwrap();
                pools[pool] = create(pool);
                simple = false;
            }
            Op::SetLimit { pool, mib } => {
                let id = if pool == 0 { 0 } else { pools[pool - 1] };
                a.pool_set_limit(0, id, mib.map(|m| m << 20)).unwrap();
                assert_eq!(a.pool_limit(0, id).unwrap(), mib.map(|m| m << 20));
            }
            Op::Malloc { size, stream } => {
                let fallbacks =
                    |a: &gpupool::Allocator| a.pool_stats(0, pools[1]).unwrap().stats.allocation.all.allocated;
                let before = fallbacks(&a);
                let r = a.malloc(size, 0, streams[stream]);
                let routed = capture.filter(|c| c.0 == stream).map(|c| c.1).or(route);
                // A default-pool request the fallback pool served went through the states of
                // the growth it tried first (an expandable segment made and given back, say),
                // which this model cannot see: its peaks may only be higher.
                if routed != Some(1) && fallbacks(&a) > before {
                    simple = false;
                }
                if let Ok(p) = r {
                    cookie += 1;
                    stamp(p, size, cookie);
                    live.push((p, size, cookie));
                }
            }
            Op::Free { pick } if !live.is_empty() => {
                let (p, size, c) = live.swap_remove(pick % live.len());
                assert!(stamped(p, size, c), "block {p:#x} was overwritten while live");
                a.free(p).unwrap();
            }
            Op::FreeAfterSync { pick } if !live.is_empty() => {
                let (p, size, c) = live.swap_remove(pick % live.len());
                a.free_after_device_sync(p).unwrap();
                deferred.push((p, size, c));
            }
            Op::ReleaseDeferred => {
                a.release_deferred(0).unwrap();
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                a.record_stream(live[pick % live.len()].0, streams[stream]).unwrap();
            }
            Op::Hold { stream } => drv.hold_stream(streams[stream]),
            Op::Release { stream } => drv.release_stream(streams[stream]),
            Op::EmptyCache => {
                a.empty_cache(0).unwrap();
                simple = false;
            }
            Op::ResetPeaks => {
                a.reset_peak_stats(0).unwrap();
                model_peak = currents(&a.stats(0).unwrap());
            }
            _ => {}
        }
        check(&a);
        assert_eq!(drv.counts().capture_violations, 0, "gpupool made a call CUDA forbids during capture");
        if history {
            snapshot_agrees(&a, true);
        }
        let s = a.stats(0).unwrap();
        for (m, c) in model_peak.iter_mut().zip(currents(&s)) {
            *m = (*m).max(c);
        }
        // A call that processed events or released the cache passes through states between
        // its start and end, which PyTorch's peaks count too and this model cannot see: there
        // the peak may only be higher; elsewhere it must be exact.
        let counts = drv.counts();
        if counts.device_synchronize != before.1.device_synchronize {
            deferred.clear();
            simple = false;
        }
        for &(p, size, c) in &deferred {
            assert!(stamped(p, size, c), "block {p:#x} was handed out before the device synchronisation");
        }
        simple &= s.num_alloc_retries == before.0
            && counts.event_query == before.1.event_query
            && counts.event_synchronize == before.1.event_synchronize;
        if simple {
            assert_eq!(peaks(&s), model_peak, "peaks differ from the running maximum of a recount");
        } else {
            for (p, m) in peaks(&s).iter().zip(&model_peak) {
                assert!(p >= m, "a peak ({p}) is below a value the statistic had ({m})");
            }
            model_peak = peaks(&s);
        }
        // The driver holds reserved bytes and the pages held unmapped, nothing else.
        let physical = (s.reserved_bytes.all.current + s.unmapped_held_bytes.current) as usize;
        assert_eq!(physical, drv.used(0), "reserved and held pages differ from what the driver holds");
    }
    if let Some((stream, _, _)) = capture {
        assert!(drv.end_capture(streams[stream]).unwrap(), "a capture was invalidated");
    }
    for pool in pools {
        a.release_pool(0, pool).unwrap();
    }
    for (p, size, c) in live.drain(..) {
        assert!(stamped(p, size, c), "block {p:#x} was overwritten while live");
        a.free(p).unwrap();
    }
    for s in streams {
        drv.release_stream(s);
    }
    a.empty_cache(0).unwrap();
    check(&a);
    let s = a.stats(0).unwrap();
    assert_eq!((s.reserved_bytes.all.current, s.active.all.current, drv.used(0)), (0, 0, 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_after_every_operation(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, usize::MAX, false, false);
    }

    #[test]
    fn invariants_hold_with_expandable_segments(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, usize::MAX, true, false);
    }

    #[test]
    fn invariants_hold_with_max_split_size(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, 24 * MIB, false, false);
    }

    #[test]
    fn invariants_hold_with_history_on(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, 24 * MIB, true, true);
    }
}

// ---- Driver faults and panics ------------------------------------------------------------

const CAPACITY: usize = 160 * MIB;

#[derive(Clone, Debug)]
enum Fault {
    Cuda,
    OutOfMemory,
    MissingSymbol,
    Panic,
}

#[derive(Clone, Debug)]
enum FaultOp {
    Plain(Op),
    /// A malloc on the current device (-1), which asks the driver which device is current.
    MallocCurrent {
        size: usize,
    },
    /// Sets the run's memory fraction again (reads the device's total: `cuMemGetInfo`).
    SetFraction,
    /// Puts the default pools to sleep (offload, staged or `pinned`, or discard) and wakes them,
    /// the faults armed; then, if they still sleep, wakes them with the faults cleared.
    SleepWake {
        discard: bool,
        pinned: bool,
    },
    Inject {
        kind: usize,
        skip: u32,
        fault: Fault,
    },
    /// Puts the default pools to sleep with offload (`pinned` or staged), the faults cleared,
    /// while a live block (`pick`) is freed and the cache emptied between the sleep's copies and
    /// its unmapping (a hook at the copies' synchronisation), then wakes them: every other
    /// block keeps its bytes.
    SleepRace {
        pick: usize,
        pinned: bool,
    },
}

fn fault_op() -> impl Strategy<Value = FaultOp> {
    let fault = prop_oneof![
        2 => Just(Fault::Cuda),
        1 => Just(Fault::OutOfMemory),
        1 => Just(Fault::MissingSymbol),
        2 => Just(Fault::Panic),
    ];
    prop_oneof![
        12 => op().prop_map(FaultOp::Plain),
        1 => size().prop_map(|size| FaultOp::MallocCurrent { size }),
        1 => Just(FaultOp::SetFraction),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(discard, pinned)| FaultOp::SleepWake { discard, pinned }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, pinned)| FaultOp::SleepRace { pick, pinned }),
        3 => (0..SimOp::ALL.len(), 0u32..6, fault).prop_map(|(kind, skip, fault)| FaultOp::Inject { kind, skip, fault }),
    ]
}

/// Keeps the default panic hook quiet about the panics the simulated device injects (each is
/// caught and expected); every other panic is reported as usual.
fn quiet_injected_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !msg.ends_with(SIM_PANIC_MARK) {
                default(info);
            }
        }));
    });
}

/// How an allocator call ended: its result, or `None` when it panicked.
fn guarded<T>(f: impl FnOnce() -> Result<T, Error>) -> Option<Result<T, Error>> {
    catch_unwind(AssertUnwindSafe(f)).ok()
}

/// Every statistic's current is at most its peak, and the aggregate peak at most the sum of
/// the pools' peaks (the aggregate is always the sum of the pools).
fn peaks_are_consistent(s: &DeviceStats) {
    for (c, p) in currents(s).iter().zip(peaks(s)) {
        assert!(*c <= p, "a current value ({c}) is above its peak ({p})");
    }
    let p = peaks(s);
    for k in 0..9 {
        assert!(
            p[3 * k] <= p[3 * k + 1] + p[3 * k + 2],
            "statistic {k}: all.peak {} > small {} + large {}",
            p[3 * k],
            p[3 * k + 1],
            p[3 * k + 2]
        );
    }
}

fn run_with_faults(
    ops: Vec<FaultOp>,
    max_split_size: usize,
    fraction: Option<f64>,
    expandable_segments: bool,
    history: bool,
) {
    quiet_injected_panics();
    let streams = [0usize, 0x1000, 0x2000];
    // A third of the cases collect garbage (it acts only under a memory fraction).
    let garbage_collection_threshold = if ops.len() % 3 == 0 { 0.5 } else { 0.0 };
    let config = Config { garbage_collection_threshold, ..case_config(ops.len(), max_split_size, expandable_segments) };
    let (a, drv) = sim_with(1, CAPACITY, config);
    // Shared with the hooks of `SleepRace`, which call it from inside a sleep.
    let a = std::sync::Arc::new(a);
    if history {
        record_all(&a, HistoryContext::All);
    }
    let fraction_or_all = fraction.unwrap_or(1.0);
    a.set_memory_fraction(fraction_or_all, 0).unwrap();
    let mut live: Vec<(u64, usize, u64)> = Vec::new();
    let mut deferred: Vec<(u64, usize, u64)> = Vec::new();
    let mut cookie = 1u64;
    for op in ops {
        match op {
            FaultOp::Inject { kind, skip, fault } => {
                let kind = SimOp::ALL[kind];
                let fault = match fault {
                    Fault::Cuda => SimFault::Fail(DriverError::Cuda {
                        call: kind.symbol(),
                        code: 999,
                        name: "CUDA_ERROR_UNKNOWN".into(),
                    }),
                    Fault::OutOfMemory => SimFault::Fail(DriverError::OutOfMemory),
                    Fault::MissingSymbol => SimFault::MissingSymbol,
                    Fault::Panic => SimFault::Panic,
                };
                drv.inject(kind, skip, fault);
            }
            FaultOp::SetFraction => {
                let _ = guarded(|| a.set_memory_fraction(fraction_or_all, 0));
            }
            FaultOp::SleepWake { discard, pinned } => {
                let mode = match (discard, pinned) {
                    (true, _) => SleepMode::Discard,
                    (false, false) => SleepMode::Offload,
                    (false, true) => SleepMode::OffloadPinned,
                };
                let _ = guarded(|| a.sleep(0, 0, mode));
                check(&a);
                let woke = guarded(|| a.wake(0, 0));
                check(&a);
                // Still asleep (unless a driver call unwound once the pool was awake): woken
                // with the faults cleared, so that the blocks can be read.
                if !matches!(woke, Some(Ok(()) | Err(Error::InvalidValue(_)))) {
                    drv.clear_faults();
                    match a.wake(0, 0) {
                        Ok(()) => {}
                        Err(Error::InvalidValue(m)) if woke.is_none() && m.contains("do not sleep") => {}
                        Err(e) => panic!("a wake without faults failed: {e}"),
                    }
                }
                if discard {
                    for &(p, size, c) in &live {
                        stamp(p, size, c);
                    }
                }
            }
            FaultOp::SleepRace { pick, pinned } => {
                drv.clear_faults();
                let victim = (!live.is_empty()).then(|| live.swap_remove(pick % live.len()));
                if let Some((p, size, c)) = victim {
                    assert!(stamped(p, size, c), "block {p:#x} was overwritten while live");
                    let a2 = a.clone();
                    drv.on_call(SimOp::StreamSynchronize, 0, move || {
                        a2.free(p).unwrap();
                        a2.empty_cache(0).unwrap();
                    });
                }
                let mode = if pinned { SleepMode::OffloadPinned } else { SleepMode::Offload };
                match a.sleep(0, 0, mode) {
                    Ok(()) => {
                        check(&a);
                        a.wake(0, 0).unwrap();
                    }
                    // Ordinary segments (the case's configuration, or a fallback) cannot sleep.
                    Err(Error::InvalidValue(_)) => {}
                    Err(e) => panic!("a sleep without faults failed: {e}"),
                }
                check(&a);
                // The hook runs only when the sleep copies something; otherwise the block is
                // freed here.
                if drv.clear_hooks() > 0
                    && let Some((p, _, _)) = victim
                {
                    a.free(p).unwrap();
                }
            }
            FaultOp::MallocCurrent { size } => {
                if let Some(Ok(p)) = guarded(|| a.malloc(size, -1, 0)) {
                    cookie += 1;
                    stamp(p, size, cookie);
                    live.push((p, size, cookie));
                }
            }
            FaultOp::Plain(op) => match op {
                Op::Malloc { size, stream } => {
                    if let Some(Ok(p)) = guarded(|| a.malloc(size, 0, streams[stream])) {
                        cookie += 1;
                        stamp(p, size, cookie);
                        live.push((p, size, cookie));
                    }
                }
                Op::Free { pick } if !live.is_empty() => {
                    let i = pick % live.len();
                    let (p, size, c) = live[i];
                    assert!(stamped(p, size, c), "block {p:#x} was overwritten while live");
                    let waiting = a.deferred(0).unwrap().blocks;
                    match guarded(|| a.free(p)) {
                        Some(Ok(())) => {
                            live.swap_remove(i);
                            // Without its record_stream events, the block waits for a device
                            // synchronisation instead.
                            if a.deferred(0).unwrap().blocks > waiting {
                                deferred.push((p, size, c));
                            }
                        }
                        Some(Err(e)) => {
                            assert!(a.block_info(p).is_some(), "a free that failed ({e}) freed block {p:#x}");
                        }
                        None => {
                            if a.block_info(p).is_none() {
                                live.swap_remove(i);
                            }
                        }
                    }
                }
                Op::FreeAfterSync { pick } if !live.is_empty() => {
                    let (p, size, c) = live.swap_remove(pick % live.len());
                    a.free_after_device_sync(p).unwrap();
                    deferred.push((p, size, c));
                }
                Op::ReleaseDeferred => {
                    let _ = guarded(|| a.release_deferred(0));
                }
                Op::RecordStream { pick, stream } if !live.is_empty() => {
                    a.record_stream(live[pick % live.len()].0, streams[stream]).unwrap();
                }
                Op::Hold { stream } => drv.hold_stream(streams[stream]),
                Op::Release { stream } => drv.release_stream(streams[stream]),
                Op::EmptyCache => {
                    let _ = guarded(|| a.empty_cache(0));
                }
                Op::ResetPeaks => a.reset_peak_stats(0).unwrap(),
                _ => {}
            },
        }
        check(&a);
        if history {
            snapshot_agrees(&a, true);
        }
        let s = a.stats(0).unwrap();
        let physical = (s.reserved_bytes.all.current + s.unmapped_held_bytes.current) as usize;
        if expandable_segments {
            // An orphan (a handle the driver refused to unmap or release) is neither reserved
            // nor held, until the next release of the cache (the end of the run checks that
            // it was).
            assert!(physical <= drv.used(0), "reserved and held pages exceed what the driver holds");
        } else {
            assert_eq!(s.unmapped_held_bytes.current, 0, "held pages without expandable segments");
            assert_eq!(physical, drv.used(0), "reserved differs from what the driver holds");
        }
        peaks_are_consistent(&s);
        let waiting = a.deferred(0).unwrap().blocks;
        if waiting == 0 {
            deferred.clear();
        }
        assert_eq!(waiting as usize, deferred.len(), "blocks awaiting a device synchronisation");
        for &(p, size, c) in &deferred {
            assert!(stamped(p, size, c), "block {p:#x} was handed out before the device synchronisation");
        }
    }
    // The faults stop: everything must come back.
    drv.clear_faults();
    for s in streams {
        drv.release_stream(s);
    }
    for (p, size, c) in live.drain(..) {
        assert!(stamped(p, size, c), "block {p:#x} was overwritten while live");
        a.free(p).unwrap();
    }
    a.release_deferred(0).unwrap();
    a.empty_cache(0).unwrap();
    check(&a);
    let s = a.stats(0).unwrap();
    assert_eq!((s.reserved_bytes.all.current, s.active.all.current, drv.used(0)), (0, 0, 0));
    assert_eq!((s.unmapped_held_bytes.current, drv.live_vmm()), (0, (0, 0)), "every held page released");
    // The device is empty: the fraction's whole allowance, in one segment, must fit.
    let allowance = (fraction_or_all * CAPACITY as f64) as usize / (2 * MIB) * (2 * MIB);
    let p = a
        .malloc(allowance, 0, 0)
        .unwrap_or_else(|e| panic!("{} MiB on an empty device under the memory fraction: {e}", allowance / MIB));
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    check(&a);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 2048, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_driver_faults_and_panics(ops in proptest::collection::vec(fault_op(), 1..160)) {
        run_with_faults(ops, usize::MAX, None, false, false);
    }

    #[test]
    fn invariants_hold_under_driver_faults_and_panics_with_expandable_segments(
        ops in proptest::collection::vec(fault_op(), 1..160)
    ) {
        run_with_faults(ops, usize::MAX, Some(0.75), true, false);
    }

    #[test]
    fn invariants_hold_under_driver_faults_and_panics_with_a_memory_fraction(
        ops in proptest::collection::vec(fault_op(), 1..160)
    ) {
        run_with_faults(ops, 24 * MIB, Some(0.5), false, false);
    }

    #[test]
    fn invariants_hold_under_driver_faults_and_panics_with_history_on(
        ops in proptest::collection::vec(fault_op(), 1..160)
    ) {
        run_with_faults(ops, usize::MAX, Some(0.75), true, true);
    }
}

/// cudarc panics on the first call of a function that `libcuda.so.1` lacks (an old driver
/// without `cuMemAlloc_v2`). With a memory fraction set, the bytes the allocator counted
/// against the limit before calling the driver must be given back, or every later malloc
/// fails as out of memory on an empty device.
#[test]
fn a_panicking_driver_call_gives_back_what_the_memory_fraction_counted() {
    quiet_injected_panics();
    let (a, drv) = sim(1, CAPACITY);
    a.set_memory_fraction(0.5, 0).unwrap();
    for _ in 0..4 {
        drv.inject_panic(SimOp::MemAlloc, 0);
        let r = guarded(|| a.malloc(MIB, 0, 0));
        assert!(!matches!(r, Some(Ok(_))), "a malloc whose cuMemAlloc panicked returned a block");
        check(&a);
    }
    assert_eq!(drv.pending_faults(), 0);
    let half = CAPACITY / 2;
    match a.malloc(half, 0, 0) {
        Ok(p) => a.free(p).unwrap(),
        Err(e) => panic!("{} MiB under a limit of {} MiB on an empty device: {e}", half / MIB, half / MIB),
    }
    a.empty_cache(0).unwrap();
    check(&a);
    assert_eq!(drv.used(0), 0);
}

/// A driver function missing from `libcuda.so.1`, reported by the driver layer as
/// unavailable, reaches the caller as `Error::DriverUnavailable` naming the function, and
/// changes nothing.
#[test]
fn a_missing_driver_symbol_is_reported_by_name() {
    let (a, drv) = sim(1, CAPACITY);
    a.set_memory_fraction(0.5, 0).unwrap();
    for kind in [SimOp::MemAlloc, SimOp::CurrentDevice] {
        drv.inject(kind, 0, SimFault::MissingSymbol);
        let device = if kind == SimOp::CurrentDevice { -1 } else { 0 };
        match a.malloc(MIB, device, 0) {
            Err(Error::DriverUnavailable(m)) => assert!(m.contains(kind.symbol()), "{m}"),
            other => panic!("{other:?}"),
        }
        check(&a);
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    }
    let p = a.malloc(CAPACITY / 2, 0, 0).unwrap();
    a.free(p).unwrap();
    drv.inject(SimOp::MemInfo, 0, SimFault::MissingSymbol);
    match a.set_memory_fraction(0.25, 0) {
        Err(Error::DriverUnavailable(m)) => assert!(m.contains("cuMemGetInfo_v2"), "{m}"),
        other => panic!("{other:?}"),
    }
    check(&a);
}

// ---- Dropping an allocator ----------------------------------------------------------------

/// Allocations on several streams, some used on other streams (`record_stream`), all freed:
/// the cache then holds segments, blocks awaiting events, and events kept for reuse.
fn fill_and_free(a: &gpupool::Allocator) {
    let mut ptrs = Vec::new();
    for (i, size) in [512usize, 4096, 300 << 10, 3 * MIB, 12 * MIB, 30 * MIB].into_iter().enumerate() {
        for stream in [0usize, 0x10, 0x20] {
            let p = a.malloc(size + i, 0, stream).unwrap();
            if size < MIB {
                a.record_stream(p, 0x30 + stream).unwrap();
            }
            ptrs.push(p);
        }
    }
    for p in ptrs {
        a.free(p).unwrap();
    }
}

/// PyTorch's allocator lives as long as the process; a gpupool `Allocator` may be dropped
/// earlier, and must then give the driver back every cached segment and every event.
#[test]
fn dropping_an_allocator_gives_the_driver_everything_back() {
    let (a, drv) = sim(1, 1 << 30);
    fill_and_free(&a);
    // One round of event processing, so that completed events are kept for reuse.
    a.free(a.malloc(512, 0, 0).unwrap()).unwrap();
    assert!(drv.used(0) > 0 && drv.live_events() > 0, "the test must leave something cached");
    drop(a);
    assert_eq!(
        (drv.used(0), drv.live_allocations(), drv.live_events()),
        (0, 0, 0),
        "bytes, allocations and events the dropped allocator left with the driver"
    );
}

/// As above, with the freed blocks still awaiting events on a stream whose work has not
/// completed: the drop waits for them, as `empty_cache` does.
#[test]
fn dropping_an_allocator_waits_for_pending_events_and_gives_everything_back() {
    let (a, drv) = sim(1, 1 << 30);
    for s in [0x30usize, 0x40, 0x50] {
        drv.hold_stream(s);
    }
    fill_and_free(&a);
    assert!(a.stats(0).unwrap().active.all.current > 0, "blocks must await events");
    drop(a);
    assert_eq!((drv.used(0), drv.live_allocations(), drv.live_events()), (0, 0, 0));
}
