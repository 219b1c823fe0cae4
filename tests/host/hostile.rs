//! The pinned hit path's shortcut attacked from outside (commit 8af8f2b): each stripe's stack
//! of the blocks it handed out last (`src/host/handed_out.rs`), the rest in its map. Frees in
//! every order, from other threads, twice, after `record_event` from another thread, after
//! `free_after_device_sync`; more threads than stripes freeing each other's blocks; a forked
//! child. Each step is checked against the invariant checker and the statistics.

use std::sync::{Arc, Mutex};

use gpupool::Error;
use gpupool::config::Config;
use gpupool::driver::Driver;
use gpupool::driver::sim::SimDriver;
use gpupool::host::HostAllocator;

/// The blocks a stripe's stack holds (`handed_out::RECENT`).
const RECENT: usize = 8;
const COPY: usize = 0x7000;

fn host() -> (HostAllocator, Arc<SimDriver>) {
    host_with(Config::default())
}

fn host_with(config: Config) -> (HostAllocator, Arc<SimDriver>) {
    let sim = Arc::new(SimDriver::new(2, 1 << 30));
    (HostAllocator::new(sim.clone() as Arc<dyn Driver>, &config), sim)
}

/// Every way to touch a freed pinned block is refused, from this thread and another, and
/// changes nothing.
fn host_refuses_freed(h: &HostAllocator, p: usize) {
    let before = h.stats();
    assert_eq!(h.block_size(p), None, "{p:#x} was freed");
    assert!(matches!(h.free(p), Err(Error::InvalidPointer(_))), "double free of {p:#x} accepted");
    std::thread::scope(|s| {
        s.spawn(|| assert!(matches!(h.free(p), Err(Error::InvalidPointer(_))), "double free from another thread"));
    });
    assert!(matches!(h.record_event(p, COPY), Err(Error::InvalidPointer(_))));
    assert!(matches!(h.free_after_device_sync(p, 0), Err(Error::InvalidPointer(_))));
    assert_eq!(h.stats(), before, "a refused call changed the statistics");
    h.check_invariants();
}

#[test]
fn pinned_blocks_past_the_stack_are_freed_once_in_any_order_from_any_thread() {
    let (h, _sim) = host();
    let n = 3 * RECENT;
    // Forward, backward, newest and oldest in turn, and a scramble.
    let orders: Vec<Vec<usize>> = vec![
        (0..n).collect(),
        (0..n).rev().collect(),
        (0..n / 2).flat_map(|i| [n - 1 - i, i]).collect(),
        (0..n).map(|i| (i * 7 + 3) % n).collect(),
    ];
    for order in orders {
        // Sizes of several classes, so that block_size tells blocks apart.
        let ptrs: Vec<(usize, usize)> = (0..n).map(|i| (h.malloc(64 << (i % 5)).unwrap(), 64 << (i % 5))).collect();
        h.check_invariants();
        for (k, &i) in order.iter().enumerate() {
            let (p, size) = ptrs[i];
            assert_eq!(h.block_size(p), Some(size), "block {i} before its free");
            if k % 3 == 0 {
                std::thread::scope(|s| {
                    s.spawn(|| h.free(p).unwrap());
                });
            } else {
                h.free(p).unwrap();
            }
            host_refuses_freed(&h, p);
            for &(q, qsize) in order[k + 1..].iter().map(|&j| &ptrs[j]) {
                assert_eq!(h.block_size(q), Some(qsize), "a block not freed yet");
            }
        }
        assert_eq!(h.stats().active_requests.current, 0);
    }
}

#[test]
fn record_event_on_a_block_in_another_threads_stack_holds_it_back_at_any_free() {
    let (h, sim) = host();
    sim.hold_stream(COPY);
    // Thread A hands out four blocks: `p` is in the middle of its stripe's stack.
    let (p, others) = std::thread::scope(|s| {
        s.spawn(|| {
            let v: Vec<usize> = (0..4).map(|_| h.malloc(4096).unwrap()).collect();
            (v[1], v)
        })
        .join()
        .unwrap()
    });
    std::thread::scope(|s| {
        s.spawn(|| h.record_event(p, COPY).unwrap());
    });
    h.check_invariants();
    assert_eq!(h.block_size(p), Some(4096));
    let recorded = sim.counts().event_record;
    // Freed by a third thread: the event is recorded, and p waits for it.
    std::thread::scope(|s| {
        s.spawn(|| h.free(p).unwrap());
    });
    assert_eq!(sim.counts().event_record, recorded + 1, "the free recorded no event");
    host_refuses_freed(&h, p);
    // The other blocks of A's stack are freed here, at once, and reused; p is not.
    for &q in others.iter().filter(|&&q| q != p) {
        h.free(q).unwrap();
    }
    let again: Vec<usize> = (0..4).map(|_| h.malloc(4096).unwrap()).collect();
    assert!(!again.contains(&p), "p was handed out while its copy may still read it");
    assert_eq!(h.stats().active_requests.current, 5, "four handed out, p waiting");
    h.check_invariants();
    sim.release_stream(COPY);
    for q in again {
        h.free(q).unwrap();
    }
    let r: Vec<usize> = (0..5).map(|_| h.malloc(4096).unwrap()).collect();
    assert!(r.contains(&p), "p is reused once its event completed");
    for q in r {
        h.free(q).unwrap();
    }
    h.check_invariants();
}

