//! The rest of the attack on commit 5af75ca (`tests/hit/cache_hostile.rs` has the strong
//! counts): the raw device pointer of each cache entry against several allocators in one
//! thread, dropped and made again (run under AddressSanitizer too); streams retired while
//! another thread has them cached; device -1 against 0; size 0; routes to private pools made
//! while the stream is cached; the started-runtime pointer that a fork clears, with each hit
//! path export and the Rust API as the child's first call; and the lazy statistics against an
//! eager count of the same calls, with every kind of call that marks them stale between.
use crate::common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::process::alone;
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;
use gpupool::stats::{DeviceStats, Stat};
use gpupool::{Allocator, Error};

#[test]
fn allocators_dropped_and_made_again_in_one_thread_share_no_entry() {
    // One driver under all of them, so that their addresses never coincide.
    let driver = std::sync::Arc::new(SimDriver::new(2, 256 * MIB));
    let make = || Allocator::new(driver.clone(), Config::pytorch());
    let streams = [0x10, 0x20, 0x30, 0x40, 0x50, 0x60];
    let b = make();
    for round in 0..200usize {
        // Two live ones on the same streams, then the first dropped while this thread's
        // cache holds its entries, and another made (perhaps where it was).
        let a = make();
        let mut held = Vec::new();
        for (i, &s) in streams.iter().enumerate() {
            let device = (i % 2) as i32;
            held.push((a.malloc(512 + round, device, s).unwrap(), b.malloc(4096, device, s).unwrap()));
        }
        for &(pa, pb) in &held {
            assert!(matches!(a.free(pb), Err(Error::InvalidPointer(_))), "b's block freed through a");
            assert!(matches!(b.free(pa), Err(Error::InvalidPointer(_))), "a's block freed through b");
        }
        for &(pa, _) in &held {
            a.free(pa).unwrap();
        }
        check(&a);
        drop(a);
        let c = make();
        for &s in &streams {
            let p = c.malloc(1024, 1, s).unwrap();
            assert!(matches!(b.free(p), Err(Error::InvalidPointer(_))));
            c.free(p).unwrap();
        }
        for &(_, pb) in &held {
            assert_eq!(b.block_info(pb).map(|i| i.size), Some(4096));
            b.free(pb).unwrap();
        }
        check(&b);
        check(&c);
        assert_eq!(c.stats(1).unwrap().allocation.all.current, 0);
    }
    assert_eq!(b.stats(0).unwrap().allocation.all.current, 0);
}

#[test]
fn streams_retired_while_another_thread_has_them_cached() {
    let (a, _drv) = sim_with(1, 256 * MIB, Config::pytorch());
    let streams = [0x10, 0x20, 0x30, 0x40, 0x50, 0x60];
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..2 {
            let (a, done) = (&a, &done);
            s.spawn(move || {
                for i in 0..3000 {
                    let stream = streams[(i + t) % streams.len()];
                    let p = a.malloc(512 << (i % 4), 0, stream).unwrap();
                    let q = a.malloc(3 * MIB, 0, stream).unwrap();
                    a.free(p).unwrap();
                    a.free(q).unwrap();
                }
                done.store(true, std::sync::atomic::Ordering::Relaxed);
            });
        }
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            a.empty_cache(0).unwrap();
            let st = a.stats(0).unwrap();
            assert!(st.allocation.all.current >= 0 && st.allocation.all.current <= 4, "{st:?}");
        }
    });
    a.empty_cache(0).unwrap();
    check(&a);
    let st = a.stats(0).unwrap();
    assert_eq!((st.allocation.all.current, st.reserved_bytes.all.current), (0, 0));
    assert_eq!((st.allocation.all.allocated, st.allocation.all.freed), (12_000, 12_000));
}

