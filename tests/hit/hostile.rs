//! The device hit path's shortcuts attacked from outside (commit ef924d7): the shard's hint of
//! the block it handed out last (`ShardState::allocated`), and the thread's shard cache read by
//! address (`src/caching/allocator/hit.rs`). Frees twice, from other threads, after
//! `record_stream`, after `free_after_device_sync`, after the block's address went to another
//! block or another stream's shard; an out-of-memory observer that frees while the cache is
//! lent; thread-local destructors that free and allocate at thread exit. Each step is checked
//! against the invariant checker and the statistics.
use crate::common;

use std::sync::{Arc, Mutex};

use common::{MIB, check, sim_with};
use gpupool::Allocator;
use gpupool::Error;
use gpupool::config::Config;

fn expandable() -> Config {
    Config { expandable_segments: true, expandable_large_pages: false, ..Config::default() }
}

/// Every way to touch a freed device block is refused and changes nothing.
fn device_refuses_freed(a: &Allocator, p: u64) {
    let before = a.stats(0).unwrap();
    assert_eq!(a.block_info(p), None, "{p:#x} was freed");
    let e = a.free(p).unwrap_err();
    assert!(matches!(e, Error::InvalidPointer(_)), "{e}");
    std::thread::scope(|s| {
        s.spawn(|| assert!(matches!(a.free(p), Err(Error::InvalidPointer(_))), "double free from another thread"));
    });
    assert!(matches!(a.record_stream(p, 0x30), Err(Error::InvalidPointer(_))));
    assert!(matches!(a.free_after_device_sync(p), Err(Error::InvalidPointer(_))));
    assert_eq!(a.stats(0).unwrap(), before, "a refused call changed the statistics");
    check(a);
}

#[test]
fn the_last_block_handed_out_is_freed_once_after_its_address_moves_on() {
    for config in [Config::pytorch(), expandable()] {
        let (a, drv) = sim_with(1, 256 * MIB, config);
        // The hint names p; p merges away into its segment's free head, and the head is handed
        // out at p's address under another id; then p's id is handed out elsewhere.
        let head = a.malloc(512, 0, 0x10).unwrap();
        let p = a.malloc(512, 0, 0x10).unwrap();
        a.free(head).unwrap();
        a.free(p).unwrap();
        device_refuses_freed(&a, p);
        let big = a.malloc(4096, 0, 0x10).unwrap();
        assert_eq!(big, head, "the merged block is handed out again");
        let q = a.malloc(512, 0, 0x10).unwrap();
        assert_eq!(a.block_info(q).map(|i| i.size), Some(512));
        a.free(q).unwrap();
        device_refuses_freed(&a, q);
        // p's address is inside `big` now: a free of it is an interior pointer.
        assert!(matches!(a.free(p), Err(Error::InvalidPointer(_))));
        a.free(big).unwrap();
        device_refuses_freed(&a, big);
        // Another stream's shard gets the address after the segment went back to the driver;
        // this thread's cache still names the first shard, whose hint names the address.
        let r = a.malloc(512, 0, 0x10).unwrap();
        a.free(r).unwrap();
        a.empty_cache(0).unwrap();
        let other = std::thread::scope(|s| s.spawn(|| a.malloc(512, 0, 0x20).unwrap()).join().unwrap());
        assert_eq!(a.block_info(other).map(|i| i.stream), Some(0x20));
        if other == r {
            // The first shard refuses (its hint's slot is gone), the index finds the second.
            a.free(other).unwrap();
        } else {
            device_refuses_freed(&a, r);
            a.free(other).unwrap();
        }
        device_refuses_freed(&a, other);
        // record_stream, then free: the block waits for its event, the hint is not believed.
        drv.hold_stream(0x30);
        let s = a.malloc(1000, 0, 0x10).unwrap();
        a.record_stream(s, 0x30).unwrap();
        a.free(s).unwrap();
        device_refuses_freed(&a, s);
        let t = a.malloc(1000, 0, 0x10).unwrap();
        assert_ne!(t, s, "handed out while its event is pending");
        a.free(t).unwrap();
        drv.release_stream(0x30);
        a.empty_cache(0).unwrap();
        check(&a);
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    }
}

/// Random mallocs and frees on two streams, from this thread and another, with
/// `record_stream`, `free_after_device_sync` and `empty_cache`; after every step a freed address
/// that no live block took again is refused every way.
#[test]
fn freed_addresses_stay_refused_through_a_random_churn() {
    let configs = [Config::pytorch(), expandable(), Config { max_split_size: 2 * MIB, ..Config::pytorch() }];
    // The last one twice, the second time with the history on (its frees skip the hint).
    for (c, config) in configs.into_iter().chain([expandable()]).enumerate() {
        let (a, drv) = sim_with(1, 512 * MIB, config);
        if c == 3 {
            common::history::record_all(&a, gpupool::history::HistoryContext::All);
        }
        let mut x = 0x2545_f491_4f6c_dd1d_u64 + c as u64;
        let mut live: Vec<u64> = Vec::new();
        let mut dead: Vec<u64> = Vec::new();
        let sizes = [512, 1000, 1024, 4096, MIB + 1, 3 * MIB, 12 * MIB];
        for _ in 0..4000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let pick = (x >> 16) as usize;
            match x % 12 {
                0..=4 if live.len() < 32 => {
                    let stream = [0x10, 0x20][pick % 2];
                    if let Ok(p) = a.malloc(sizes[pick % sizes.len()], 0, stream) {
                        assert!(!live.contains(&p), "{p:#x} handed out twice");
                        dead.retain(|&d| d != p);
                        live.push(p);
                    }
                }
                5..=7 if !live.is_empty() => {
                    let p = live.swap_remove(pick % live.len());
                    if x % 5 == 0 {
                        std::thread::scope(|s| s.spawn(|| a.free(p).unwrap()).join().unwrap());
                    } else {
                        a.free(p).unwrap();
                    }
                    dead.push(p);
                }
                8 if !live.is_empty() => {
                    let p = live.swap_remove(pick % live.len());
                    a.free_after_device_sync(p).unwrap();
                    dead.push(p);
                }
                9 if !live.is_empty() => a.record_stream(live[pick % live.len()], 0x30).unwrap(),
                10 => {
                    if pick % 2 == 0 {
                        drv.hold_stream(0x30)
                    } else {
                        drv.release_stream(0x30)
                    }
                }
                11 => {
                    if pick % 4 == 0 {
                        a.empty_cache(0).unwrap();
                    } else {
                        a.release_deferred(0).unwrap();
                    }
                }
                _ => {}
            }
            // A dead address inside a live block is an interior pointer: refused too.
            if let Some(&d) = dead.get(pick % dead.len().max(1)) {
                device_refuses_freed(&a, d);
            }
        }
        for p in live {
            a.free(p).unwrap();
        }
        drv.release_stream(0x30);
        a.empty_cache(0).unwrap();
        check(&a);
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    }
}

