//! What the statistics and the snapshot say of sleeping pools, on the simulated device: each
//! pool's sleeping bytes with their peak and totals, kept after it wakes and reset with the
//! device's peaks; the snapshot showing a sleeping pool's segments as they were, blocks in
//! their states, marked `is_sleeping` (in the pickle too, and only there).
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::history::BlockState;
use gpupool::{Allocator, SleepMode};
use serde_pickle::{DeOptions, HashableValue, Value};

const S: usize = 0x10;

fn config() -> Config {
    Config { expandable_segments: true, ..Config::default() }
}

/// A sleepable pool holding one block of `bytes` on stream `S`.
fn pool_with(a: &Allocator, bytes: usize) -> (u64, u64) {
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let p = a.malloc(bytes, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    (pool, p)
}

#[test]
fn each_pool_keeps_its_sleeping_peak_and_totals() {
    let (a, _) = sim_with(1, 1 << 30, config());
    let (x, px) = pool_with(&a, 6 * MIB);
    let (y, _) = pool_with(&a, 30 * MIB);
    let stat = |p| a.pool_stats(0, p).unwrap().stats.sleeping_bytes;
    let rx = a.pool_stats(0, x).unwrap().stats.reserved_bytes.all.current;
    assert_eq!((stat(x).current, stat(x).peak, stat(x).allocated), (0, 0, 0), "never slept");
    for round in 1..=2 {
        a.sleep(0, x, SleepMode::Offload).unwrap();
        assert_eq!((stat(x).current, stat(x).peak), (rx, rx));
        a.wake(0, x).unwrap();
        let s = stat(x);
        assert_eq!((s.current, s.peak, s.allocated, s.freed), (0, rx, round * rx, round * rx));
        assert_eq!(stat(y).allocated, 0, "another pool's statistic is its own");
    }
    a.sleep(0, y, SleepMode::Discard).unwrap();
    let ry = a.pool_stats(0, y).unwrap().stats.reserved_bytes.all.current;
    assert_eq!((stat(y).current, stat(x).current), (ry, 0));
    a.reset_peak_stats(0).unwrap();
    assert_eq!((stat(x).peak, stat(y).peak), (0, ry), "the peaks start again from now");
    a.wake(0, y).unwrap();
    a.free(px).unwrap();
    a.release_pool(0, x).unwrap();
    a.empty_cache(0).unwrap();
    check(&a);
}

fn get<'v>(v: &'v Value, key: &str) -> Option<&'v Value> {
    match v {
        Value::Dict(d) => d.get(&HashableValue::String(key.into())),
        _ => panic!("not a dict: {v:?}"),
    }
}

#[test]
fn the_snapshot_shows_a_sleeping_pools_segments_as_sleeping() {
    let (a, _) = sim_with(1, 1 << 30, config());
    let (pool, p) = pool_with(&a, 6 * MIB);
    let other = a.malloc(3 * MIB, 0, S).unwrap();
    a.sleep(0, pool, SleepMode::Offload).unwrap();
    let snap = a.snapshot().unwrap();
    let (asleep, awake): (Vec<_>, Vec<_>) = snap.segments.iter().partition(|g| g.pool == pool);
    assert!(!asleep.is_empty() && !awake.is_empty());
    assert!(asleep.iter().all(|g| g.is_sleeping) && awake.iter().all(|g| !g.is_sleeping));
    let block = asleep.iter().flat_map(|g| &g.blocks).find(|b| b.address == p).expect("the block is shown");
    assert_eq!(block.state, BlockState::ActiveAllocated, "its state as before the sleep");
    // The pickle marks the sleeping pool's segments only, PyTorch's keys unchanged.
    let v = serde_pickle::value_from_slice(&snap.to_pickle(), DeOptions::new().replace_recursive_structures()).unwrap();
    let Some(Value::List(segments)) = get(&v, "segments") else { panic!("no segments") };
    let mut marked = 0;
    for g in segments {
        let Some(Value::Tuple(id)) = get(g, "segment_pool_id") else { panic!("no pool id") };
        let sleeping = id[1] == Value::I64(pool as i64);
        assert_eq!(get(g, "is_sleeping"), sleeping.then_some(&Value::Bool(true)));
        marked += usize::from(sleeping);
        assert_eq!(get(g, "is_expandable"), Some(&Value::Bool(true)));
    }
    assert_eq!(marked, asleep.len());
    a.wake(0, pool).unwrap();
    assert!(a.snapshot().unwrap().segments.iter().all(|g| !g.is_sleeping));
    a.free(p).unwrap();
    a.free(other).unwrap();
    check(&a);
}
