//! The rules of a pool's limit: what counts, the release of the pool's own cache before a
//! refusal, the message, the observers, pool 0, expandable segments, and bad arguments.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{MIB, check, sim, sim_with};
use gpupool::config::Config;
use gpupool::{Allocator, Error};

const S: usize = 0x51;

fn reserved(a: &Allocator, pool: u64) -> i64 {
    a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current
}

fn oom_message(r: Result<u64, Error>) -> String {
    match r {
        Err(e @ Error::OutOfMemory(_)) => e.message().to_string(),
        other => panic!("not out of memory: {other:?}"),
    }
}

/// A pool over its limit releases its own free cache first, then fails, naming the pool, its
/// limit and its use; another pool's cache and the device's statistics are left alone.
#[test]
fn a_pool_releases_its_own_cache_then_fails_naming_its_limit() {
    let (a, drv) = sim(1, 1 << 30);
    let (tenant, other) = (a.pool_create(), a.pool_create());
    // The other pool caches 40 MiB, free.
    a.begin_allocate_to_pool_thread(0, other).unwrap();
    let p = a.malloc(40 * MIB, 0, S).unwrap();
    a.free(p).unwrap();
    a.end_allocate_to_pool(0, other).unwrap();
    a.pool_set_limit(0, tenant, Some(64 * MIB as u64)).unwrap();
    assert_eq!(a.pool_limit(0, tenant).unwrap(), Some(64 * MIB as u64));
    assert_eq!(a.pool_stats(0, tenant).unwrap().stats.pool_limit, Some(64 * MIB as i64));
    a.begin_allocate_to_pool_thread(0, tenant).unwrap();
    let x = a.malloc(40 * MIB, 0, S).unwrap();
    a.free(x).unwrap();
    // 40 cached + 50 new passes 64: the pool's 40 go back, and 50 fits.
    let frees = drv.counts().mem_free;
    let y = a.malloc(50 * MIB, 0, S).unwrap();
    assert_eq!(drv.counts().mem_free, frees + 1, "the pool's own cached segment went back");
    assert_eq!(reserved(&a, tenant), 50 * MIB as i64);
    assert_eq!(reserved(&a, other), 40 * MIB as i64, "the other pool's cache is untouched");
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    // 50 held + 20 passes 64 with nothing cached: refused.
    let msg = oom_message(a.malloc(20 * MIB, 0, S));
    for part in [format!("pool {tenant:#x}"), "limited to 64.00 MiB".into(), "reserves 50.00 MiB".into()] {
        assert!(msg.contains(&part), "{part:?} not in: {msg}");
    }
    assert_eq!(a.stats(0).unwrap().num_ooms, 1);
    assert_eq!(reserved(&a, other), 40 * MIB as i64, "still untouched");
    check(&a);
    // A small request still fits the 14 MiB left (a 2 MiB segment).
    let z = a.malloc(MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, tenant).unwrap();
    for p in [y, z] {
        a.free(p).unwrap();
    }
    check(&a);
}

/// The observers see a budget's refusal; one that raises the limit and asks for another
/// attempt gets the request served; one that allocates from the refused pool is refused
/// itself, with no observer called again and no deadlock.
#[test]
fn observers_see_a_refusal_and_may_re_enter() {
    let (a, _drv) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let pool = a.pool_create();
    a.pool_set_limit(0, pool, Some(8 * MIB as u64)).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let (a2, c2) = (a.clone(), calls.clone());
    let id = a.attach_oom_observer(move |e| {
        c2.fetch_add(1, Ordering::SeqCst);
        assert_eq!(e.device, 0);
        // Re-entry: an allocation of the same pool (this thread is routed) is refused too.
        assert!(matches!(a2.malloc(16 * MIB, 0, S), Err(Error::OutOfMemory(_))));
        a2.pool_set_limit(0, pool, Some(32 * MIB as u64)).unwrap();
        true
    });
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let p = a.malloc(16 * MIB, 0, S).expect("served after the observer raised the limit");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "called once: the nested refusal calls none");
    assert_eq!(a.stats(0).unwrap().num_ooms, 2, "the request and the observer's own");
    a.free(p).unwrap();
    // Asked for nothing: the refusal stands.
    a.detach_oom_observer(id);
    let c3 = calls.clone();
    a.attach_oom_observer(move |_| {
        c3.fetch_add(1, Ordering::SeqCst);
        false
    });
    assert!(matches!(a.malloc(64 * MIB, 0, S), Err(Error::OutOfMemory(_))));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    a.end_allocate_to_pool(0, pool).unwrap();
    check(&a);
}

