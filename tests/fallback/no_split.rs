//! Unsplit pools (`POOL_NO_SPLIT`, PyTorch `MemPool(no_split=True)`, PR #169739): a request
//! takes a whole cached block or a whole new segment, sized as PyTorch sizes segments; the
//! snapshot's segments of the pool hold one block each. A plain pool splits the same requests.

use crate::common;

use common::{MIB, check, sim};
use gpupool::{Allocator, POOL_NO_SPLIT, POOL_USE_ON_OOM};

use crate::rules::{S, allocated, fill};

/// The blocks of `pool`'s segments in the snapshot: (segment size, blocks in it) each.
fn segments(a: &Allocator, pool: u64) -> Vec<(usize, usize)> {
    let snap = a.snapshot().unwrap();
    let mut v: Vec<(usize, usize)> =
        snap.segments.iter().filter(|s| s.pool == pool).map(|s| (s.total_size, s.blocks.len())).collect();
    v.sort_unstable();
    v
}

/// The requests of one size each, routed to `pool`, their block sizes, freed after.
fn block_sizes(a: &Allocator, pool: u64, sizes: &[usize]) -> (Vec<usize>, Vec<u64>) {
    a.begin_allocate_to_pool_thread(0, pool).unwrap();
    let ptrs: Vec<u64> = sizes.iter().map(|&n| a.malloc(n, 0, S).unwrap()).collect();
    a.end_allocate_to_pool(0, pool).unwrap();
    (ptrs.iter().map(|&p| a.block_info(p).unwrap().size).collect(), ptrs)
}

#[test]
fn an_unsplit_pool_hands_out_whole_segments_sized_as_pytorch_sizes_them() {
    let (a, drv) = sim(1, 1 << 30);
    let ns = a.pool_create_ex(POOL_NO_SPLIT).unwrap();
    let plain = a.pool_create();
    let sizes = [512, 3000, 4 * MIB, 12 * MIB + 1];
    let (got, ptrs) = block_sizes(&a, ns, &sizes);
    // 2 MiB for up to 1 MiB, 20 MiB up to 10 MiB, else the request rounded up to 2 MiB.
    assert_eq!(got, [2 * MIB, 2 * MIB, 20 * MIB, 14 * MIB]);
    assert_eq!(allocated(&a, ns), 38 * MIB as i64, "the whole blocks count as allocated");
    assert_eq!(segments(&a, ns), [(2 * MIB, 1), (2 * MIB, 1), (14 * MIB, 1), (20 * MIB, 1)]);
    let s = a.pool_stats(0, ns).unwrap().stats;
    assert_eq!(s.inactive_split.all.current, 0);
    // The same requests in a plain pool split: one small segment, the 20 MiB one split.
    let (plain_got, plain_ptrs) = block_sizes(&a, plain, &sizes);
    assert_eq!(plain_got, [512, 3072, 4 * MIB, 12 * MIB + 512]);
    assert!(segments(&a, plain).iter().any(|&(_, blocks)| blocks > 1), "{:?}", segments(&a, plain));
    check(&a);
    for p in ptrs.into_iter().chain(plain_ptrs) {
        a.free(p).unwrap();
    }
    // A cached whole block serves a smaller request whole: no new segment.
    let allocs = drv.counts().mem_alloc;
    // The best fit: the small pool's 2 MiB blocks, then 20 MiB for 15 MiB and 14 MiB for 5.
    let (again, ptrs) = block_sizes(&a, ns, &[100, 600_000, 15 * MIB, 5 * MIB]);
    assert_eq!(again, [2 * MIB, 2 * MIB, 20 * MIB, 14 * MIB]);
    assert_eq!(drv.counts().mem_alloc, allocs, "served from the cache");
    assert!(segments(&a, ns).iter().all(|&(_, blocks)| blocks == 1), "{:?}", segments(&a, ns));
    for p in ptrs {
        a.free(p).unwrap();
    }
    assert_eq!(allocated(&a, ns), 0);
    check(&a);
}

/// A fallback pool that never splits hands its whole cached block to a default request.
#[test]
fn an_unsplit_fallback_pool_hands_out_its_whole_block() {
    let (a, _drv) = sim(1, 64 * MIB);
    let fb = a.pool_create_ex(POOL_USE_ON_OOM | POOL_NO_SPLIT).unwrap();
    fill(&a, fb, &[40 * MIB]);
    let p = a.malloc(30 * MIB, 0, S).unwrap();
    assert_eq!(a.block_info(p).unwrap().size, 40 * MIB);
    assert_eq!(allocated(&a, fb), 40 * MIB as i64);
    assert_eq!(segments(&a, fb), [(40 * MIB, 1)]);
    a.free(p).unwrap();
    check(&a);
}
