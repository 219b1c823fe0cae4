//! Two tenants of one device: one over its budget in a loop, the other allocating and freeing
//! at full speed, never refused; the statistics exact afterwards. And the limit changed while
//! both allocate.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use common::{MIB, check, sim_with, xorshift};
use gpupool::config::Config;
use gpupool::{Allocator, Error};

const ROUNDS: usize = 400;

/// What a tenant did: allocations served, allocations refused.
#[derive(Debug, Default)]
struct Tally {
    served: i64,
    refused: i64,
}

/// The greedy tenant: `pool` (0: the default pools, unrouted), allocations of 1 to 24 MiB kept
/// until refused, then the oldest half freed. After each call its pool reserves at most
/// `max_limit`. `stream` its stream.
fn greedy(a: &Allocator, pool: u64, stream: usize, max_limit: i64, seed: u64) -> Tally {
    if pool != 0 {
        a.begin_allocate_to_pool_thread(0, pool).unwrap();
    }
    let (mut t, mut live, mut rng) = (Tally::default(), Vec::new(), seed);
    for _ in 0..ROUNDS {
        let size = (1 + xorshift(&mut rng) as usize % 24) * MIB;
        match a.malloc(size, 0, stream) {
            Ok(p) => {
                t.served += 1;
                live.push(p);
            }
            Err(Error::OutOfMemory(m)) => {
                assert!(m.contains("gpupool_pool_set_limit"), "refused by the device, not the budget: {m}");
                t.refused += 1;
                let half = live.len().div_ceil(2);
                for p in live.drain(..half) {
                    a.free(p).unwrap();
                }
            }
            Err(e) => panic!("{e}"),
        }
        let reserved = if pool == 0 {
            a.stats(0).unwrap().reserved_bytes.all.current
                - a.all_pool_stats(0).unwrap().iter().map(|p| p.stats.reserved_bytes.all.current).sum::<i64>()
        } else {
            a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current
        };
        assert!(reserved <= max_limit, "the greedy pool reserves {reserved}, over {max_limit}");
    }
    for p in live {
        a.free(p).unwrap();
    }
    if pool != 0 {
        a.end_allocate_to_pool(0, pool).unwrap();
    }
    t
}

/// The quiet tenant: `pool`'s allocations of 512 B to 4 MiB, up to 32 live, freed at random,
/// until `stop`; every one must be served.
fn quiet(a: &Allocator, pool: u64, stream: usize, stop: &AtomicBool, seed: u64) -> Tally {
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let (mut t, mut live, mut rng) = (Tally::default(), Vec::new(), seed);
    while !stop.load(Ordering::Relaxed) || t.served < ROUNDS as i64 {
        let size = 512 + xorshift(&mut rng) as usize % (4 * MIB);
        live.push(a.malloc(size, 0, stream).expect("the quiet tenant is never refused"));
        t.served += 1;
        if live.len() > 32 || xorshift(&mut rng) % 2 == 0 {
            let i = xorshift(&mut rng) as usize % live.len();
            a.free(live.swap_remove(i)).unwrap();
        }
    }
    for p in live {
        a.free(p).unwrap();
    }
    a.end_allocate_to_pool(0, pool).unwrap();
    t
}

/// Runs the two tenants on `config`: the greedy one in `greedy_pool` (0: the default pools)
/// limited to 64 MiB, or between 16 and 64 MiB changed by a third thread with `churn`.
fn two_tenants(config: Config, greedy_pool: bool, churn: bool) {
    let (a, _drv) = sim_with(1, 1 << 30, config);
    let g = if greedy_pool { a.pool_create() } else { 0 };
    let q = a.pool_create();
    a.pool_set_limit(0, g, Some(64 * MIB as u64)).unwrap();
    let stop = AtomicBool::new(false);
    let limits_set = AtomicI64::new(0);
    let (gt, qt) = std::thread::scope(|s| {
        let quiet = s.spawn(|| quiet(&a, q, 0x20, &stop, 0x9e37_79b9));
        if churn {
            s.spawn(|| {
                let mut rng = 7u64;
                while !stop.load(Ordering::Relaxed) {
                    let mib = 16 + xorshift(&mut rng) % 49;
                    a.pool_set_limit(0, g, Some(mib * MIB as u64)).unwrap();
                    limits_set.fetch_add(1, Ordering::Relaxed);
                    std::thread::yield_now();
                }
            });
        }
        let gt = greedy(&a, g, 0x10, 64 * MIB as i64, 0x1234_5678);
        stop.store(true, Ordering::Relaxed);
        (gt, quiet.join().unwrap())
    });
    assert!(gt.refused > 0, "the greedy tenant never reached its budget: {gt:?}");
    // Exact statistics: every call counted once, in its own pool.
    let (gs, qs) = if greedy_pool {
        (a.pool_stats(0, g).unwrap().stats, a.pool_stats(0, q).unwrap().stats)
    } else {
        (a.stats(0).unwrap(), a.pool_stats(0, q).unwrap().stats)
    };
    assert_eq!(qs.allocation.all.allocated, qt.served);
    assert_eq!(qs.allocation.all.current, 0);
    if greedy_pool {
        assert_eq!(gs.allocation.all.allocated, gt.served);
    } else {
        assert_eq!(gs.allocation.all.allocated, gt.served + qt.served, "the device's counts both");
    }
    assert_eq!(a.stats(0).unwrap().num_ooms, gt.refused, "only the greedy tenant's refusals");
    if !churn {
        assert_eq!(gs.pool_limit, Some(64 * MIB as i64));
    }
    check(&a);
}

#[test]
fn a_tenant_over_budget_leaves_the_other_unrefused() {
    two_tenants(Config::pytorch(), true, false);
}

#[test]
fn the_default_pools_over_budget_with_expandable_segments_leave_a_private_pool_unrefused() {
    two_tenants(Config::default(), false, false);
}

#[test]
fn a_limit_changed_while_both_tenants_allocate_keeps_every_count_exact() {
    two_tenants(Config::pytorch(), true, true);
    two_tenants(Config::default(), false, true);
}
