//! The high-water rule across page sizes (`expandable::cross`) on the simulated device:
//! free 2 MiB pages, of the growing stream or of another, are unmapped and their handles
//! released so that a growth in 20 MiB pages creates its pages within the mark; never the
//! reverse; and a fault in any of the calls on the way leaves a consistent allocator that
//! gives everything back.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};

fn config(reclaim: bool) -> Config {
    Config { expandable_segments: true, expandable_large_pages: true, expandable_reclaim: reclaim, ..Config::default() }
}

fn given_back(a: &gpupool::Allocator, drv: &SimDriver) {
    a.empty_cache(0).unwrap();
    check(a);
    assert_eq!((drv.used(0), drv.live_vmm(), drv.live_allocations()), (0, (0, 0), 0));
}

/// 10 MiB of free 2 MiB pages on `first`, then 20 MiB (one 20 MiB page) on `second`: with
/// the rule, the five small pages are unmapped and released before the large one is made;
/// without it, on the same stream, the growth maps five more 2 MiB pages after the free ones
/// (the page by rounding: 10 MiB mapped rather than 20).
#[test]
fn free_small_pages_make_room_for_a_large_page_growth() {
    for (reclaim, other) in [(true, false), (true, true), (false, false)] {
        let (a, drv) = sim_with(1, 1 << 30, config(reclaim));
        let (first, second) = (0x10, if other { 0x20 } else { 0x10 });
        let small = a.malloc(10 * MIB, 0, first).unwrap();
        a.free(small).unwrap();
        let c0 = drv.counts();
        let large = a.malloc(20 * MIB, 0, second).unwrap();
        let c1 = drv.counts();
        let s = a.stats(0).unwrap();
        let what = format!("reclaim {reclaim}, other stream {other}");
        let peak = 20 * MIB;
        assert_eq!(s.reserved_bytes.all.peak as usize, peak, "{what}");
        assert_eq!(drv.used(0), peak, "{what}: the device holds what is mapped, nothing more");
        let moved = if reclaim { 5 } else { 0 };
        assert_eq!((c1.mem_unmap - c0.mem_unmap, c1.mem_release - c0.mem_release), (moved, moved), "{what}");
        assert_eq!(c1.mem_create - c0.mem_create, if reclaim { 1 } else { 5 }, "{what}");
        // The other stream may be gone: the device is synchronised; the growing stream's own
        // work is waited for with an event.
        let waits = (c1.device_synchronize - c0.device_synchronize, c1.event_synchronize - c0.event_synchronize);
        assert_eq!(
            waits,
            if !reclaim {
                (0, 0)
            } else if other {
                (1, 0)
            } else {
                (0, 1)
            },
            "{what}"
        );
        assert_eq!(s.unmapped_held_bytes.current, 0, "{what}");
        check(&a);
        a.free(large).unwrap();
        given_back(&a, &drv);
    }
}

/// A free 20 MiB page is not released for a growth of 2 MiB pages (a small-pool request,
/// which no free block of the large pool serves): the growth passes the mark by its 2 MiB, and
/// the large page stays mapped for the next large request.
#[test]
fn a_free_large_page_is_kept_for_large_requests() {
    let (a, drv) = sim_with(1, 1 << 30, config(true));
    let large = a.malloc(20 * MIB, 0, 0x10).unwrap();
    a.free(large).unwrap();
    let c0 = drv.counts();
    let small = a.malloc(512 << 10, 0, 0x10).unwrap();
    let c1 = drv.counts();
    assert_eq!(
        (c1.mem_unmap - c0.mem_unmap, c1.mem_release - c0.mem_release, c1.mem_create - c0.mem_create),
        (0, 0, 1)
    );
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.peak as usize, 22 * MIB);
    let again = a.malloc(20 * MIB, 0, 0x10).unwrap();
    assert_eq!(again, large, "served by the page kept");
    assert_eq!(drv.counts().mem_create, c1.mem_create);
    check(&a);
    for p in [small, again] {
        a.free(p).unwrap();
    }
    given_back(&a, &drv);
}

/// A fault in each call of the way (the wait, an unmapping, a release, the growth's own
/// create and map), on the growing stream and on another: the request is served (a failed
/// create or map goes through the out-of-memory path's release and retry), the invariants
/// hold, the device never holds more than without the rule, and everything goes back.
#[test]
fn a_fault_on_the_way_leaves_a_consistent_allocator() {
    let faults = [
        SimOp::EventRecord,
        SimOp::EventSynchronize,
        SimOp::DeviceSynchronize,
        SimOp::MemUnmap,
        SimOp::MemRelease,
        SimOp::MemCreate,
        SimOp::MemMap,
    ];
    for op in faults {
        for (other, skip) in [(false, 0), (false, 2), (true, 0), (true, 3)] {
            let what = format!("{op:?} after {skip}, other stream {other}");
            let (a, drv) = sim_with(1, 1 << 30, config(true));
            let small = a.malloc(10 * MIB, 0, 0x10).unwrap();
            a.free(small).unwrap();
            drv.inject(op, skip, SimFault::Fail(DriverError::OutOfMemory));
            let large =
                a.malloc(20 * MIB, 0, if other { 0x20 } else { 0x10 }).unwrap_or_else(|e| panic!("{what}: {e}"));
            // A fault the way did not reach stays armed: not for the checks after.
            drv.clear_faults();
            check(&a);
            let s = a.stats(0).unwrap();
            assert!(s.reserved_bytes.all.peak as usize <= 30 * MIB, "{what}");
            assert!(drv.used(0) <= 30 * MIB, "{what}");
            // SAFETY: `large` is a live block of 20 MiB on the simulated device.
            unsafe { (large as *mut u8).write_bytes(7, 20 * MIB) };
            a.free(large).unwrap();
            given_back(&a, &drv);
        }
    }
}
