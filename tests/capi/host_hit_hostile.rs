//! The pinned hit path without a stack frame (commit d3dd192, `src/host/hit.rs`) attacked
//! through the C exports, which alone take it: statistics against PyTorch's eager `Stat` call by
//! call, frees in every order and from other threads, double frees, frees of blocks named by
//! `record_event`, more threads than stripes churning while others read the statistics and
//! empty the cache, threads that exit and leave their thread pointer to the next, and forked
//! children calling every export while another thread holds a stripe's lock.
//!
//! The process allocator reads `GPUPOOL_*` once: each test runs in a process of its own
//! (`common::process::alone`), where it sets them first. Each holds `SERIAL` and leaves every
//! block it allocated freed, so that the tests stay right when they share one allocator.

use crate::common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::process::alone;
use common::xorshift;
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::host::{
    gpupool_host_empty_cache, gpupool_host_free, gpupool_host_malloc, gpupool_host_record_event,
    gpupool_host_reset_peak_stats, gpupool_host_stats, gpupool_host_stats_t,
};
use gpupool::ffi::process_host_allocator;
use gpupool::ffi::sim::{gpupool_sim_hold_stream, gpupool_sim_release_stream};
use gpupool::ffi::status::gpupool_status::{self, *};
use gpupool::stats::Stat;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    // SAFETY: set before any call of the process's tests (each holds SERIAL first), to the same
    // values.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_DEVICES", "2");
    }
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn malloc(size: usize) -> (gpupool_status, usize) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: storage for one pointer.
    let st = unsafe { gpupool_host_malloc(&mut p, size) };
    (st, p as usize)
}

fn must_malloc(size: usize) -> usize {
    let (st, p) = malloc(size);
    assert_eq!(st, GPUPOOL_SUCCESS, "malloc of {size} bytes");
    assert!(p != 0 || size == 0);
    p
}

fn free(p: usize) -> gpupool_status {
    // SAFETY: the pointer is only compared.
    unsafe { gpupool_host_free(p as *mut c_void) }
}

fn stats() -> gpupool_host_stats_t {
    let mut s = gpupool_host_stats_t { size: size_of::<gpupool_host_stats_t>() as u32, ..Default::default() };
    // SAFETY: a whole struct.
    assert_eq!(unsafe { gpupool_host_stats(&mut s) }, GPUPOOL_SUCCESS);
    s
}

fn check() {
    process_host_allocator().unwrap().check_invariants();
}

/// The block's size class, as `classes`: a power of two up to 1 MiB.
fn rounded(size: usize) -> usize {
    gpupool::host::rounded_size(size).unwrap()
}

/// PyTorch's eager `Stat::increase`/`decrease`.
fn increase(s: &mut Stat, n: i64) {
    s.current += n;
    s.allocated += n;
    s.peak = s.peak.max(s.current);
}

fn decrease(s: &mut Stat, n: i64) {
    s.current -= n;
    s.freed += n;
}

fn as_stat(s: &gpupool::ffi::stats::gpupool_stat_t) -> Stat {
    Stat { current: s.current, peak: s.peak, allocated: s.allocated, freed: s.freed }
}

