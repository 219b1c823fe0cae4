//! The runner of a plain sequence (`Op`s on the simulated device, no faults): every invariant
//! checked after every operation, then everything freed and the cache emptied to nothing.

use crate::common;

use common::history::{record_all, snapshot_agrees};
use common::{MIB, check, sim_with};
use gpupool::driver::CaptureMode;
use gpupool::history::HistoryContext;

use crate::ops::{Op, case_config, currents, peaks, stamp, stamped};

pub(crate) fn run(ops: Vec<Op>, max_split_size: usize, expandable_segments: bool, history: bool) {
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
