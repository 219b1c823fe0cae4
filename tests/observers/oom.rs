//! Out of memory, explained: the observers (PyTorch `attachOutOfMemoryObserver`), the one
//! retry an observer may ask for (RMM `failure_callback_resource_adaptor`), and the figures of
//! fragmentation in the error's message, on the simulated device.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak, mpsc};
use std::time::Duration;

use common::{MIB, check, sim};
use gpupool::driver::DevicePtr;
use gpupool::stats::DeviceStats;
use gpupool::stats::summary::format_size;
use gpupool::{Allocator, Error, OomEvent};

const KIB: usize = 1 << 10;

/// What an observer saw: device, requested bytes, statistics.
type Seen = Arc<Mutex<Vec<(i32, usize, DeviceStats)>>>;

/// Attaches an observer that records what it is told and asks for `retry`.
fn recorder(a: &Allocator, retry: bool) -> Seen {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    a.attach_oom_observer(move |e: &OomEvent| {
        s.lock().unwrap().push((e.device, e.requested, *e.stats));
        retry
    });
    seen
}

fn oom_message(r: Result<DevicePtr, Error>) -> String {
    match r {
        Err(Error::OutOfMemory(m)) => m,
        other => panic!("expected an out-of-memory error, got {other:?}"),
    }
}

#[test]
fn an_observer_fires_once_per_failed_request_with_its_device_size_and_statistics() {
    let (a, _) = sim(2, 64 * MIB);
    let seen = recorder(&a, false);
    let keep = a.malloc(3 * MIB, 1, 0).unwrap();

    // Served after release-and-retry: not a failure, no call.
    let cached = a.malloc(30 * MIB, 1, 4).unwrap();
    a.free(cached).unwrap();
    let big = a.malloc(40 * MIB, 1, 5).unwrap();
    assert_eq!(a.stats(1).unwrap().num_alloc_retries, 1);
    assert!(seen.lock().unwrap().is_empty(), "a request that release-and-retry served called an observer");
    a.free(big).unwrap();

    let msg = oom_message(a.malloc(100 * MIB + 7, 1, 0));
    let after = a.stats(1).unwrap();
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        let (device, requested, stats) = seen[0];
        assert_eq!((device, requested), (1, 100 * MIB + 7), "the caller's size, before rounding");
        assert_eq!(stats.num_ooms, 1, "counted before the observers run, as PyTorch does");
        assert_eq!(stats.num_alloc_retries, 2, "the cache was released before the observers ran");
        assert_eq!(stats, after, "nothing changed between the observer and the error");
        assert_eq!(stats.allocated_bytes.all.current, 3 * MIB as i64);
    }
    assert!(msg.contains("for a request of 104857607 bytes"), "{msg}");
    assert!(msg.contains("streams: none in the small pool, 17.00 MiB in the large pool"), "{msg}");
    assert_eq!(a.stats(0).unwrap().num_ooms, 0, "device 0 saw nothing");

    let device_before = after;
    oom_message(a.malloc(200 * MIB, 1, 3));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "once per failed request");
    assert_eq!((seen[1].0, seen[1].1, seen[1].2.num_ooms), (1, 200 * MIB, device_before.num_ooms + 1));
    a.free(keep).unwrap();
    check(&a);
}

#[test]
fn observers_run_in_the_order_attached_and_a_detached_one_no_more() {
    let (a, _) = sim(1, 64 * MIB);
    let order = Arc::new(Mutex::new(Vec::new()));
    let ids: Vec<_> = (0..3)
        .map(|i| {
            let order = order.clone();
            a.attach_oom_observer(move |_: &OomEvent| {
                order.lock().unwrap().push(i);
                false
            })
        })
        .collect();
    oom_message(a.malloc(100 * MIB, 0, 0));
    assert_eq!(*order.lock().unwrap(), [0, 1, 2]);

    assert!(a.detach_oom_observer(ids[1]));
    assert!(!a.detach_oom_observer(ids[1]), "detached already");
    oom_message(a.malloc(100 * MIB, 0, 0));
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 0, 2]);

    assert!(a.detach_oom_observer(ids[0]) && a.detach_oom_observer(ids[2]));
    oom_message(a.malloc(100 * MIB, 0, 0));
    assert_eq!(order.lock().unwrap().len(), 5);
    assert_eq!(a.stats(0).unwrap().num_ooms, 3, "counted with or without observers");
    check(&a);
}

