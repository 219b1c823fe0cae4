//! `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST` on the simulated device: a very large request maps
//! a few large pages rather than hundreds of 20 MiB ones, in ranges of their own; a fault in
//! any of its driver calls leaves nothing behind; and what it maps past its size serves other
//! requests.
use crate::common;

use common::ladder::{ladder, touch_ends};
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};

fn all_given_back(a: &gpupool::Allocator, drv: &SimDriver) {
    a.empty_cache(0).unwrap();
    check(a);
    assert_eq!((drv.used(0), drv.live_vmm(), drv.live_allocations()), (0, (0, 0), 0));
}

#[test]
fn a_very_large_request_maps_few_large_pages() {
    // (pages a request may map, 1 GiB request's pages, their size)
    for (per_request, pages, page) in [(16, 13, 80 * MIB), (0, 52, 20 * MIB), (4, 4, 320 * MIB), (1, 1, 1280 * MIB)] {
        let (a, drv) = sim_with(1, 8 << 30, ladder(per_request));
        let c0 = drv.counts();
        let big = a.malloc(1 << 30, 0, 0x10).unwrap();
        touch_ends(big, 1 << 30, 7);
        let c1 = drv.counts();
        assert_eq!((c1.mem_create - c0.mem_create, c1.mem_map - c0.mem_map), (pages, pages), "{per_request}");
        let s = a.stats(0).unwrap();
        assert_eq!(s.reserved_bytes.all.current, (pages as usize * page) as i64, "{per_request}");
        // A 20 MiB request takes the pages mapped past the large block if there are any (no
        // driver call), or grows a range of 20 MiB pages, not the large one.
        let small = a.malloc(20 * MIB, 0, 0x10).unwrap();
        let tail = pages as usize * page - (1 << 30);
        if tail >= 20 * MIB {
            assert_eq!(small, big + (1 << 30), "{per_request}: the tail");
            assert_eq!(drv.counts().mem_create, c1.mem_create, "{per_request}");
        } else {
            assert!(small.abs_diff(big) >= 1 << 30, "{per_request}: another range");
            assert_eq!(drv.counts().mem_create - c1.mem_create, 1, "{per_request}");
        }
        // Freed, the large block's pages serve a request of another size at once.
        a.free(big).unwrap();
        let c2 = drv.counts();
        let other = a.malloc(700 * MIB, 0, 0x10).unwrap();
        assert_eq!(other, big, "{per_request}: the cached pages, no growth");
        assert_eq!(drv.counts().mem_map, c2.mem_map);
        check(&a);
        for p in [other, small] {
            a.free(p).unwrap();
        }
        all_given_back(&a, &drv);
    }
}

#[test]
fn a_fault_in_any_call_of_a_large_growth_leaves_nothing_behind() {
    let fail = |call| SimFault::Fail(DriverError::Cuda { call, code: 999, name: "CUDA_ERROR_INJECTED".into() });
    for op in [SimOp::MemCreate, SimOp::MemMap, SimOp::MemSetAccess] {
        for nth in [0, 5, 12] {
            let (a, drv) = sim_with(1, 8 << 30, ladder(16));
            let before = drv.counts();
            drv.inject(op, nth, fail("a virtual memory call"));
            // The growth fails (it falls back to an ordinary segment, which may succeed), or
            // succeeds past the fault: either way the checker holds and no page is lost.
            let p = a.malloc(1 << 30, 0, 0x10);
            check(&a);
            let s = a.stats(0).unwrap();
            let after = drv.counts();
            assert!(after.mem_create - before.mem_create <= 13 + 1, "{op:?} {nth}");
            if let Ok(p) = p {
                touch_ends(p, 1 << 30, 3);
                assert!(s.reserved_bytes.all.current >= 1 << 30);
                a.free(p).unwrap();
            } else {
                assert_eq!(s.allocated_bytes.all.current, 0);
            }
            all_given_back(&a, &drv);
        }
    }
}

#[test]
fn out_of_memory_on_a_large_page_is_refused_cleanly_and_smaller_pages_still_serve() {
    // 1.5 GiB of device: a 1 GiB request maps 13 pages of 80 MiB (1,040 MiB); a second one
    // cannot, and says so, leaving the first as it was.
    let (a, drv) = sim_with(1, 1536 * MIB, ladder(16));
    let first = a.malloc(1 << 30, 0, 0x10).unwrap();
    let reserved = a.stats(0).unwrap().reserved_bytes.all.current;
    assert!(matches!(a.malloc(1 << 30, 0, 0x10), Err(gpupool::Error::OutOfMemory(_))));
    check(&a);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, reserved);
    // 400 MiB: 10 pages of 40 MiB fit in what is left.
    let second = a.malloc(400 * MIB, 0, 0x10).unwrap();
    touch_ends(second, 400 * MIB, 5);
    for p in [first, second] {
        a.free(p).unwrap();
    }
    all_given_back(&a, &drv);
}

#[test]
fn the_high_water_rule_keeps_20_mib_pages() {
    // The rule's point is the least reserved memory, which larger pages would raise.
    let config = Config { expandable_reclaim: true, ..ladder(16) };
    let (a, drv) = sim_with(1, 8 << 30, config);
    let c0 = drv.counts();
    let big = a.malloc(1 << 30, 0, 0x10).unwrap();
    assert_eq!(drv.counts().mem_create - c0.mem_create, 52, "pages of 20 MiB");
    check(&a);
    a.free(big).unwrap();
    all_given_back(&a, &drv);
}
