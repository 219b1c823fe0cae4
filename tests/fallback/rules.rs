//! The fallback's rules: served from a fallback pool's cache once the default pools are out
//! of memory, before anything is released; the pool's block, its statistics, its free; no
//! out-of-memory reported; the order of several fallback pools; requests routed to a pool do
//! not fall back; the default pools' limit and the memory fraction fall back, a fallback pool's
//! limit holds.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{MIB, check, sim};
use gpupool::{Allocator, Error, POOL_USE_ON_OOM};

pub const S: usize = 0x51;

pub fn allocated(a: &Allocator, pool: u64) -> i64 {
    a.pool_stats(0, pool).unwrap().stats.allocated_bytes.all.current
}

pub fn reserved(a: &Allocator, pool: u64) -> i64 {
    a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current
}

/// `sizes` allocated in `pool` on stream `S` through a thread route, then freed: the pool's
/// cache.
pub fn fill(a: &Allocator, pool: u64, sizes: &[usize]) {
    fill_on(a, pool, S, sizes, 0);
}

/// `sizes` allocated in `pool` on `stream` through a thread route; the first `keep` stay
/// allocated (returned), the rest are freed into the pool's cache.
pub fn fill_on(a: &Allocator, pool: u64, stream: usize, sizes: &[usize], keep: usize) -> Vec<u64> {
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let ptrs: Vec<u64> = sizes.iter().map(|&n| a.malloc(n, 0, stream).unwrap()).collect();
    a.end_allocate_to_pool(0, pool).unwrap();
    for &p in &ptrs[keep..] {
        a.free(p).unwrap();
    }
    ptrs[..keep].to_vec()
}

/// Counts the out-of-memory observer's calls.
pub fn observed(a: &Allocator) -> Arc<AtomicUsize> {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    a.attach_oom_observer(move |_| {
        c.fetch_add(1, Ordering::SeqCst);
        false
    });
    calls
}