/// Pool 0 is the default pools, every stream's together, with expandable segments (the
/// default): mapped pages count, unmapped ones do not, and the count equals the reserved
/// bytes at every step.
#[test]
fn the_default_pools_limit_counts_mapped_pages_of_every_stream() {
    let (a, _drv) = sim_with(1, 1 << 30, Config::default());
    let p = a.malloc(30 * MIB, 0, 1).unwrap();
    let q = a.malloc(30 * MIB, 0, 2).unwrap();
    // Exactly what the two streams map: nothing more fits.
    let held = a.stats(0).unwrap().reserved_bytes.all.current;
    a.pool_set_limit(0, 0, Some(held as u64)).unwrap();
    assert_eq!(a.stats(0).unwrap().pool_limit, Some(held));
    check(&a);
    let msg = oom_message(a.malloc(10 * MIB, 0, 3));
    assert!(msg.contains("the default pools (pool 0)"), "{msg}");
    a.free(q).unwrap();
    // Stream 2's free pages are the pool's own cache: unmapped, and the request fits.
    let r = a.malloc(10 * MIB, 0, 3).unwrap();
    check(&a);
    assert!(a.stats(0).unwrap().reserved_bytes.all.current <= held);
    assert_eq!(a.stats(0).unwrap().num_ooms, 1);
    for x in [p, r] {
        a.free(x).unwrap();
    }
    a.pool_set_limit(0, 0, None).unwrap();
    assert_eq!(a.pool_limit(0, 0).unwrap(), None);
    assert_eq!(a.stats(0).unwrap().pool_limit, None);
    check(&a);
}

/// Bad arguments get a status and a message naming the problem, and change nothing.
#[test]
fn bad_arguments_change_nothing() {
    let (a, _drv) = sim(1, 1 << 30);
    let pool = a.pool_create();
    a.pool_set_limit(0, pool, Some(MIB as u64)).unwrap();
    let invalid = |r: Result<(), Error>, what: &str| match r {
        Err(e @ Error::InvalidValue(_)) => assert!(e.message().contains(what), "{what:?} not in {}", e.message()),
        other => panic!("{other:?}"),
    };
    invalid(a.pool_set_limit(0, pool + 1000, Some(1)), "never created");
    invalid(a.pool_set_limit(0, pool, Some(u64::MAX - 1)), "over 2^63-1");
    assert!(a.pool_set_limit(5, pool, Some(1)).is_err(), "device out of range");
    assert!(a.pool_limit(0, pool + 1000).is_err());
    assert_eq!(a.pool_limit(0, pool).unwrap(), Some(MIB as u64), "unchanged");
    // Limits of 0, of the whole i64 range and past the device are accepted.
    a.pool_set_limit(0, pool, Some(0)).unwrap();
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    assert!(matches!(a.malloc(512, 0, S), Err(Error::OutOfMemory(_))), "0: nothing new");
    a.pool_set_limit(0, pool, Some(4 << 30)).unwrap();
    let p = a.malloc(512, 0, S).unwrap();
    // Past the device's 1 GiB, the device's own out of memory comes first, with its message.
    let msg = oom_message(a.malloc(2 << 30, 0, S));
    assert!(msg.contains("total capacity"), "{msg}");
    a.pool_set_limit(0, pool, Some(u64::MAX)).unwrap();
    assert_eq!(a.pool_limit(0, pool).unwrap(), None);
    a.free(p).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    check(&a);
}

/// A pool released with a limit set: its limit stays readable while its memory drains, a new
/// limit is refused, and once it holds nothing its budget is forgotten with it.
#[test]
fn a_released_pool_keeps_its_limit_until_forgotten() {
    let (a, _drv) = sim(1, 1 << 30);
    let pool = a.pool_create();
    a.pool_set_limit(0, pool, Some(32 * MIB as u64)).unwrap();
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let p = a.malloc(4 * MIB, 0, S).unwrap();
    a.release_pool(0, pool).unwrap();
    match a.pool_set_limit(0, pool, Some(MIB as u64)) {
        Err(e @ Error::InvalidValue(_)) => assert!(e.message().contains("released"), "{}", e.message()),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.pool_limit(0, pool).unwrap(), Some(32 * MIB as u64));
    check(&a);
    a.free(p).unwrap();
    a.all_pool_stats(0).unwrap();
    assert_eq!(a.pool_limit(0, pool).unwrap(), None, "forgotten with the pool");
    assert_eq!(reserved(&a, pool), 0);
    check(&a);
}