#[test]
fn an_oom_observer_frees_the_last_block_while_the_cache_is_lent() {
    let (a, _drv) = sim_with(1, 64 * MIB, Config::pytorch());
    let a = Arc::new(a);
    let last = Arc::new(Mutex::new(None::<u64>));
    let (weak, slot) = (Arc::downgrade(&a), last.clone());
    a.attach_oom_observer(move |_| {
        let a = weak.upgrade().unwrap();
        if let Some(p) = slot.lock().unwrap().take() {
            // The block the outer call's shard handed out last: once, then refused.
            a.free(p).unwrap();
            assert!(matches!(a.free(p), Err(Error::InvalidPointer(_))));
            // A hit on the same stream, while the outer call holds the thread's cache.
            let q = a.malloc(512, 0, 0x10).unwrap();
            a.free(q).unwrap();
            assert!(matches!(a.free(q), Err(Error::InvalidPointer(_))));
        }
        true
    });
    let keep = a.malloc(40 * MIB, 0, 0x10).unwrap();
    let p = a.malloc(512, 0, 0x10).unwrap();
    *last.lock().unwrap() = Some(p);
    assert!(matches!(a.malloc(40 * MIB, 0, 0x10), Err(Error::OutOfMemory(_))));
    assert!(last.lock().unwrap().is_none(), "the observer ran");
    device_refuses_freed(&a, p);
    a.free(keep).unwrap();
    check(&a);
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
}

/// Frees its block, allocates and frees again, and frees each twice, when its thread exits.
struct FreeAtExit(Arc<Allocator>, u64);

impl Drop for FreeAtExit {
    fn drop(&mut self) {
        let a = &self.0;
        a.free(self.1).unwrap();
        assert!(matches!(a.free(self.1), Err(Error::InvalidPointer(_))));
        let q = a.malloc(512, 0, 0x10).unwrap();
        a.free(q).unwrap();
        assert!(matches!(a.free(q), Err(Error::InvalidPointer(_))));
    }
}

thread_local! {
    static FIRST: std::cell::RefCell<Option<FreeAtExit>> = const { std::cell::RefCell::new(None) };
    static LAST: std::cell::RefCell<Option<FreeAtExit>> = const { std::cell::RefCell::new(None) };
}

#[test]
fn thread_local_destructors_free_and_allocate_at_thread_exit() {
    let (a, _drv) = sim_with(1, 64 * MIB, Config::pytorch());
    let a = Arc::new(a);
    for _ in 0..4 {
        let a2 = a.clone();
        std::thread::spawn(move || {
            // One destructor registered before the thread's shard cache, one after.
            FIRST.with(|f| *f.borrow_mut() = Some(FreeAtExit(a2.clone(), 0)));
            let p = a2.malloc(512, 0, 0x10).unwrap();
            let q = a2.malloc(1024, 0, 0x10).unwrap();
            FIRST.with(|f| f.borrow_mut().as_mut().unwrap().1 = p);
            LAST.with(|f| *f.borrow_mut() = Some(FreeAtExit(a2.clone(), q)));
        })
        .join()
        .unwrap();
    }
    check(&a);
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
}

#[test]
fn a_block_freed_while_its_pool_sleeps_is_freed_once() {
    for mode in [gpupool::SleepMode::Offload, gpupool::SleepMode::Discard, gpupool::SleepMode::OffloadPinned] {
        let (a, _drv) = sim_with(1, 256 * MIB, expandable());
        let pool = a.pool_create_sleepable();
        a.begin_allocate_to_pool(0, pool, 0x10).unwrap();
        let keep = a.malloc(4096, 0, 0x10).unwrap();
        let p = a.malloc(512, 0, 0x10).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        // This thread's cache names the default pool's shard of the same stream.
        let q = a.malloc(512, 0, 0x10).unwrap();
        a.sleep(0, pool, mode).unwrap();
        a.free(p).unwrap();
        device_refuses_freed(&a, p);
        a.free(q).unwrap();
        device_refuses_freed(&a, q);
        a.wake(0, pool).unwrap();
        device_refuses_freed(&a, p);
        a.begin_allocate_to_pool(0, pool, 0x10).unwrap();
        let r = a.malloc(512, 0, 0x10).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        a.free(r).unwrap();
        device_refuses_freed(&a, r);
        a.free(keep).unwrap();
        a.release_pool(0, pool).unwrap();
        a.empty_cache(0).unwrap();
        check(&a);
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0, "{mode:?}");
    }
}