/// The device full, a default-pool request takes a block of the fallback pool's cache: no
/// segment made or released, no out-of-memory counted or observed; the block is the pool's
/// (its statistics, the snapshot's segment, its free back to the pool's cache).
#[test]
fn a_default_request_takes_the_fallback_pools_cache_and_frees_back_to_it() {
    let (a, drv) = sim(1, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill(&a, fb, &[40 * MIB]);
    let calls = observed(&a);
    let (allocs, frees) = (drv.counts().mem_alloc, drv.counts().mem_free);
    let p = a.malloc(30 * MIB, 0, S).expect("served by the fallback pool");
    let c = drv.counts();
    assert_eq!(c.mem_free, frees, "nothing released: the fallback comes first (PyTorch PR #169699)");
    assert!(c.mem_alloc > allocs, "the default pools tried a new segment first");
    let d = a.stats(0).unwrap();
    assert_eq!((d.num_ooms, d.num_alloc_retries, calls.load(Ordering::SeqCst)), (0, 0, 0), "no out-of-memory");
    assert_eq!(allocated(&a, fb), 30 * MIB as i64, "the block counts in the fallback pool");
    assert_eq!(reserved(&a, fb), 40 * MIB as i64, "which did not grow");
    assert_eq!(d.allocated_bytes.all.current, 30 * MIB as i64, "and in the device");
    assert_eq!(d.reserved_bytes.all.current, 40 * MIB as i64);
    assert_eq!(a.pool_stats(0, fb).unwrap().stats.allocation.all.allocated, 2, "its fill and the fallback");
    let info = a.block_info(p).unwrap();
    assert_eq!((info.stream, info.size), (S, 30 * MIB));
    let snap = a.snapshot().unwrap();
    let seg = snap.segments.iter().find(|s| s.address <= p && p < s.address + s.total_size as u64).unwrap();
    assert_eq!(seg.pool, fb, "the snapshot names the fallback pool");
    check(&a);
    a.free(p).unwrap();
    assert_eq!((allocated(&a, fb), reserved(&a, fb)), (0, 40 * MIB as i64), "back in the pool's cache");
    assert_eq!(a.stats(0).unwrap().allocated_bytes.all.current, 0);
    // Served again, from the block the free merged back.
    let q = a.malloc(40 * MIB, 0, S).unwrap();
    assert_eq!(allocated(&a, fb), 40 * MIB as i64);
    a.free(q).unwrap();
    assert_eq!(a.pool_stats(0, fb).unwrap().stats.allocated_bytes.all.peak, 40 * MIB as i64);
    check(&a);
}

/// Only the fallback pool's cache on the request's stream serves (PyTorch's blocks are found by
/// stream): on another stream the request takes the usual path, release-and-retry, which gives
/// every pool's free cache back (the fallback pool's and a plain pool's) and makes room. A
/// plain pool is never a fallback.
#[test]
fn only_the_fallback_pools_cache_on_the_requests_stream_serves() {
    let (a, _drv) = sim(1, 64 * MIB);
    let plain = a.pool_create();
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill(&a, plain, &[20 * MIB]);
    fill(&a, fb, &[20 * MIB]);
    let live = a.malloc(20 * MIB, 0, S + 2).unwrap();
    let calls = observed(&a);
    let p = a.malloc(15 * MIB, 0, S + 1).unwrap();
    let d = a.stats(0).unwrap();
    assert_eq!((d.num_ooms, calls.load(Ordering::SeqCst)), (0, 0));
    assert!(d.num_alloc_retries >= 1, "served after release-and-retry");
    assert_eq!((allocated(&a, fb), reserved(&a, fb), reserved(&a, plain)), (0, 0, 0));
    assert_eq!(a.block_info(p).unwrap().stream, S + 1);
    for q in [p, live] {
        a.free(q).unwrap();
    }
    check(&a);
}

/// Several fallback pools: by increasing id, the first whose cache fits takes the request.
#[test]
fn fallback_pools_are_tried_in_creation_order() {
    let (a, _drv) = sim(1, 48 * MIB);
    let f1 = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    let f2 = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    assert!(f1 < f2);
    // f2 filled first: the order is by id, not by the caches' age.
    fill(&a, f2, &[20 * MIB]);
    fill(&a, f1, &[20 * MIB]);
    let ptrs: Vec<u64> = (0..3).map(|_| a.malloc(10 * MIB, 0, S).unwrap()).collect();
    assert_eq!(allocated(&a, f1), 20 * MIB as i64, "f1's 20 MiB split in two first");
    assert_eq!(allocated(&a, f2), 10 * MIB as i64, "then f2");
    // f1 too small now, f2 fits.
    let big = a.malloc(10 * MIB, 0, S).unwrap();
    assert_eq!(allocated(&a, f2), 20 * MIB as i64);
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    check(&a);
    for p in ptrs.into_iter().chain([big]) {
        a.free(p).unwrap();
    }
    assert_eq!(allocated(&a, f1) + allocated(&a, f2), 0);
    check(&a);
}

/// A request routed to a private pool never falls back (PyTorch: "if already trying to use a
/// mempool, then just oom"): it takes the usual path, whose release-and-retry gives the
/// fallback pool's cache back to make room.
#[test]
fn a_request_routed_to_a_pool_does_not_fall_back() {
    let (a, _drv) = sim(1, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    let routed = a.pool_create();
    fill(&a, fb, &[40 * MIB]);
    a.begin_allocate_to_pool_thread(0, routed).unwrap();
    let p = a.malloc(30 * MIB, 0, S).unwrap();
    a.end_allocate_to_pool(0, routed).unwrap();
    assert_eq!(allocated(&a, routed), 30 * MIB as i64, "the routed pool's own segment");
    assert_eq!((allocated(&a, fb), reserved(&a, fb)), (0, 0), "the fallback's cache was released for it");
    assert!(a.stats(0).unwrap().num_alloc_retries >= 1);
    a.free(p).unwrap();
    check(&a);
}

/// The default pools' limit refuses a growth: the request falls back (as PyTorch's memory
/// fraction's refusal does), and the default pools stay within their limit. A fallback pool's
/// own limit holds: a fallback never grows it. The memory fraction's refusal falls back too.
#[test]
fn limits_and_the_memory_fraction_fall_back_and_a_fallback_pools_limit_holds() {
    let (a, _drv) = sim(1, 1 << 30);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM).unwrap();
    fill(&a, fb, &[40 * MIB]);
    a.pool_set_limit(0, fb, Some(40 * MIB as u64)).unwrap();
    a.pool_set_limit(0, 0, Some(0)).unwrap();
    let p = a.malloc(30 * MIB, 0, S).expect("the default pools' limit refused, the fallback served");
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    assert_eq!(reserved(&a, fb), 40 * MIB as i64);
    // The fallback's cache left (10 MiB) is too small: the default pools' refusal stands.
    let r = a.malloc(20 * MIB, 0, S);
    assert!(matches!(&r, Err(Error::OutOfMemory(m)) if m.contains("the default pools (pool 0)")), "{r:?}");
    a.free(p).unwrap();
    a.pool_set_limit(0, 0, None).unwrap();
    // The memory fraction: the device may hold 48 MiB, the fallback pool holds 40.
    a.set_memory_fraction(48.0 / 1024.0, 0).unwrap();
    let q = a.malloc(30 * MIB, 0, S).expect("the fraction refused, the fallback served");
    assert_eq!((allocated(&a, fb), a.stats(0).unwrap().num_ooms), (30 * MIB as i64, 1));
    a.free(q).unwrap();
    check(&a);
}