/// A sleepable pool's segments are expandable: its limit counts the pages it maps, and its
/// sleep and wake leave the count as it was.
#[test]
fn a_sleepable_pool_counts_its_pages_across_a_sleep() {
    let (a, _drv) = sim_with(1, 1 << 30, Config::default());
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let p = a.malloc(10 * MIB, 0, S).unwrap();
    let held = reserved(&a, pool);
    a.pool_set_limit(0, pool, Some(held as u64)).unwrap();
    assert!(matches!(a.malloc(held as usize, 0, S), Err(Error::OutOfMemory(_))));
    a.end_allocate_to_pool(0, pool).unwrap();
    let before = reserved(&a, pool);
    a.sleep(0, pool, gpupool::SleepMode::Discard).unwrap();
    check(&a);
    a.wake(0, pool).unwrap();
    assert_eq!(reserved(&a, pool), before);
    check(&a);
    a.free(p).unwrap();
    check(&a);
}

/// An observer that frees a block of the refused pool and asks for another attempt gets the
/// request served: the attempt releases the pool's cache again, the freed segment with it.
#[test]
fn an_observer_that_frees_the_pools_block_gets_the_request_served() {
    let (a, _drv) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let pool = a.pool_create();
    a.pool_set_limit(0, pool, Some(32 * MIB as u64)).unwrap();
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let held = Arc::new(std::sync::atomic::AtomicU64::new(a.malloc(20 * MIB, 0, S).unwrap()));
    // Weak: an observer holding the allocator it observes would keep it alive for good.
    let (a2, h2) = (Arc::downgrade(&a), held.clone());
    a.attach_oom_observer(move |_| {
        let p = h2.swap(0, Ordering::SeqCst);
        p != 0 && a2.upgrade().is_some_and(|a| a.free(p).is_ok())
    });
    // 20 held + 24 new passes 32; once the observer frees the 20, they go back and 24 fits.
    let p = a.malloc(24 * MIB, 0, S).expect("served after the observer freed the pool's block");
    assert_eq!(held.load(Ordering::SeqCst), 0);
    assert_eq!(reserved(&a, pool), 24 * MIB as i64);
    a.free(p).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    check(&a);
}

/// A private pool refused by its budget while its stream captures: the error names the budget,
/// nothing is released (that would synchronise) and the capture survives.
#[test]
fn a_refusal_during_capture_names_the_budget_and_keeps_the_capture() {
    use gpupool::driver::CaptureMode;
    let (a, drv) = sim(1, 1 << 30);
    let pool = a.pool_create();
    a.pool_set_limit(0, pool, Some(32 * MIB as u64)).unwrap();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let p = a.malloc(20 * MIB, 0, S).unwrap();
    a.free(p).unwrap();
    drv.begin_capture(S, CaptureMode::Global).unwrap();
    let frees = drv.counts().mem_free;
    let msg = oom_message(a.malloc(24 * MIB, 0, S));
    assert!(msg.contains("gpupool_pool_set_limit") && msg.contains(&format!("pool {pool:#x}")), "{msg}");
    assert_eq!(drv.counts().mem_free, frees, "nothing released during the capture");
    assert!(drv.end_capture(S).unwrap(), "the capture survived");
    assert_eq!(drv.counts().capture_violations, 0);
    a.end_allocate_to_pool(0, pool).unwrap();
    check(&a);
}