#[test]
fn one_threads_statistics_are_pytorchs_eager_ones_call_by_call() {
    if !alone() {
        return;
    }
    let _g = serial();
    assert_eq!(gpupool_host_reset_peak_stats(), GPUPOOL_SUCCESS);
    let s0 = stats();
    let (mut req, mut bytes) = (as_stat(&s0.active_requests), as_stat(&s0.active_bytes));
    assert_eq!((req.peak, bytes.peak), (req.current, bytes.current), "peaks reset");
    let mut live: Vec<(usize, usize)> = Vec::new();
    // Freed blocks whose event on the stream `copy` is busy (held), or completed and waiting
    // for the next allocation to poll it (PyTorch `process_events`).
    let (mut busy, mut done, mut held): (Vec<usize>, Vec<usize>, bool) = (Vec::new(), Vec::new(), false);
    let copy = 0x7200usize as gpupool_stream_t;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for step in 0..3000 {
        let r = xorshift(&mut rng);
        if r % 23 == 0 && !live.is_empty() {
            if !held {
                assert_eq!(gpupool_sim_hold_stream(copy), GPUPOOL_SUCCESS);
                held = true;
            }
            let (p, size) = live.swap_remove((r >> 16) as usize % live.len());
            // SAFETY: compared only.
            assert_eq!(unsafe { gpupool_host_record_event(p as *mut c_void, copy) }, GPUPOOL_SUCCESS);
            assert_eq!(free(p), GPUPOOL_SUCCESS, "free of {p:#x}");
            assert_eq!(free(p), GPUPOOL_ERROR_INVALID_POINTER, "double free of {p:#x}");
            busy.push(size);
        } else if r % 23 == 1 && held {
            assert_eq!(gpupool_sim_release_stream(copy), GPUPOOL_SUCCESS);
            held = false;
            done.append(&mut busy);
        } else if r % 23 == 2 {
            assert_eq!(gpupool_host_reset_peak_stats(), GPUPOOL_SUCCESS);
            (req.peak, bytes.peak) = (req.current, bytes.current);
        } else if r % 5 < 3 || live.is_empty() {
            // Small classes mostly (the hit path's), a few large ones and 0.
            let size = match r >> 8 & 15 {
                0 => 0,
                1 => (1 << 20) + 1 + (r >> 20) as usize % (3 << 20),
                _ => 1 + (r >> 20) as usize % (64 << 10),
            };
            let p = must_malloc(size);
            if size > 0 {
                for n in done.drain(..) {
                    decrease(&mut req, 1);
                    decrease(&mut bytes, n as i64);
                }
            }
            if size > 0 {
                // Its class's size, or a larger cached class's up to 5% over `size`.
                let got = process_host_allocator().unwrap().block_size(p).expect("allocated");
                assert!(got >= rounded(size) && (size <= 1 << 20 && got == rounded(size) || got - size <= size / 20));
                increase(&mut req, 1);
                increase(&mut bytes, got as i64);
                assert!(live.iter().all(|&(q, _)| q != p), "{p:#x} handed out twice");
                live.push((p, got));
            }
        } else {
            // Newest, oldest, or any: the stack's every order and the map.
            let i = match r >> 8 & 3 {
                0 => live.len() - 1,
                1 => 0,
                _ => (r >> 16) as usize % live.len(),
            };
            let (p, size) = live.swap_remove(i);
            assert_eq!(free(p), GPUPOOL_SUCCESS, "free of {p:#x}");
            assert_eq!(free(p), GPUPOOL_ERROR_INVALID_POINTER, "double free of {p:#x}");
            decrease(&mut req, 1);
            decrease(&mut bytes, size as i64);
        }
        let s = stats();
        assert_eq!(as_stat(&s.active_requests), req, "active_requests at step {step}");
        assert_eq!(as_stat(&s.active_bytes), bytes, "active_bytes at step {step}");
        if step % 50 == 0 {
            check();
        }
    }
    for (p, _) in live {
        assert_eq!(free(p), GPUPOOL_SUCCESS);
    }
    assert_eq!(gpupool_sim_release_stream(copy), GPUPOOL_SUCCESS);
    assert_eq!(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
    check();
}

/// Threads that exit leave their slot (and their thread pointer) to the next: each thread
/// frees what the one before it allocated and allocates for the next.
#[test]
fn threads_that_exit_leave_blocks_their_successors_free_once() {
    if !alone() {
        return;
    }
    let _g = serial();
    let mut left: Vec<usize> = Vec::new();
    for round in 0..200usize {
        let mine = std::mem::take(&mut left);
        left = std::thread::spawn(move || {
            for (k, &p) in mine.iter().enumerate() {
                assert_eq!(free(p), GPUPOOL_SUCCESS, "round {round}: free of {p:#x}");
                if k % 3 == 0 {
                    assert_eq!(free(p), GPUPOOL_ERROR_INVALID_POINTER, "double free of {p:#x}");
                }
            }
            (0..1 + round % 13).map(|i| must_malloc(512 << (i % 6))).collect()
        })
        .join()
        .unwrap();
        check();
    }
    for p in left {
        assert_eq!(free(p), GPUPOOL_SUCCESS);
    }
    check();
}

/// A block named by `record_event` from another thread is not reused, whichever path frees it,
/// until its stream's work completed.
#[test]
fn a_recorded_block_in_the_stack_waits_for_its_event() {
    if !alone() {
        return;
    }
    let _g = serial();
    let copy = 0x7100usize;
    assert_eq!(gpupool_sim_hold_stream(copy as gpupool_stream_t), GPUPOOL_SUCCESS);
    let a = must_malloc(3000);
    let b = must_malloc(3000);
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: compared only.
            assert_eq!(
                unsafe { gpupool_host_record_event(a as *mut c_void, copy as gpupool_stream_t) },
                GPUPOOL_SUCCESS
            )
        });
    });
    assert_eq!(free(a), GPUPOOL_SUCCESS);
    assert_eq!(free(a), GPUPOOL_ERROR_INVALID_POINTER);
    let c = must_malloc(3000);
    assert_ne!(c, a, "the held stream may still read {a:#x}");
    assert_eq!(free(c), GPUPOOL_SUCCESS);
    assert_eq!(free(b), GPUPOOL_SUCCESS);
    check();
    assert_eq!(gpupool_sim_release_stream(copy as gpupool_stream_t), GPUPOOL_SUCCESS);
    assert_eq!(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
    check();
}