/// An allocator behind an `Arc`, and an observer that, from inside, frees the block in `slot`
/// and asks for a retry when `retry` says so. Counts its calls.
struct Freeing {
    a: Arc<Allocator>,
    slot: Arc<Mutex<Option<DevicePtr>>>,
    calls: Arc<AtomicUsize>,
}

fn freeing_observer(retry: bool) -> Freeing {
    let (a, _) = sim(1, 64 * MIB);
    let a = Arc::new(a);
    let slot: Arc<Mutex<Option<DevicePtr>>> = Arc::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let (weak, s, c): (Weak<Allocator>, _, _) = (Arc::downgrade(&a), slot.clone(), calls.clone());
    a.attach_oom_observer(move |_: &OomEvent| {
        c.fetch_add(1, Ordering::SeqCst);
        if let Some(p) = s.lock().unwrap().take() {
            weak.upgrade().unwrap().free(p).unwrap();
        }
        retry
    });
    Freeing { a, slot, calls }
}

#[test]
fn an_observer_that_frees_a_live_block_and_asks_for_a_retry_serves_the_request() {
    let f = freeing_observer(true);
    let keep = f.a.malloc(40 * MIB, 0, 0).unwrap();
    *f.slot.lock().unwrap() = Some(keep);
    // 24 MiB left on the device: 30 MiB fails until the observer frees `keep`, whose block the
    // retry then takes from the cache.
    let p = f.a.malloc(30 * MIB, 0, 0).unwrap();
    assert_eq!(p, keep, "served from the block the observer freed");
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    let s = f.a.stats(0).unwrap();
    assert_eq!((s.num_ooms, s.num_alloc_retries), (1, 1), "the retry was served from the cache, no release");
    assert_eq!(s.allocated_bytes.all.current, 30 * MIB as i64);
    f.a.free(p).unwrap();
    check(&f.a);
}

#[test]
fn without_the_retry_the_request_fails_though_the_observer_freed_memory() {
    let f = freeing_observer(false);
    let keep = f.a.malloc(40 * MIB, 0, 0).unwrap();
    *f.slot.lock().unwrap() = Some(keep);
    let msg = oom_message(f.a.malloc(30 * MIB, 0, 0));
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    // The message is read after the observers: the freed block is reserved but unallocated.
    assert!(
        msg.contains("0 bytes is allocated by gpupool, and 40.00 MiB is reserved by gpupool but unallocated"),
        "{msg}"
    );
    assert!(msg.contains("none in the small pool, 40.00 MiB in the large pool"), "{msg}");
    // The next request finds what the observer freed.
    assert_eq!(f.a.malloc(30 * MIB, 0, 0).unwrap(), keep);
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    check(&f.a);
}

#[test]
fn a_retry_that_fails_again_calls_no_observer_and_returns_the_error() {
    let f = freeing_observer(true);
    let before = f.a.stats(0).unwrap();
    oom_message(f.a.malloc(100 * MIB, 0, 0));
    assert_eq!(f.calls.load(Ordering::SeqCst), 1, "the observers run once per request");
    let s = f.a.stats(0).unwrap();
    assert_eq!(s.num_ooms, before.num_ooms + 1, "one failed request, counted once");
    assert_eq!(s.num_alloc_retries, before.num_alloc_retries + 2, "the retry released the cache again");
    check(&f.a);
}

