//! The page of sleepable pools (`GPUPOOL_SLEEP_PAGE`) at its extremes on the simulated device:
//! values the parser accepts up to `usize::MAX` bytes, a page larger than the device, a budget
//! or memory fraction smaller than a page. Each request is refused as out of memory, never a
//! panic, a hang or a wrapped page, and the pools and statistics are left as they were.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::Error;
use gpupool::config::Config;

const S: usize = 0x10;

fn config(page: usize) -> Config {
    Config { expandable_segments: true, sleep_page: page, ..Config::default() }
}

/// A request of `n` bytes from a new sleepable pool on stream `S`.
fn malloc_sleepable(a: &gpupool::Allocator, n: usize) -> (u64, Result<u64, Error>) {
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let r = a.malloc(n, 0, S);
    a.end_allocate_to_pool(0, pool).unwrap();
    (pool, r)
}

/// Pages the parser accepts (`18446744073709551615B` is `usize::MAX`) whose rounding to the
/// driver's 2 MiB would pass `usize::MAX`, and pages larger than the 1 GiB device: each
/// request is out of memory, nothing is reserved, and a request of the default pools still
/// succeeds.
#[test]
fn a_page_past_the_device_or_the_address_space_is_out_of_memory() {
    for page in [usize::MAX, usize::MAX - MIB + 1, 1 << 63, 1 << 40, 2 << 30] {
        let (a, drv) = sim_with(1, 1 << 30, config(page));
        let (pool, r) = malloc_sleepable(&a, MIB);
        match r {
            // No budget was set: the message may not blame one.
            Err(Error::OutOfMemory(m)) => assert!(!m.contains("gpupool_pool_set_limit"), "page {page:#x}: {m}"),
            other => panic!("page {page:#x}: {other:?}"),
        }
        assert_eq!(drv.used(0), 0, "page {page:#x}: nothing is left mapped");
        assert_eq!(a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current, 0, "page {page:#x}");
        let q = a.malloc(MIB, 0, S).unwrap();
        a.free(q).unwrap();
        a.release_pool(0, pool).unwrap();
        check(&a);
    }
}