#[test]
fn the_current_device_size_zero_and_routes_under_a_cached_stream() {
    let (a, _drv) = sim_with(2, 64 * MIB, Config::pytorch());
    let device = |p| a.block_info(p).unwrap().device;
    let p0 = a.malloc(512, 0, 0x10).unwrap();
    SimDriver::set_current_device(1);
    // -1 never matches an entry: the current device, though this thread cached device 0's.
    let p1 = a.malloc(512, -1, 0x10).unwrap();
    assert_eq!((device(p0), device(p1)), (0, 1));
    let p2 = a.malloc(512, 0, 0x10).unwrap();
    SimDriver::set_current_device(0);
    let p3 = a.malloc(512, -1, 0x10).unwrap();
    assert_eq!((device(p2), device(p3)), (0, 0));
    assert_eq!(a.malloc(0, 0, 0x10).unwrap(), 0);
    assert_eq!(a.malloc(0, -1, 0x10).unwrap(), 0);
    assert!(matches!(a.malloc(512, 2, 0x10), Err(Error::InvalidValue(_))));
    assert!(matches!(a.malloc(512, -2, 0x10), Err(Error::InvalidValue(_))));
    a.free(0).unwrap();
    for p in [p0, p1, p2, p3] {
        a.free(p).unwrap();
    }
    assert_eq!(a.stats(0).unwrap().allocation.all.allocated, 3);
    // A route made while the stream is cached, by this thread and by another.
    let pool = a.pool_create();
    let cached = a.malloc(512, 0, 0x10).unwrap();
    for by_other in [false, true] {
        if by_other {
            std::thread::scope(|s| s.spawn(|| a.begin_allocate_to_pool(0, pool, 0x10).unwrap()).join().unwrap());
        } else {
            a.begin_allocate_to_pool(0, pool, 0x10).unwrap();
        }
        let routed = a.malloc(512, 0, 0x10).unwrap();
        let other = a.malloc(512, 0, 0x20).unwrap();
        assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocation.all.current, 1, "by another: {by_other}");
        a.end_allocate_to_pool(0, pool).unwrap();
        let back = a.malloc(512, 0, 0x10).unwrap();
        assert_eq!(a.pool_stats(0, pool).unwrap().stats.allocation.all.current, 1);
        for p in [routed, other, back] {
            a.free(p).unwrap();
        }
    }
    a.free(cached).unwrap();
    a.release_pool(0, pool).unwrap();
    a.empty_cache(-1).unwrap();
    check(&a);
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
}

