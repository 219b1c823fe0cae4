//! The thread's shard cache of commit 5af75ca attacked from outside (`src/caching/allocator/
//! hit.rs`): entries that hold raw strong counts, given back at the thread's exit; a lend
//! counter that keeps them while a call re-enters. Each attack is measured by the heap this
//! binary's allocator counts: a shard whose count is lost stays on the heap after
//! `empty_cache` took it out of its device's table. Out-of-memory and segment observers that
//! allocate on more streams than the cache holds, while it is lent; mallocs from pthread-key
//! and thread-local destructors, after the counts were given back or as the thread's first
//! call; thousands of short threads; panics through the lend. The rest (several allocators,
//! retired streams, device -1, routes, fork, the lazy statistics) is in
//! `tests/hit/cache_hostile_calls.rs`.
use crate::common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::c_void;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use common::process::alone;
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::{Allocator, Error};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: the system allocator's calls, passed through; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The tests of this file one at a time, each then in a process of its own (`alone`): the heap
/// the counting allocator measures is the process's, which the binary's other tests would move.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes left on the heap per round of `round`, after as many rounds again to warm up (tables
/// grown, arc-swap's nodes made).
fn leak_per_round(rounds: usize, mut round: impl FnMut()) -> isize {
    for _ in 0..rounds {
        round();
    }
    let before = LIVE.load(Ordering::SeqCst);
    for _ in 0..rounds {
        round();
    }
    (LIVE.load(Ordering::SeqCst) - before) / rounds as isize
}

/// Streams beyond the four entries of a thread's cache, reused from round to round (the
/// simulated driver keeps a little state per stream handle).
const STREAMS: [usize; 6] = [0x1000, 0x1100, 0x1200, 0x1300, 0x1400, 0x1500];

fn touch(a: &Allocator, streams: &[usize]) {
    for &s in streams {
        let p = a.malloc(512, 0, s).unwrap();
        a.free(p).unwrap();
    }
}

/// `empty_cache`, which takes the shards of streams that hold nothing out of the table: only
/// `holding` streams' are left.
fn retired(a: &Allocator, holding: usize) {
    a.empty_cache(0).unwrap();
    check(a);
    assert_eq!(a.stream_count(0).unwrap(), holding, "a stream's shard stayed in the table");
}

#[test]
fn an_oom_observer_allocating_on_new_streams_loses_no_shard() {
    let _serial = serial();
    if !alone() {
        return;
    }
    let (a, _drv) = sim_with(1, 64 * MIB, Config::pytorch());
    let a = Arc::new(a);
    let weak = Arc::downgrade(&a);
    a.attach_oom_observer(move |_| {
        let a = weak.upgrade().unwrap();
        // While the outer call holds the cache lent: new streams are neither stored nor lost.
        touch(&a, &STREAMS);
        let q = a.malloc(512, 0, 0x10).unwrap();
        a.free(q).unwrap();
        false
    });
    let keep = a.malloc(40 * MIB, 0, 0x10).unwrap();
    let leak = leak_per_round(100, || {
        assert!(matches!(a.malloc(40 * MIB, 0, 0x10), Err(Error::OutOfMemory(_))));
        retired(&a, 1);
    });
    assert!(leak < 64, "{leak} bytes a round stay on the heap: the nested calls' strong counts are lost");
    a.free(keep).unwrap();
    check(&a);
}

#[test]
fn a_segment_observer_allocating_on_new_streams_loses_no_shard() {
    let _serial = serial();
    if !alone() {
        return;
    }
    let (a, _drv) = sim_with(1, 256 * MIB, Config::pytorch());
    let a = Arc::new(a);
    let weak = Arc::downgrade(&a);
    a.attach_segment_observer(move |e| {
        // The large segment's, made while the outer call holds the cache lent.
        if e.kind != gpupool::SegmentEventKind::Alloc || e.bytes < 8 * MIB {
            return;
        }
        let a = weak.upgrade().unwrap();
        for &s in &STREAMS {
            // A new segment from inside a segment observer is refused, after the stream's
            // shard was made: the shard must not outlive its table entry.
            assert!(matches!(a.malloc(512, 0, s), Err(Error::InvalidValue(_))));
        }
    });
    let leak = leak_per_round(100, || {
        // The first malloc caches the stream, the second takes a new segment on the hit path.
        let p = a.malloc(4096, 0, 0x10).unwrap();
        let q = a.malloc(8 * MIB, 0, 0x10).unwrap();
        a.free(p).unwrap();
        a.free(q).unwrap();
        retired(&a, 0);
    });
    assert!(leak < 64, "{leak} bytes a round stay on the heap");
    check(&a);
}

