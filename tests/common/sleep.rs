//! Helpers of the sleep tests (`sleep/staging.rs`, `sleep/pinned.rs`,
//! `sleep/pinned_hostile.rs`, `sleep/faults.rs`): blocks filled with a pattern that differs at
//! every byte of a staging chunk, sleepable pools spread over two streams, and the checks
//! those tests make of them.

use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault};
use gpupool::{Allocator, Error};

/// The two streams `pool_with` spreads a pool's blocks over (two shards).
pub const S: usize = 0x10;
pub const S2: usize = 0x20;

fn pattern(i: usize, seed: u32) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8
}

/// Fills `n` bytes at `p` with `seed`'s pattern.
pub fn fill(p: u64, n: usize, seed: u32) {
    // SAFETY: a live block of at least `n` bytes, mapped by the simulated driver.
    let b = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, n) };
    for (i, x) in b.iter_mut().enumerate() {
        *x = pattern(i, seed);
    }
}

/// Whether `n` bytes at `p` hold `seed`'s pattern (the block's pool awake).
pub fn holds(p: u64, n: usize, seed: u32) -> bool {
    // SAFETY: as in `fill`; the pool is awake.
    let b = unsafe { std::slice::from_raw_parts(p as *const u8, n) };
    super::holds_pattern(b, |i| pattern(i, seed))
}

/// A sleepable pool with `sizes` allocated on streams `S` and `S2` in turn (two shards), the
/// `i`-th block filled with pattern `i`.
pub fn pool_with(a: &Allocator, sizes: &[usize]) -> (u64, Vec<(u64, usize)>) {
    let pool = a.pool_create_sleepable();
    let mut live = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let stream = if i % 2 == 0 { S } else { S2 };
        a.begin_allocate_to_pool(0, pool, stream).unwrap();
        let p = a.malloc(n, 0, stream).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        fill(p, n, i as u32);
        live.push((p, n));
    }
    (pool, live)
}

/// Whether every block of `pool_with` holds its pattern.
pub fn intact(live: &[(u64, usize)]) -> bool {
    live.iter().enumerate().all(|(i, &(p, n))| holds(p, n, i as u32))
}

/// (registered host ranges, pageable mappings): what pinned host copies hold.
pub fn host(drv: &SimDriver) -> (usize, usize) {
    (drv.live_host().1, drv.live_pageable().0)
}

/// Whether `pool` refuses an allocation (it sleeps).
pub fn asleep(a: &Allocator, pool: u64) -> bool {
    a.begin_allocate_to_pool(0, pool, 0x77).unwrap();
    let r = a.malloc(512, 0, 0x77);
    a.end_allocate_to_pool(0, pool).unwrap();
    match r {
        Err(Error::InvalidValue(_)) => true,
        Ok(p) => {
            a.free(p).unwrap();
            false
        }
        Err(e) => panic!("{e:?}"),
    }
}

/// A driver failure to inject (`CUDA_ERROR_UNKNOWN`).
pub fn fail() -> SimFault {
    SimFault::Fail(DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_UNKNOWN".into() })
}
