//! `largest_allocatable` under a limit of the default pools (`pool_set_limit` with pool 0): a
//! request of the answer succeeds and one byte more fails, as without a limit
//! (`tests/core/largest.rs`), with blocks awaiting events or a device synchronisation too.
//! Red team: the answer counted the driver's free memory and the memory fraction, not the
//! limit, so on a device with room past it the answer was refused; and the limit's path did
//! not wait for the pool's events (PyTorch #189504's case, `rules.rs`).

use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::{Allocator, Error};

/// Makes the allocator the question is asked of.
type Build<'a> = &'a dyn Fn() -> Allocator;

/// The answer on stream 0, checked on two allocators built alike: a request of it succeeds on
/// the first, one of a byte more fails on the second as out of memory. Returns the answer.
fn exact(build: Build) -> usize {
    let a = build();
    let answer = a.largest_allocatable(0, 0).unwrap();
    if answer > 0 {
        let p = a.malloc(answer, 0, 0);
        assert!(p.is_ok(), "a request of the answer, {answer} bytes, failed: {p:?}");
    }
    check(&a);
    let b = build();
    let answer_b = b.largest_allocatable(0, 0).unwrap();
    match b.malloc(answer_b + 1, 0, 0) {
        Err(Error::OutOfMemory(_)) => {}
        other => panic!("one byte more than the answer, {answer_b} + 1, gave {other:?}"),
    }
    check(&b);
    answer
}

fn configs() -> [(&'static str, Config); 2] {
    [("ordinary", Config::pytorch()), ("expandable", Config::default())]
}

fn limited(config: &Config, limit: usize) -> Allocator {
    let (a, _) = sim_with(1, 1 << 30, config.clone());
    a.pool_set_limit(0, 0, Some(limit as u64)).unwrap();
    a
}

#[test]
fn an_empty_device_answers_the_limit() {
    for (name, config) in configs() {
        let answer = exact(&|| limited(&config, 100 * MIB));
        assert_eq!(answer, 100 * MIB, "{name}");
    }
}

#[test]
fn live_blocks_take_their_share_of_the_limit() {
    for (name, config) in configs() {
        let answer = exact(&|| {
            let a = limited(&config, 100 * MIB);
            let _ = a.malloc(30 * MIB, 0, 0x20).unwrap();
            a
        });
        assert_eq!(answer, 70 * MIB, "{name}");
    }
}

#[test]
fn the_default_pools_cache_goes_back_before_the_limit_refuses() {
    // 60 MiB freed on another stream: cached, counted by the limit until released.
    for (name, config) in configs() {
        let answer = exact(&|| {
            let a = limited(&config, 100 * MIB);
            let p = a.malloc(60 * MIB, 0, 0x20).unwrap();
            a.free(p).unwrap();
            a
        });
        assert_eq!(answer, 100 * MIB, "{name}");
    }
}

#[test]
fn a_private_pools_cache_counts_for_the_device_not_for_the_limit() {
    // A device of 256 MiB, 200 of it cached by a private pool: release-and-retry gives it
    // back to the driver, but the default pools' limit, 100 MiB, still bounds the answer.
    for (name, config) in configs() {
        let answer = exact(&|| {
            let (a, _) = sim_with(1, 256 * MIB, config.clone());
            let pool = a.pool_create();
            a.begin_allocate_to_pool_thread(0, pool).unwrap();
            let p = a.malloc(200 * MIB, 0, 0x30).unwrap();
            a.end_allocate_to_pool(0, pool).unwrap();
            a.free(p).unwrap();
            a.pool_set_limit(0, 0, Some(100 * MIB as u64)).unwrap();
            a
        });
        assert!(answer <= 100 * MIB, "{name}: {answer}");
    }
}

/// An allocator of `capacity` bytes with the default pools limited to `limit`, after `ops`
/// ((size or 0 for a free, stream, pick), failures skipped) and, where `keep` is set, a
/// private pool's block allocated and freed first (cache the device counts, the limit not).
/// A free is plain, after use on a held stream (its block awaits an event) or with
/// `free_after_device_sync` (its block awaits a synchronisation), as `pick` says.
fn replay(config: &Config, capacity: usize, limit: usize, keep: bool, ops: &[(usize, usize, usize)]) -> Allocator {
    let (a, drv) = sim_with(1, capacity, config.clone());
    drv.hold_stream(0x52);
    if keep {
        let pool = a.pool_create();
        a.begin_allocate_to_pool_thread(0, pool).unwrap();
        let p = a.malloc(capacity / 4, 0, 0x70).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        a.free(p).unwrap();
    }
    a.pool_set_limit(0, 0, Some(limit as u64)).unwrap();
    let mut live = Vec::new();
    for &(size, stream, pick) in ops {
        if size > 0 {
            live.extend(a.malloc(size, 0, stream));
        } else if !live.is_empty() {
            let p = live.swap_remove(pick % live.len());
            match pick % 4 {
                0 => a.record_stream(p, 0x52).and_then(|()| a.free(p)).unwrap(),
                1 => {
                    a.free_after_device_sync(p).unwrap();
                }
                _ => a.free(p).unwrap(),
            }
        }
    }
    a
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 128, ..Default::default() })]

    #[test]
    fn the_answer_is_exact_under_a_limit_after_any_sequence(
        ops in proptest::collection::vec(
            (proptest::prop_oneof![2 => 1usize..2 * MIB, 3 => 2 * MIB..60 * MIB, 2 => proptest::strategy::Just(0usize)],
             0usize..3, 0usize..64),
            0..24),
        expandable in proptest::bool::ANY,
        capacity in proptest::sample::select(vec![128 * MIB, 256 * MIB]),
        limit in proptest::sample::select(vec![0usize, 20 * MIB, 64 * MIB + 512, 100 * MIB, 200 * MIB]),
        keep in proptest::bool::ANY,
    ) {
        let config = if expandable { Config::default() } else { Config::pytorch() };
        exact(&|| replay(&config, capacity, limit, keep, &ops));
    }
}