/// Runs `f` in a forked child; whether it returned true there.
fn in_child(f: impl FnOnce() -> bool) -> bool {
    // SAFETY: the child runs gpupool's calls (which refuse before any lock of theirs) and
    // `_exit`; glibc's malloc is fork-safe.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: a hang is killed by SIGALRM; `_exit` runs none of the parent's handlers.
        unsafe { libc::alarm(10) };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
        unsafe { libc::_exit(i32::from(!ok)) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

#[test]
fn every_hit_path_call_is_refused_as_a_forked_childs_first() {
    use gpupool::ffi::gpupool_stream_t;
    use gpupool::ffi::host::{gpupool_host_free, gpupool_host_malloc};
    use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
    use gpupool::ffi::status::gpupool_status::{GPUPOOL_ERROR_DRIVER_UNAVAILABLE as REFUSED, GPUPOOL_SUCCESS};
    // In a process of its own: the process allocator is set up from the environment below, and
    // the forks copy only this test's thread.
    if !alone() {
        return;
    }
    static ENV: Mutex<()> = Mutex::new(());
    let _env = ENV.lock().unwrap();
    // SAFETY: set before the process allocator starts; no other test runs in this process.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "64MiB");
    }
    let (a, _drv) = sim_with(1, 64 * MIB, Config::pytorch());
    let (mut warm, mut warm_host, mut cached) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    let null = std::ptr::null_mut::<c_void>() as gpupool_stream_t;
    // SAFETY: out-pointers to local storage; pointers from gpupool.
    unsafe {
        assert_eq!(gpupool_malloc(&mut warm, 4096, 0, null), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_malloc(&mut cached, 4096, 0, null), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_free(cached), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_host_malloc(&mut warm_host, 4096), GPUPOOL_SUCCESS);
    }
    let rust_block = a.malloc(4096, 0, 0x10).unwrap();
    let rust_freed = a.malloc(512, 0, 0x10).unwrap();
    a.free(rust_freed).unwrap();
    let (warm_u, warm_host_u) = (warm as usize, warm_host as usize);
    let refused = |e: Error| matches!(e, Error::DriverUnavailable(ref m) if m.contains("fork"));
    type First<'a> = (&'static str, Box<dyn Fn() -> bool + 'a>);
    let firsts: Vec<First> = vec![
        (
            "gpupool_malloc",
            Box::new(|| {
                let mut p = std::ptr::dangling_mut::<c_void>();
                // SAFETY: an out-pointer to local storage.
                unsafe { gpupool_malloc(&mut p, 4096, 0, null) == REFUSED && p == std::ptr::dangling_mut() }
            }),
        ),
        // SAFETY (each): a pointer the parent had from gpupool; nothing is dereferenced.
        ("gpupool_free", Box::new(|| unsafe { gpupool_free(warm_u as *mut c_void) == REFUSED })),
        ("gpupool_free of a freed block", Box::new(|| unsafe { gpupool_free(cached) == REFUSED })),
        (
            "gpupool_host_malloc",
            Box::new(|| {
                let mut p = std::ptr::null_mut();
                // SAFETY: an out-pointer to local storage.
                unsafe { gpupool_host_malloc(&mut p, 4096) == REFUSED && p.is_null() }
            }),
        ),
        ("gpupool_host_free", Box::new(|| unsafe { gpupool_host_free(warm_host_u as *mut c_void) == REFUSED })),
        ("gpupool_torch_malloc", Box::new(|| gpupool::ffi::torch::gpupool_torch_malloc(4096, 0, null).is_null())),
        ("process_allocator", Box::new(|| gpupool::ffi::process_allocator().is_err_and(refused))),
        ("Allocator::malloc", Box::new(|| a.malloc(512, 0, 0x10).is_err_and(refused))),
        ("Allocator::free", Box::new(|| a.free(rust_block).is_err_and(refused))),
        ("Allocator::free of a freed block", Box::new(|| a.free(rust_freed).is_err_and(refused))),
        ("Allocator::record_stream", Box::new(|| a.record_stream(rust_block, 0x20).is_err_and(refused))),
    ];
    for (call, first) in &firsts {
        assert!(in_child(first), "{call} as a forked child's first call was not refused");
    }
    // The parent goes on.
    // SAFETY: pointers from gpupool.
    unsafe {
        assert_eq!(gpupool_free(warm), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_host_free(warm_host), GPUPOOL_SUCCESS);
    }
    a.free(rust_block).unwrap();
    check(&a);
}

/// One statistic counted eagerly.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Eager {
    current: i64,
    peak: i64,
    allocated: i64,
    freed: i64,
}

impl Eager {
    fn change(&mut self, n: i64) {
        self.current += n;
        if n > 0 {
            self.allocated += n;
        } else {
            self.freed -= n;
        }
        self.peak = self.peak.max(self.current);
    }

    fn agrees(&self, s: &Stat) -> bool {
        (self.current, self.peak, self.allocated, self.freed) == (s.current, s.peak, s.allocated, s.freed)
    }
}

/// allocation, active, allocated_bytes, active_bytes, requested_bytes; each for all pools, the
/// small pool, the large pool.
#[derive(Default)]
struct Model([[Eager; 3]; 5]);

impl Model {
    /// A block of `size` bytes (rounded), `requested` asked for: allocated (`allocated`) and
    /// active (`active`) by `sign`.
    fn count(&mut self, size: usize, requested: usize, sign: i64, allocated: bool, active: bool) {
        let pool = if size <= MIB { 1 } else { 2 };
        let metrics =
            [(0, 1, allocated), (1, 1, active), (2, size, allocated), (3, size, active), (4, requested, active)];
        for (m, n, on) in metrics {
            if on {
                for t in [0, pool] {
                    self.0[m][t].change(sign * n as i64);
                }
            }
        }
    }