#[test]
fn free_after_device_sync_takes_a_block_from_the_stack_or_the_map_once() {
    let (h, sim) = host();
    let ptrs: Vec<usize> = (0..2 * RECENT).map(|_| h.malloc(8192).unwrap()).collect();
    // The newest (top of the stack), one in its middle, one spilled to the map; one from another
    // thread.
    let picks = [ptrs[2 * RECENT - 1], ptrs[RECENT + 3], ptrs[1]];
    for (k, &p) in picks.iter().enumerate() {
        let waiting = h.free_after_device_sync(p, 0).unwrap();
        assert_eq!(waiting, 8192 * (k + 1));
        host_refuses_freed(&h, p);
    }
    let q = ptrs[RECENT + 5];
    std::thread::scope(|s| {
        s.spawn(|| h.free_after_device_sync(q, 0).unwrap());
    });
    host_refuses_freed(&h, q);
    assert_eq!(h.deferred().blocks, 4);
    // Not reused before the synchronisation; the rest is.
    let rest: Vec<usize> = ptrs.iter().copied().filter(|p| !picks.contains(p) && *p != q).collect();
    for &p in &rest {
        h.free(p).unwrap();
    }
    let again: Vec<usize> = (0..rest.len()).map(|_| h.malloc(8192).unwrap()).collect();
    assert!(again.iter().all(|p| !picks.contains(p) && *p != q), "a deferred block was handed out");
    let syncs = sim.counts().device_synchronize;
    assert_eq!(h.release_deferred().unwrap(), 4);
    assert!(sim.counts().device_synchronize > syncs);
    for p in again {
        h.free(p).unwrap();
    }
    h.check_invariants();
    assert_eq!(h.stats().active_requests.current, 0);
}

#[test]
fn more_threads_than_stripes_churn_and_free_each_others_blocks() {
    churn(Config::default());
}

#[test]
fn more_threads_than_stripes_churn_with_the_background_thread_polling() {
    churn(Config { pinned_use_background_threads: true, ..Config::default() });
}

fn churn(config: Config) {
    let (h, sim) = host_with(config);
    // Blocks handed between threads: each thread frees some of the others'.
    let mailbox: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let threads = 72; // more than the 64 stripes of the largest machine
    std::thread::scope(|s| {
        for t in 0..threads {
            let (h, sim, mailbox) = (&h, &sim, &mailbox);
            s.spawn(move || {
                let mut x = 0x9e37_79b9_u64.wrapping_mul(t as u64 + 1);
                let mut mine: Vec<(usize, usize)> = Vec::new();
                for _ in 0..2000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let size = 1usize << (6 + x % 8);
                    match x % 10 {
                        0..=4 => mine.push((h.malloc(size).unwrap(), size)),
                        5 | 6 if !mine.is_empty() => {
                            let (p, size) = mine.swap_remove((x >> 8) as usize % mine.len());
                            assert_eq!(h.block_size(p), Some(size));
                            if x % 3 == 0 {
                                h.record_event(p, COPY + (x as usize % 3) * 0x100).unwrap();
                            }
                            h.free(p).unwrap();
                        }
                        7 if !mine.is_empty() => mailbox.lock().unwrap().push(mine.pop().unwrap().0),
                        8 => {
                            if let Some(p) = mailbox.lock().unwrap().pop() {
                                if x % 4 == 0 {
                                    h.free_after_device_sync(p, 0).unwrap();
                                } else {
                                    h.free(p).unwrap();
                                }
                            }
                        }
                        9 if t == 0 => {
                            sim.hold_stream(COPY);
                            h.empty_cache().unwrap();
                            sim.release_stream(COPY);
                        }
                        _ => {}
                    }
                }
                for (p, _) in mine {
                    h.free(p).unwrap();
                }
            });
        }
    });
    for p in mailbox.into_inner().unwrap() {
        h.free(p).unwrap();
    }
    h.check_invariants();
    h.release_deferred().unwrap();
    h.empty_cache().unwrap();
    h.check_invariants();
    let st = h.stats();
    assert_eq!((st.active_requests.current, st.allocations.current), (0, 0), "{st:?}");
}

#[test]
fn a_forked_child_is_refused_every_pinned_call() {
    let (h, _sim) = host();
    let kept = h.malloc(4096).unwrap();
    let freed = h.malloc(4096).unwrap();
    h.free(freed).unwrap();
    // SAFETY: the child calls only gpupool (which refuses before any lock) and `_exit`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let refused = |r: Result<(), Error>| matches!(r, Err(Error::DriverUnavailable(_)));
        let ok = matches!(h.malloc(4096), Err(Error::DriverUnavailable(_)))
            && refused(h.free(kept))
            && refused(h.free(freed))
            && refused(h.record_event(kept, COPY))
            && matches!(h.free_after_device_sync(kept, 0), Err(Error::DriverUnavailable(_)))
            // Nothing is allocated in the child (and the lock it would take may be held by a
            // thread the fork did not copy): as the device's `block_info`.
            && h.block_size(kept).is_none();
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child was not refused: {status}");
    h.free(kept).unwrap();
    h.check_invariants();
}