/// More threads than stripes churn (blocks handed between threads, a cookie in each to catch
/// one handed out twice) while another thread reads the statistics and empties the cache.
#[test]
fn more_threads_than_stripes_churn_and_hand_blocks_to_each_other() {
    if !alone() {
        return;
    }
    let _g = serial();
    let threads = 72usize;
    let shared: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
    let done = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (shared, done) = (&shared, &done);
            s.spawn(move || {
                let mut rng = 0x1234_5678_9abc_def1u64 ^ (t as u64 + 1) << 20;
                let mut mine: Vec<(usize, u64)> = Vec::new();
                for i in 0..1500u64 {
                    let r = xorshift(&mut rng);
                    let cookie = (t as u64) << 32 | i;
                    if r % 3 == 0 || mine.len() > 20 {
                        let from_shared = r >> 8 & 1 == 0;
                        let got = if from_shared { shared.lock().unwrap().pop() } else { mine.pop() };
                        if let Some((p, c)) = got {
                            // SAFETY: a live block of at least 8 bytes, owned here.
                            assert_eq!(unsafe { *(p as *const u64) }, c, "block {p:#x} was handed out twice");
                            assert_eq!(free(p), GPUPOOL_SUCCESS, "free of {p:#x}");
                        }
                    } else {
                        let size = if r >> 12 & 31 == 0 { (1 << 20) + 4096 } else { 8 << ((r >> 16) % 14) };
                        let p = must_malloc(size as usize);
                        // SAFETY: a fresh block of at least 8 bytes.
                        unsafe { *(p as *mut u64) = cookie };
                        if r >> 24 & 1 == 0 { shared.lock().unwrap().push((p, cookie)) } else { mine.push((p, cookie)) }
                    }
                }
                shared.lock().unwrap().extend(mine);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
        }
        s.spawn(|| {
            while done.load(std::sync::atomic::Ordering::Relaxed) < threads {
                let st = stats();
                assert!(st.active_requests.current <= st.allocations.current, "{st:?}");
                assert!(st.active_requests.current <= st.active_requests.peak);
                assert!(st.active_bytes.current <= st.allocated_bytes.current);
                assert_eq!(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
                std::thread::yield_now();
            }
        });
    });
    let blocks = std::mem::take(&mut *shared.lock().unwrap());
    for (p, c) in blocks {
        // SAFETY: as above.
        assert_eq!(unsafe { *(p as *const u64) }, c, "block {p:#x} was handed out twice");
        assert_eq!(free(p), GPUPOOL_SUCCESS);
    }
    check();
    let st = stats();
    assert_eq!(
        (st.active_requests.allocated, st.active_bytes.allocated),
        (st.active_requests.freed, st.active_bytes.freed)
    );
}