    fn reset_peaks(&mut self) {
        self.0.iter_mut().flatten().for_each(|e| e.peak = e.current);
    }

    fn agrees(&self, s: &DeviceStats, step: usize) {
        let arrays = [&s.allocation, &s.active, &s.allocated_bytes, &s.active_bytes, &s.requested_bytes];
        for (m, array) in arrays.into_iter().enumerate() {
            for (t, stat) in [&array.all, &array.small_pool, &array.large_pool].into_iter().enumerate() {
                assert!(
                    self.0[m][t].agrees(stat),
                    "step {step}: metric {m} type {t}: {:?} eager, {stat:?}",
                    self.0[m][t]
                );
            }
        }
    }
}

/// Random calls on more streams than the thread's cache holds, and from a second thread,
/// between which the lazy sums are flushed and their minimums marked stale in every way a call
/// does it (a new segment, a free found through the index, a deferred free, `empty_cache`, a
/// peak reset, a statistics read, the summary): every statistic, peaks included, equals the
/// eager count whenever read, and the invariant checker (its lazy rule included) holds.
#[test]
fn lazy_statistics_equal_an_eager_count_with_stale_marks_between_calls() {
    let sizes = [512, 1000, 4096, 200_000, MIB, MIB + 1, 3 * MIB, 12 * MIB];
    let streams = [0x10, 0x20, 0x30, 0x40, 0x50, 0x60];
    for seed in 0..12u64 {
        let config = if seed % 2 == 0 { Config::pytorch() } else { Config::default() };
        let (a, _drv) = sim_with(1, 1024 * MIB, config);
        let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ (seed << 17);
        let mut model = Model::default();
        let (mut live, mut deferred) = (Vec::new(), Vec::new());
        for step in 0..3000 {
            common::xorshift(&mut x);
            let pick = (x >> 20) as usize;
            match x % 16 {
                0..=5 if live.len() < 24 => {
                    let (size, stream) = (sizes[pick % sizes.len()], streams[(pick >> 4) % streams.len()]);
                    let p = if pick % 7 == 0 {
                        std::thread::scope(|s| s.spawn(|| a.malloc(size, 0, stream).unwrap()).join().unwrap())
                    } else {
                        a.malloc(size, 0, stream).unwrap()
                    };
                    let rounded = a.block_info(p).unwrap().size;
                    model.count(rounded, size, 1, true, true);
                    live.push((p, rounded, size));
                }
                6..=9 if !live.is_empty() => {
                    let (p, rounded, size) = live.swap_remove(pick % live.len());
                    if pick % 5 == 0 {
                        std::thread::scope(|s| drop(s.spawn(|| a.free(p).unwrap())));
                    } else {
                        a.free(p).unwrap();
                    }
                    model.count(rounded, size, -1, true, true);
                }
                10 if !live.is_empty() => {
                    let (p, rounded, size) = live.swap_remove(pick % live.len());
                    a.free_after_device_sync(p).unwrap();
                    model.count(rounded, size, -1, true, false);
                    deferred.push((rounded, size));
                }
                11 | 12 => {
                    if pick % 3 == 0 {
                        a.empty_cache(0).unwrap()
                    } else {
                        a.release_deferred(0).map(drop).unwrap()
                    }
                    for (rounded, size) in deferred.drain(..) {
                        model.count(rounded, size, -1, false, true);
                    }
                }
                13 => {
                    a.reset_peak_stats(0).unwrap();
                    model.reset_peaks();
                }
                14 => drop(a.memory_summary(0).unwrap()),
                _ => {}
            }
            if pick % 3 == 0 {
                model.agrees(&a.stats(0).unwrap(), step);
                check(&a);
            }
        }
        model.agrees(&a.stats(0).unwrap(), usize::MAX);
        check(&a);
    }
}