#[test]
fn an_observer_holds_no_lock_and_may_call_back_into_the_allocator() {
    // In a thread of its own, so that a deadlock fails the test instead of hanging it.
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (a, drv) = sim(1, 64 * MIB);
        let a = Arc::new(a);
        let keep = a.malloc(40 * MIB, 0, 0).unwrap();
        let weak = Arc::downgrade(&a);
        let nested_failed = Arc::new(AtomicBool::new(false));
        let nf = nested_failed.clone();
        a.attach_oom_observer(move |e: &OomEvent| {
            let a = weak.upgrade().unwrap();
            // The statistics take every shard's lock and the peak lock.
            assert_eq!(a.stats(0).unwrap(), *e.stats);
            // A stream this thread has not used: its shard is created, while the thread's cache of
            // recent shards is lent to the failed call (it is left as it is).
            let q = a.malloc(MIB, 0, 9).unwrap();
            a.free(q).unwrap();
            // The failed request's own stream.
            let r = a.malloc(4 * MIB, 0, 0).unwrap();
            a.free(r).unwrap();
            // A request that fails from inside an observer calls no observer.
            nf.store(matches!(a.malloc(200 * MIB, 0, 0), Err(Error::OutOfMemory(_))), Ordering::SeqCst);
            a.free(keep).unwrap();
            a.empty_cache(0).unwrap();
            assert!(a.memory_summary(0).unwrap().contains("gpupool memory summary"));
            a.check_invariants().unwrap();
            true
        });
        let p = a.malloc(30 * MIB, 0, 0).unwrap();
        assert!(nested_failed.load(Ordering::SeqCst));
        let s = a.stats(0).unwrap();
        assert_eq!(s.num_ooms, 2, "the request and the nested one");
        assert_eq!(s.reserved_bytes.all.current, 30 * MIB as i64, "empty_cache inside released the rest");
        assert_eq!(drv.used(0), 30 * MIB);
        a.free(p).unwrap();
        check(&a);
        done_tx.send(()).unwrap();
    });
    match done_rx.recv_timeout(Duration::from_secs(30)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: the observer waited for a lock"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test's thread panicked (see above)"),
    }
}

#[test]
fn a_panicking_observer_does_not_unwind_into_the_caller() {
    let (a, _) = sim(1, 64 * MIB);
    a.attach_oom_observer(|_: &OomEvent| panic!("an observer that panics"));
    let seen = recorder(&a, false);
    let msg = oom_message(a.malloc(100 * MIB, 0, 0));
    assert!(msg.starts_with("CUDA out of memory."), "{msg}");
    assert_eq!(seen.lock().unwrap().len(), 1, "the next observer still ran");
    assert!(a.malloc(MIB, 0, 0).is_ok());
    check(&a);
}