/// What a pthread-key destructor does at its thread's exit: a malloc and free on each stream.
struct AtExit {
    a: Arc<Allocator>,
    streams: &'static [usize],
}

extern "C" fn at_thread_exit(arg: *mut c_void) {
    // SAFETY: the value `exit_key`'s users set: a leaked `Box<AtExit>`.
    let job = unsafe { Box::from_raw(arg.cast::<AtExit>()) };
    touch(&job.a, job.streams);
}

fn exit_key() -> libc::pthread_key_t {
    static KEY: OnceLock<libc::pthread_key_t> = OnceLock::new();
    *KEY.get_or_init(|| {
        let mut key = 0;
        // SAFETY: creates a key whose destructor takes what `on_exit` sets.
        assert_eq!(unsafe { libc::pthread_key_create(&mut key, Some(at_thread_exit)) }, 0);
        key
    })
}

/// Has the calling thread run `streams`' malloc and free from a pthread-key destructor at its
/// exit, which glibc runs after every thread-local destructor.
fn on_exit(a: &Arc<Allocator>, streams: &'static [usize]) {
    let job = Box::into_raw(Box::new(AtExit { a: a.clone(), streams }));
    // SAFETY: the key exists; the destructor takes the box back.
    assert_eq!(unsafe { libc::pthread_setspecific(exit_key(), job.cast()) }, 0);
}

#[test]
fn pthread_key_destructors_allocating_at_thread_exit_lose_no_shard() {
    let _serial = serial();
    if !alone() {
        return;
    }
    let (a, _drv) = sim_with(1, 256 * MIB, Config::pytorch());
    let a = Arc::new(a);
    // The thread used gpupool while it ran (its cache's owner is gone when the destructor
    // runs), or not at all (the destructor's call is its first).
    for used_before in [true, false] {
        let leak = leak_per_round(50, || {
            let a2 = a.clone();
            std::thread::spawn(move || {
                if used_before {
                    touch(&a2, &[0x10, 0x20]);
                }
                on_exit(&a2, &STREAMS);
            })
            .join()
            .unwrap();
            retired(&a, 0);
        });
        // A thread whose first read of arc-swap is made at its exit keeps its debt node (128
        // bytes) for good: arc-swap's thread-local is registered too late to give it back.
        let arc_swap_node = if used_before { 0 } else { 128 };
        assert!(leak <= arc_swap_node, "used before: {used_before}: {leak} bytes a thread stay on the heap");
    }
    check(&a);
}

/// Mallocs and frees on [`STREAMS`] when its thread exits.
struct TouchAtExit(Option<Arc<Allocator>>);

impl Drop for TouchAtExit {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            touch(&a, &STREAMS);
        }
    }
}

thread_local! {
    static BEFORE_OWNER: std::cell::RefCell<TouchAtExit> = const { std::cell::RefCell::new(TouchAtExit(None)) };
    static AFTER_OWNER: std::cell::RefCell<TouchAtExit> = const { std::cell::RefCell::new(TouchAtExit(None)) };
}

#[test]
fn thread_local_destructors_made_before_and_after_the_first_store_lose_no_shard() {
    let _serial = serial();
    if !alone() {
        return;
    }
    let (a, _drv) = sim_with(1, 256 * MIB, Config::pytorch());
    let a = Arc::new(a);
    let leak = leak_per_round(50, || {
        let a2 = a.clone();
        std::thread::spawn(move || {
            // Registered before the thread's first store and after it: destroyed in both
            // orders against anything the store registered.
            BEFORE_OWNER.with(|t| t.borrow_mut().0 = Some(a2.clone()));
            touch(&a2, &[0x10]);
            AFTER_OWNER.with(|t| t.borrow_mut().0 = Some(a2.clone()));
        })
        .join()
        .unwrap();
        retired(&a, 0);
    });
    assert!(leak < 64, "{leak} bytes a thread stay on the heap");
    check(&a);
}

#[test]
fn thousands_of_short_threads_on_many_streams_give_every_count_back() {
    let _serial = serial();
    if !alone() {
        return;
    }
    let (a, _drv) = sim_with(2, 256 * MIB, Config::pytorch());
    let leak = leak_per_round(1000, || {
        // Joined, not only waited for: its exit's destructors have run.
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                touch(&a, &STREAMS);
                let p = a.malloc(4096, 1, 0x1000).unwrap();
                a.free(p).unwrap();
            });
            t.join().unwrap();
        });
        retired(&a, 0);
        a.empty_cache(1).unwrap();
    });
    assert!(leak < 16, "{leak} bytes a thread stay on the heap");
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
}

