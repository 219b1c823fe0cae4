//! The page of sleepable pools (`GPUPOOL_SLEEP_PAGE`, `Config::sleep_page`) on the simulated
//! device: every request of such a pool, small or large, is mapped in pages of that size
//! (rounded up to the driver's 2 MiB), so that a sleep unmaps and a wake maps fewer of them;
//! contents and reserved bytes come back; the default pools keep their own layout.
use crate::common;

use common::{MIB, check, holds_pattern, sim_with};
use gpupool::config::Config;
use gpupool::{Allocator, SleepMode};

const S: usize = 0x10;

fn byte(seed: u8) -> impl Fn(usize) -> u8 {
    move |i| (i as u8).wrapping_mul(31).wrapping_add(seed)
}

/// Fills `len` bytes at `ptr` with the pattern of `seed`.
fn fill(ptr: u64, len: usize, seed: u8) {
    // SAFETY: `ptr` is a live block of at least `len` bytes, mapped by the simulated driver.
    let b = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    b.iter_mut().enumerate().for_each(|(i, x)| *x = byte(seed)(i));
}

/// Whether `len` bytes at `ptr` hold the pattern of `seed`.
fn holds(ptr: u64, len: usize, seed: u8) -> bool {
    // SAFETY: as in `fill`.
    holds_pattern(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }, byte(seed))
}

fn config(page: usize) -> Config {
    Config { expandable_segments: true, sleep_page: page, ..Config::default() }
}

fn sleepable_with(a: &Allocator, sizes: &[usize]) -> (u64, Vec<u64>) {
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let blocks = sizes.iter().map(|&n| a.malloc(n, 0, S).unwrap()).collect();
    a.end_allocate_to_pool(0, pool).unwrap();
    (pool, blocks)
}

#[test]
fn every_request_of_a_sleepable_pool_maps_pages_of_the_configured_size() {
    for (page, want) in [(20 * MIB, 20 * MIB), (64 * MIB, 64 * MIB), (65 * MIB, 66 * MIB), (2 * MIB, 2 * MIB)] {
        let (a, drv) = sim_with(1, 4 << 30, config(page));
        // A small-pool request and a large one: each pool's range maps whole pages of `want`.
        let sizes = [512 * 1024, 100 * MIB];
        let (pool, blocks) = sleepable_with(&a, &sizes);
        let reserved = a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current as usize;
        let expect = MIB.div_ceil(want) * want + (100 * MIB).div_ceil(want) * want;
        assert_eq!(reserved, expect, "page {page}: reserved {reserved}");
        for (i, (&p, &n)) in blocks.iter().zip(&sizes).enumerate() {
            fill(p, n, i as u8);
        }
        let maps = drv.counts().mem_map;
        a.sleep(0, pool, SleepMode::Offload).unwrap();
        assert_eq!(drv.used(0), 0, "page {page}: every page went back");
        a.wake(0, pool).unwrap();
        assert_eq!(drv.counts().mem_map - maps, (expect / want) as u64, "page {page}: one map a page");
        for (i, (&p, &n)) in blocks.iter().zip(&sizes).enumerate() {
            assert!(holds(p, n, i as u8), "page {page}: block {i} restored");
        }
        // The default pools keep 2 MiB pages for small requests.
        let q = a.malloc(512 * 1024, 0, S).unwrap();
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current as usize, expect + 2 * MIB);
        a.free(q).unwrap();
        for p in blocks {
            a.free(p).unwrap();
        }
        a.release_pool(0, pool).unwrap();
        a.empty_cache(0).unwrap();
        check(&a);
    }
}