/// A fragmented device, scripted block by block; the message's figures are computed from it.
#[test]
fn the_message_names_the_largest_free_block_of_each_pool_and_the_inactive_split_bytes() {
    let (a, _) = sim(1, 64 * MIB);
    // Small pool, stream 0: one 2 MiB segment holding a, b, c; b freed leaves a hole, and the
    // tail after c is free.
    let sa = a.malloc(600 * KIB, 0, 0).unwrap();
    let sb = a.malloc(200 * KIB, 0, 0).unwrap();
    let sc = a.malloc(300 * KIB, 0, 0).unwrap();
    a.free(sb).unwrap();
    let small_tail = 2 * MIB - (600 + 200 + 300) * KIB;
    // Large pool, stream 0: one 20 MiB segment holding x, y, z; y freed leaves a 9 MiB hole, the
    // tail is 6 MiB.
    let x = a.malloc(2 * MIB, 0, 0).unwrap();
    let y = a.malloc(9 * MIB, 0, 0).unwrap();
    let z = a.malloc(3 * MIB, 0, 0).unwrap();
    a.free(y).unwrap();
    let large_tail = 20 * MIB - (2 + 9 + 3) * MIB;
    // Large pool, stream 5: a 20 MiB segment holding u; its 12 MiB tail is the largest free
    // block of the device, on another stream than the request's.
    let u = a.malloc(8 * MIB, 0, 5).unwrap();
    let other_tail = 20 * MIB - 8 * MIB;

    let largest_small = (200 * KIB).max(small_tail);
    let largest_large = (9 * MIB).max(large_tail).max(other_tail);
    let inactive = 200 * KIB + small_tail + 9 * MIB + large_tail + other_tail;
    let reserved = 2 * MIB + 20 * MIB + 20 * MIB;
    let allocated = (600 + 300) * KIB + (2 + 3 + 8) * MIB;
    let s = a.stats(0).unwrap();
    assert_eq!(s.inactive_split_bytes.all.current, inactive as i64, "the script's arithmetic");
    assert_eq!(s.reserved_bytes.all.current - s.allocated_bytes.all.current, (reserved - allocated) as i64);
    assert_eq!(largest_small, 948 * KIB);
    assert_eq!(largest_large, 12 * MIB);

    // Every segment holds a live block: release-and-retry frees nothing, and 30 MiB does not
    // fit in the 22 MiB the device has left.
    let msg = oom_message(a.malloc(30 * MIB, 0, 0));
    let expect = [
        format!(
            "GPU 0 has a total capacity of 64.00 MiB of which {} is free",
            format_size((64 * MIB - reserved) as u64)
        ),
        format!(
            "{} is allocated by gpupool, and {} is reserved by gpupool but unallocated",
            format_size(allocated as u64),
            format_size((reserved - allocated) as u64)
        ),
        format!("{} is in inactive split blocks", format_size(inactive as u64)),
        format!(
            "Largest free block over all streams: {} in the small pool, {} in the large pool.",
            format_size(largest_small as u64),
            format_size(largest_large as u64)
        ),
    ];
    for e in &expect {
        assert!(msg.contains(e.as_str()), "missing {e:?} in {msg}");
    }
    // Room left for the memory fraction's sentence (about 80 bytes) and the function's name
    // within the 1023 bytes that gpupool_last_error_message keeps.
    assert!(msg.len() < 900, "{} bytes: {msg}", msg.len());
    for p in [sa, sc, x, z, u] {
        a.free(p).unwrap();
    }
    check(&a);
}

#[test]
fn observers_attach_and_detach_while_other_threads_fail() {
    let (a, _) = sim(1, 64 * MIB);
    let a = Arc::new(a);
    let stop = Arc::new(AtomicBool::new(false));
    let late = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let failers: Vec<_> = (0..3)
        .map(|t| {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    assert!(matches!(a.malloc(100 * MIB, 0, t), Err(Error::OutOfMemory(_))));
                    let p = a.malloc(MIB, 0, t).unwrap();
                    a.free(p).unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    // Each observer checks that it is not called once its detach has returned.
    for _ in 0..200 {
        let alive = Arc::new(AtomicBool::new(true));
        let (al, lt, c) = (alive.clone(), late.clone(), calls.clone());
        let id = a.attach_oom_observer(move |_: &OomEvent| {
            c.fetch_add(1, Ordering::SeqCst);
            if !al.load(Ordering::SeqCst) {
                lt.fetch_add(1, Ordering::SeqCst);
            }
            std::thread::yield_now();
            if !al.load(Ordering::SeqCst) {
                lt.fetch_add(1, Ordering::SeqCst);
            }
            false
        });
        std::thread::sleep(Duration::from_micros(50));
        assert!(a.detach_oom_observer(id));
        alive.store(false, Ordering::SeqCst);
    }
    stop.store(true, Ordering::Relaxed);
    let rounds: usize = failers.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(rounds > 0 && calls.load(Ordering::SeqCst) > 0, "{rounds} rounds, {calls:?} calls");
    assert_eq!(late.load(Ordering::SeqCst), 0, "an observer ran after its detach returned");
    assert_eq!(a.stats(0).unwrap().num_ooms, rounds as i64, "each round failed once");
    check(&a);
}
