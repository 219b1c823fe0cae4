//! The runner of a sequence with driver faults and panics injected (`FaultOp`): the
//! operations, the quiet panic hook, and `run_with_faults`, which checks after every operation,
//! however it ended, that the invariants hold and the driver holds what the allocator counts.

use crate::common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use common::history::{record_all, snapshot_agrees};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SIM_PANIC_MARK, SimFault, SimOp};
use gpupool::history::HistoryContext;
use gpupool::stats::DeviceStats;
use gpupool::{Error, SleepMode};
use proptest::prelude::*;

use crate::ops::{Op, case_config, currents, op, peaks, size, stamp, stamped};

pub(crate) const CAPACITY: usize = 160 * MIB;

/// The device of the runs with expandable segments, half the others': there the default pools
/// sleep and wake (`SleepWake`, `SleepRace`), each copying every live byte out and back through
/// the simulated device's file-backed pages, which is what those cases' CPU time goes to (the
/// kernel's page faults: 56 of the binary's 60 s of CPU at 160 MiB, 2026-11-29). At 80 MiB,
/// three quarters (the memory fraction of both runs) is 60 MiB, three 20 MiB pages as 120 MiB
/// were six: the whole allowance still maps in one request at the end, and the largest
/// request (48 MiB, `ops::size`) still fits, in 20 MiB pages as in 2 MiB ones.
pub(crate) const EXPANDABLE_CAPACITY: usize = 80 * MIB;

#[derive(Clone, Debug)]
pub(crate) enum Fault {
    Cuda,
    OutOfMemory,
    MissingSymbol,
    Panic,
}

#[derive(Clone, Debug)]
pub(crate) enum FaultOp {
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

pub(crate) fn fault_op() -> impl Strategy<Value = FaultOp> {
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
pub(crate) fn quiet_injected_panics() {
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
pub(crate) fn guarded<T>(f: impl FnOnce() -> Result<T, Error>) -> Option<Result<T, Error>> {
    catch_unwind(AssertUnwindSafe(f)).ok()
}

/// Every statistic's current is at most its peak, and the aggregate peak at most the sum of
/// the pools' peaks (the aggregate is always the sum of the pools).
pub(crate) fn peaks_are_consistent(s: &DeviceStats) {
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

pub(crate) fn run_with_faults(
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
    let capacity = if expandable_segments { EXPANDABLE_CAPACITY } else { CAPACITY };
    let (a, drv) = sim_with(1, capacity, config);
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
    let allowance = (fraction_or_all * capacity as f64) as usize / (2 * MIB) * (2 * MIB);
    let p = a
        .malloc(allowance, 0, 0)
        .unwrap_or_else(|e| panic!("{} MiB on an empty device under the memory fraction: {e}", allowance / MIB));
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    check(&a);
}