/// A page of 16 MiB under a pool budget smaller than it: the request of 1 MiB, which maps a
/// whole page, is out of memory; once the budget holds a page, it is served, and sleep and
/// wake give the page back and take it again.
#[test]
fn a_budget_below_one_page_refuses_the_first_request() {
    let (a, drv) = sim_with(1, 1 << 30, config(16 * MIB));
    let pool = a.pool_create_sleepable();
    a.pool_set_limit(0, pool, Some(8 * MIB as u64)).unwrap();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    assert!(matches!(a.malloc(MIB, 0, S), Err(Error::OutOfMemory(_))), "an 8 MiB budget holds no 16 MiB page");
    assert_eq!(drv.used(0), 0);
    a.pool_set_limit(0, pool, Some(16 * MIB as u64)).unwrap();
    let p = a.malloc(MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    assert_eq!(drv.used(0), 16 * MIB);
    a.sleep(0, pool, gpupool::SleepMode::Discard).unwrap();
    assert_eq!(drv.used(0), 0);
    a.wake(0, pool).unwrap();
    assert_eq!(drv.used(0), 16 * MIB);
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    check(&a);
}
/// A memory fraction of a 1 GiB device below one page (8 MiB of 16): the request is out of
/// memory, as PyTorch's is while its capture route is active (it skips `release_cached_blocks`
/// while `captures_underway` is not empty), not a refusal to release the cache, which the
/// request never asked for; the out-of-memory observers are told.
#[test]
fn a_fraction_below_one_page_is_out_of_memory_while_the_route_is_active() {
    let (a, drv) = sim_with(1, 1 << 30, config(16 * MIB));
    a.set_memory_fraction(8.0 / 1024.0, 0).unwrap();
    let ooms = a.stats(0).unwrap().num_ooms;
    let (pool, r) = malloc_sleepable(&a, MIB);
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    assert_eq!(a.stats(0).unwrap().num_ooms, ooms + 1);
    assert_eq!(drv.used(0), 0);
    a.release_pool(0, pool).unwrap();
    check(&a);
}

/// `largest_allocatable` of the default pools beside a sleepable pool of 64 MiB pages on a
/// 512 MiB device, awake (a page holding a live block, a wholly free page its cache gives
/// back at release-and-retry) and asleep (its pages given back): a request of the answer
/// succeeds, and one byte more, on a second allocator built the same, is out of memory.
#[test]
fn the_largest_request_beside_a_sleepable_pool_is_exact() {
    for asleep in [false, true] {
        let build = || {
            let (a, drv) = sim_with(1, 512 * MIB, config(64 * MIB));
            let pool = a.pool_create_sleepable();
            a.begin_allocate_to_pool(0, pool, S).unwrap();
            let _live = a.malloc(MIB, 0, S).unwrap();
            let gone = a.malloc(30 * MIB, 0, S).unwrap();
            a.end_allocate_to_pool(0, pool).unwrap();
            a.free(gone).unwrap();
            if asleep {
                a.sleep(0, pool, gpupool::SleepMode::Discard).unwrap();
            }
            (a, drv)
        };
        let (a, _) = build();
        let answer = a.largest_allocatable(0, 0x20).unwrap();
        assert!(answer > 300 * MIB, "asleep {asleep}: {answer}");
        let p = a.malloc(answer, 0, 0x20);
        assert!(p.is_ok(), "asleep {asleep}: a request of the answer, {answer} bytes: {p:?}");
        check(&a);
        let (b, _) = build();
        assert_eq!(b.largest_allocatable(0, 0x20).unwrap(), answer);
        let r = b.malloc(answer + 1, 0, 0x20);
        assert!(matches!(r, Err(Error::OutOfMemory(_))), "asleep {asleep}: {answer} + 1: {r:?}");
        check(&b);
    }
}

/// A wake under a memory fraction below one 16 MiB page fails all or nothing: the pool stays
/// asleep with nothing mapped, and wakes with its contents once the fraction holds its page.
#[test]
fn a_wake_under_a_fraction_below_one_page_fails_whole_then_succeeds() {
    let (a, drv) = sim_with(1, 1 << 30, config(16 * MIB));
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let p = a.malloc(MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    // SAFETY: a live block of 1 MiB mapped by the simulated driver.
    unsafe { (p as *mut u8).write_bytes(0xa5, MIB) };
    a.sleep(0, pool, gpupool::SleepMode::Offload).unwrap();
    a.set_memory_fraction(8.0 / 1024.0, 0).unwrap();
    let before = a.pool_stats(0, pool).unwrap();
    assert!(matches!(a.wake(0, pool), Err(Error::OutOfMemory(_))));
    assert_eq!(drv.used(0), 0);
    assert_eq!(a.pool_stats(0, pool).unwrap(), before, "the failed wake changed nothing");
    assert!(a.malloc(MIB, 0, S).is_ok_and(|q| a.free(q).is_ok()), "the default pools still serve");
    check(&a);
    a.set_memory_fraction(1.0, 0).unwrap();
    a.wake(0, pool).unwrap();
    // SAFETY: as above, mapped again by the wake.
    assert!(unsafe { std::slice::from_raw_parts(p as *const u8, MIB) }.iter().all(|&b| b == 0xa5));
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    check(&a);
}

/// A request of 1 MiB from a sleepable pool whose 2 GiB page the 1 GiB device cannot map: the
/// out-of-memory message names the page and its setting, the cause that "Tried to allocate
/// 2.00 MiB" with all the device free would hide.
#[test]
fn the_out_of_memory_message_names_a_page_larger_than_the_request() {
    let (a, _) = sim_with(1, 1 << 30, config(2 << 30));
    let (pool, r) = malloc_sleepable(&a, MIB);
    match r {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("GPUPOOL_SLEEP_PAGE") && m.contains("2.00 GiB"), "{m}"),
        other => panic!("{other:?}"),
    }
    a.release_pool(0, pool).unwrap();
}
