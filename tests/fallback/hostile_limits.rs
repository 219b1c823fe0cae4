//! The outside red team's attacks on the limits around a fallback (issue 43): a growth of 2^63
//! bytes in flight must let no other growth past a pool's budget or the device's memory
//! fraction (it was charged as a negative count while the driver, here the pool's own
//! allocator, was asked).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{MIB, check, sim};
use gpupool::{Allocator, Error};

use crate::rules::S;

/// Runs a request of 2^63 bytes on stream `S + 1` routed (by thread) to `pool`, whose
/// allocator waits, while that growth is charged, until the test's request of `size` bytes on
/// `stream` (routed to `pool` too when `routed`) has returned, or two seconds passed: that
/// request then waits for the first one's lock on an out-of-memory path, which is what a
/// refusal does. The second request's result.
fn while_a_huge_growth_is_charged(a: &Arc<Allocator>, pool: u64, routed: bool, size: usize) -> Result<u64, Error> {
    use std::sync::mpsc::channel;
    use std::time::Duration;
    let ((charged_tx, charged), (go, go_rx)) = (channel::<()>(), channel::<()>());
    *HOOK.lock() = Some((charged_tx, go_rx));
    let huge = std::thread::spawn({
        let a = a.clone();
        move || {
            a.begin_allocate_to_pool_thread(0, pool).unwrap();
            a.malloc(1 << 63, 0, S + 1)
        }
    });
    let in_flight = charged.recv_timeout(Duration::from_secs(2)).is_ok();
    let (done_tx, done) = channel();
    let b = {
        let a = a.clone();
        std::thread::spawn(move || {
            if routed {
                a.begin_allocate_to_pool_thread(0, pool).unwrap();
            }
            done_tx.send(a.malloc(size, 0, S + 2)).unwrap()
        })
    };
    let early = done.recv_timeout(Duration::from_secs(2)).ok();
    if in_flight {
        go.send(()).unwrap();
    }
    let r = early.unwrap_or_else(|| done.recv().unwrap());
    b.join().unwrap();
    assert!(huge.join().unwrap().is_err(), "2^63 bytes are never served");
    r
}

type Hook = (std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>);
/// The channels of [`while_a_huge_growth_is_charged`]'s allocator.
static HOOK: parking_lot::Mutex<Option<Hook>> = parking_lot::Mutex::new(None);
/// One test at a time uses [`HOOK`].
static ONE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// A pool whose segments come from a counter of addresses; a request over 2^62 bytes waits
/// for [`HOOK`] and fails.
fn waiting_pool(a: &Allocator) -> u64 {
    let next = std::sync::atomic::AtomicU64::new(1 << 44);
    a.pool_create_with_allocator(
        move |size, _, _| {
            if size > 1 << 62 {
                let hook = HOOK.lock().take();
                if let Some((charged, go)) = hook {
                    charged.send(()).unwrap();
                    let _ = go.recv();
                }
                return None;
            }
            Some(next.fetch_add(size as u64 + (2 << 20), Ordering::Relaxed))
        },
        |_, _, _, _| {},
    )
}

/// A pool's budget: a growth of 2^63 bytes under way, charged to the budget as a negative
/// count (`PoolBudget::try_charge` casts), let another growth past the pool's limit while the
/// memory fraction's charge, made after the budget's, passed as well. Since the fraction
/// refuses such a size outright, the budget's negative charge is dropped before the driver is
/// asked; this test holds that, whatever the order of the two charges.
#[test]
fn a_huge_growth_in_flight_lets_no_growth_past_the_pools_budget() {
    let _one = ONE.lock();
    let (a, _drv) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let pool = waiting_pool(&a);
    a.pool_set_limit(0, pool, Some(10 * MIB as u64)).unwrap();
    let r = while_a_huge_growth_is_charged(&a, pool, true, 20 * MIB);
    assert!(matches!(&r, Err(Error::OutOfMemory(m)) if m.contains("gpupool_pool_set_limit")), "{r:?}");
    check(&a);
}

/// The device's memory fraction: the same, a default request past the fraction let through
/// while another stream's growth of 2^63 bytes is charged.
#[test]
fn a_huge_growth_in_flight_lets_no_growth_past_the_memory_fraction() {
    let _one = ONE.lock();
    let (a, _drv) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let pool = waiting_pool(&a);
    a.set_memory_fraction(1.0 / 16.0, 0).unwrap();
    let r = while_a_huge_growth_is_charged(&a, pool, false, 100 * MIB);
    assert!(matches!(&r, Err(Error::OutOfMemory(_))), "{r:?}");
    check(&a);
}

/// `gpupool_pool_set_limit` racing the release of the pool that forgets it (a released pool
/// that holds nothing): once the pool is forgotten, its limit is gone and no new one is taken.
#[test]
fn a_limit_set_while_its_pool_is_released_and_forgotten_does_not_outlive_it() {
    let (a, _drv) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let mut resurrected = 0;
    for _ in 0..300 {
        let pool = a.pool_create();
        a.begin_allocate_to_pool_thread(0, pool).unwrap();
        let p = a.malloc(MIB, 0, S).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        a.free(p).unwrap();
        let setter = {
            let a = a.clone();
            std::thread::spawn(move || while a.pool_set_limit(0, pool, Some(MIB as u64)).is_ok() {})
        };
        a.release_pool(0, pool).unwrap();
        setter.join().unwrap();
        assert!(a.all_pool_stats(0).unwrap().iter().all(|s| s.pool != pool), "forgotten");
        if a.pool_limit(0, pool).unwrap().is_some() {
            resurrected += 1;
        }
    }
    assert_eq!(resurrected, 0, "forgotten pools that kept a limit");
    check(&a);
}