/// An out-of-memory observer that allocates on more streams than the cache holds, on the
/// outer call's stream and on another device, and fails a request of its own on a cached
/// stream (the cache lent twice over, and no observer called again). Every statistic is exact
/// after, and no shard is lost.
#[test]
fn oom_observers_allocating_on_many_streams_and_devices_under_a_nested_lend() {
    let _serial = serial();
    if !alone() {
        return;
    }
    let (a, _drv) = sim_with(2, 64 * MIB, Config::pytorch());
    let a = Arc::new(a);
    let weak = Arc::downgrade(&a);
    let depth = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let d = depth.clone();
    a.attach_oom_observer(move |_| {
        let a = weak.upgrade().unwrap();
        assert_eq!(d.fetch_add(1, Ordering::SeqCst), 0, "an observer's failed request called the observer");
        touch(&a, &STREAMS);
        let same = a.malloc(512, 0, 0x10).unwrap();
        let other_device = a.malloc(4096, 1, STREAMS[0]).unwrap();
        for s in [0x10, STREAMS[5]] {
            let e = a.malloc(60 * MIB, 0, s).unwrap_err();
            assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
        }
        a.free(same).unwrap();
        a.free(other_device).unwrap();
        d.fetch_sub(1, Ordering::SeqCst);
        false
    });
    let keep = a.malloc(40 * MIB, 0, 0x10).unwrap();
    let leak = leak_per_round(50, || {
        assert!(matches!(a.malloc(40 * MIB, 0, 0x10), Err(Error::OutOfMemory(_))));
        assert_eq!(depth.load(Ordering::SeqCst), 0);
        retired(&a, 1);
        a.empty_cache(1).unwrap();
    });
    assert!(leak < 64, "{leak} bytes a round stay on the heap");
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocation.all.current, s.allocated_bytes.all.current), (1, 40 * MIB as i64));
    assert_eq!(a.stats(1).unwrap().allocation.all.current, 0);
    a.free(keep).unwrap();
    check(&a);
}

/// The observer's panic message.
const OBSERVER_PANIC: &str = "an observer's panic";

/// The simulated driver's panics and [`OBSERVER_PANIC`] go unreported: the test harness keeps
/// what a thread prints, which would count as a leak.
fn quiet_sim_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let msg = payload.downcast_ref::<String>().map(String::as_str);
            let msg = msg.or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("");
            if !msg.ends_with(gpupool::driver::sim::SIM_PANIC_MARK) && msg != OBSERVER_PANIC {
                default(info);
            }
        }));
    });
}

/// A driver panic inside a hit-path call (a cached stream's malloc that takes a new segment)
/// and a panicking observer unwind through the lend: it ends, so the thread's exit still gives
/// every count back, and the statistics are exact.
#[test]
fn a_panic_through_the_lend_ends_it() {
    let _serial = serial();
    if !alone() {
        return;
    }
    quiet_sim_panics();
    let (a, drv) = sim_with(1, 64 * MIB, Config::pytorch());
    let a = Arc::new(a);
    let weak = Arc::downgrade(&a);
    a.attach_oom_observer(move |_| {
        touch(&weak.upgrade().unwrap(), &STREAMS[..2]);
        std::panic::panic_any(OBSERVER_PANIC);
    });
    let leak = leak_per_round(30, || {
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                touch(&a, &[0x10]);
                drv.inject_panic(gpupool::driver::sim::SimOp::MemAlloc, 0);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.malloc(8 * MIB, 0, 0x10)));
                assert!(r.is_err(), "the driver's panic reaches the caller");
                // A free on the hit path whose event for another stream panics.
                let p = a.malloc(512, 0, 0x10).unwrap();
                a.record_stream(p, 0x30).unwrap();
                drv.inject_panic(gpupool::driver::sim::SimOp::EventCreate, 0);
                assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.free(p))).is_err());
                let _ = a.free(p);
                check(&a);
                // Then an observer that panics (caught by gpupool) under a lent cache.
                let keep = a.malloc(40 * MIB, 0, 0x10).unwrap();
                assert!(matches!(a.malloc(40 * MIB, 0, 0x10), Err(Error::OutOfMemory(_))));
                a.free(keep).unwrap();
                // Stores work again: these streams' entries are given back at the exit.
                touch(&a, &STREAMS);
            });
            t.join().unwrap();
        });
        drv.clear_faults();
        retired(&a, 0);
    });
    assert!(leak < 64, "{leak} bytes a round stay on the heap: a lend outlived its call");
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
}