/// A growth its pool's budget refuses makes nothing: the budget is charged before a range is
/// reserved or a segment made (as PyTorch `alloc_block` checks its memory fraction before
/// `try_allocate_expandable_block` reserves one), so the segments, the reserved bytes and
/// their peaks stay exactly as they were. With expandable segments on and off, in the default
/// pools and in a private pool; a request that needs a new range or segment, and one that
/// would map pages in a range the pool has.
#[test]
fn a_refused_growth_leaves_segments_reserved_bytes_and_their_peaks_as_they_were() {
    for expandable_segments in [false, true] {
        for private in [false, true] {
            let case = format!("expandable_segments {expandable_segments}, private pool {private}");
            let (a, drv) = sim_with(1, 1 << 30, Config { expandable_segments, ..Config::default() });
            let pool = if private { a.pool_create() } else { 0 };
            if private {
                a.begin_allocate_to_pool_thread(0, pool).unwrap();
            }
            // Half of a small segment (or of a small range's first page) held: nothing of the
            // pool is free to release, and its next small growth is in that range.
            let p = a.malloc(MIB, 0, S).unwrap();
            let q = a.malloc(MIB, 0, S).unwrap();
            let held = a.stats(0).unwrap().reserved_bytes.all.current;
            a.pool_set_limit(0, pool, Some(held as u64)).unwrap();
            let state = |a: &Allocator| {
                let s = a.stats(0).unwrap();
                let own = if private { Some(a.pool_stats(0, pool).unwrap().stats) } else { None };
                let own = own.map(|o| (o.segment, o.reserved_bytes));
                (s.segment, s.reserved_bytes, s.oversize_segments, own)
            };
            let (before, calls) = (state(&a), drv.counts());
            // A large request (a new range or segment of its own), then a small one (pages in
            // the small range, or a new small segment).
            for size in [100 * MIB, MIB] {
                let msg = oom_message(a.malloc(size, 0, S));
                assert!(msg.contains("gpupool_pool_set_limit"), "{case}: {msg}");
                assert_eq!(state(&a), before, "{case}: a refused {size}-byte growth changed the statistics");
                check(&a);
            }
            let after = drv.counts();
            assert_eq!(after.address_reserve, calls.address_reserve, "{case}: a range was reserved");
            assert_eq!(after.mem_alloc, calls.mem_alloc, "{case}: a segment was made");
            assert_eq!(after.mem_create, calls.mem_create, "{case}: a page was made");
            for x in [p, q] {
                a.free(x).unwrap();
            }
            if private {
                a.end_allocate_to_pool(0, pool).unwrap();
            }
            check(&a);
        }
    }
}

/// A growth of expandable segments tries its page sizes in turn (2 MiB pages first where they
/// round less): one refused by the device and the next by the limit is the device's refusal,
/// whose path releases every pool's cache, not the limit's, which releases the pool's own only.
#[test]
fn a_request_within_the_limit_that_the_device_refuses_takes_the_devices_path() {
    // 256 MiB, 140 of it cached free by a private pool; the default pools limited to 130 MiB.
    // 128 MiB: 64 small pages (128 MiB, within the limit, past the 116 MiB the driver has)
    // first, then seven of 20 MiB (140 MiB, past the limit). Releasing the private pool's
    // cache serves it in small pages, within the limit.
    let (a, drv) = sim_with(1, 256 * MIB, Config::default());
    let pool = a.pool_create();
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let p = a.malloc(140 * MIB, 0, 0x70).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(p).unwrap();
    a.pool_set_limit(0, 0, Some(130 * MIB as u64)).unwrap();
    let q = a.malloc(128 * MIB, 0, S).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reserved(&a, pool), 0, "the private pool's cache went back to the driver");
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    check(&a);
    a.free(q).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(drv.used(0), 0);
}

/// PyTorch #189504's case under a limit (`tests/core/oom_retry.rs` without one): a block freed
/// behind another stream's event fits the request, and the limit refuses a growth. The limit's
/// path waits for the pool's events as release-and-retry does, and serves it from the pool.
#[test]
fn a_block_freed_behind_an_event_serves_a_request_the_limit_refuses_to_grow() {
    for config in [Config::pytorch(), Config::default()] {
        let (a, drv) = sim_with(1, 1 << 30, config);
        a.pool_set_limit(0, 0, Some(100 * MIB as u64)).unwrap();
        let x = a.malloc(60 * MIB, 0, S).unwrap();
        let y = a.malloc(30 * MIB, 0, S).unwrap();
        a.record_stream(x, 0x52).unwrap();
        drv.hold_stream(0x52);
        a.free(x).unwrap();
        let before = a.stats(0).unwrap().reserved_bytes.all.current;
        let again = a.malloc(60 * MIB, 0, S).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(drv.counts().event_synchronize, 1, "the event waited for");
        let s = a.stats(0).unwrap();
        assert_eq!((s.reserved_bytes.all.current, s.num_ooms), (before, 0), "served from the pool");
        check(&a);
        for p in [again, y] {
            a.free(p).unwrap();
        }
        drv.release_stream(0x52);
        a.empty_cache(0).unwrap();
        assert_eq!(drv.used(0), 0);
    }
}