/// A forked child refuses every pinned export, never waiting for a stripe lock that a thread
/// of the parent held at the fork (churning threads hold theirs; the statistics hold all).
#[test]
fn a_forked_child_refuses_every_export_while_parent_threads_hold_stripe_locks() {
    if !alone() {
        return;
    }
    let _g = serial();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let warm = must_malloc(4096);
    std::thread::scope(|s| {
        for t in 0..3usize {
            let stop = &stop;
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if t == 2 {
                        stats();
                        continue;
                    }
                    let ps: Vec<usize> = (0..12).map(|i| must_malloc(64 << (i % 4))).collect();
                    for p in ps {
                        assert_eq!(free(p), GPUPOOL_SUCCESS);
                    }
                }
            });
        }
        for _ in 0..100 {
            // SAFETY: the child calls the exports under test and `_exit`s.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: in the child: a hang is cut short by the alarm.
                unsafe { libc::alarm(5) };
                let unavailable = GPUPOOL_ERROR_DRIVER_UNAVAILABLE;
                let mut p: *mut c_void = std::ptr::null_mut();
                let mut code = 0;
                // SAFETY: storage for one pointer; the others are compared only.
                unsafe {
                    let mut s =
                        gpupool_host_stats_t { size: size_of::<gpupool_host_stats_t>() as u32, ..Default::default() };
                    let got = [
                        gpupool_host_malloc(&mut p, 4096),
                        gpupool_host_malloc(&mut p, 3 << 20),
                        gpupool_host_free(warm as *mut c_void),
                        gpupool_host_record_event(warm as *mut c_void, std::ptr::null_mut()),
                        gpupool_host_empty_cache(),
                        gpupool_host_stats(&mut s),
                        gpupool_host_reset_peak_stats(),
                    ];
                    for (i, g) in got.iter().enumerate() {
                        if *g != unavailable {
                            code = 10 + i as i32;
                        }
                    }
                    if !p.is_null() {
                        code = 9;
                    }
                    libc::_exit(code);
                }
            }
            assert!(pid > 0, "fork failed");
            let mut status = 0;
            // SAFETY: waits for the child forked above.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(libc::WIFEXITED(status), "the child hung or crashed: status {status:#x}");
            assert_eq!(libc::WEXITSTATUS(status), 0, "the child's call that did not refuse (10 + its index)");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(free(warm), GPUPOOL_SUCCESS);
    check();
}

/// Up to twice the handed-out stack's blocks outstanding, freed in every order of a few kinds
/// (the stack's swap removal, its spill to the map), some by another thread: each block is
/// freed once, its size known until then, and a second free refused.
#[test]
fn blocks_past_the_stack_are_freed_once_in_any_order() {
    if !alone() {
        return;
    }
    let _g = serial();
    for n in 1..=17usize {
        let orders: Vec<Vec<usize>> = vec![
            (0..n).collect(),
            (0..n).rev().collect(),
            (0..n.div_ceil(2)).flat_map(|i| [n - 1 - i, i]).take(n).collect::<Vec<_>>(),
            (0..n).map(|i| (i * 7 + 3) % n).collect(),
        ];
        for order in orders {
            let mut seen = order.clone();
            seen.sort_unstable();
            seen.dedup();
            if seen.len() != n {
                continue; // 7 and n not coprime: not a permutation
            }
            let ptrs: Vec<(usize, usize)> = (0..n).map(|i| (must_malloc(64 << (i % 5)), 64 << (i % 5))).collect();
            let host = process_host_allocator().unwrap();
            for (k, &i) in order.iter().enumerate() {
                let (p, size) = ptrs[i];
                assert_eq!(host.block_size(p), Some(size), "block {i} of {n} before its free");
                if k % 4 == 1 {
                    std::thread::scope(|s| {
                        s.spawn(|| assert_eq!(free(p), GPUPOOL_SUCCESS));
                    });
                } else {
                    assert_eq!(free(p), GPUPOOL_SUCCESS, "block {i} of {n}");
                }
                assert_eq!(free(p), GPUPOOL_ERROR_INVALID_POINTER, "double free of block {i} of {n}");
                assert_eq!(free(p + 64), GPUPOOL_ERROR_INVALID_POINTER, "a free inside block {i}");
                assert_eq!(host.block_size(p), None);
                assert!(host.owns(p) && host.owns(p + size - 1), "cached block {i} of {n} is still pinned");
                for &j in &order[k + 1..] {
                    assert_eq!(host.block_size(ptrs[j].0), Some(ptrs[j].1), "block {j} of {n} not freed yet");
                }
            }
            check();
        }
    }
}
