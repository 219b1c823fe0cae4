//! Tests of `Expandable` (`segment.rs`) on the simulated driver: pages mapped and unmapped,
//! failures undone, orphans released, and the access each map grants.

use super::*;
use crate::driver::ops::*;
use crate::driver::sim::{SIM_GRANULARITY, SimDriver, SimFault, SimOp};

const P: usize = SIM_GRANULARITY;

/// Releases the handles of `spare`, as the device's page pool does when the cache is
/// released.
fn release(sim: &SimDriver, spare: &mut Vec<PhysHandle>) {
    for h in spare.drain(..) {
        sim.mem_release(0, h).unwrap();
    }
}

#[test]
fn pages_map_and_unmap_and_memory_is_usable() {
    let sim = SimDriver::new(1, 64 << 20);
    let mut spare = Vec::new();
    let mut e = Expandable::reserve(&sim, 0, 16 * P, P).unwrap();
    e.map(&sim, 0, 2 * P, 3 * P, &mut spare, &[0]).unwrap();
    assert_eq!((e.mapped, sim.used(0), sim.accessible(0)), (3 * P, 3 * P, 3 * P));
    let c = sim.counts();
    assert_eq!((c.mem_create, c.mem_map, c.mem_set_access), (3, 3, 1), "one access grant per run");
    assert!(!e.is_mapped(P) && e.is_mapped(2 * P) && e.is_mapped(4 * P) && !e.is_mapped(5 * P));
    // SAFETY: the three pages are mapped readable and writable by the simulated driver.
    unsafe {
        let p = (e.base + 2 * P as u64) as *mut u8;
        p.write_bytes(7, 3 * P);
        assert_eq!(*p.add(3 * P - 1), 7);
    }
    // An unmapped page's handle is handed back, mapped nowhere, and still device memory.
    e.unmap(&sim, 0, 3 * P, P, &mut spare).unwrap();
    assert_eq!((e.mapped, sim.used(0), spare.len()), (2 * P, 3 * P, 1));
    assert_eq!(sim.handle_mapped_at(spare[0]), Some(None));
    // Mapping again elsewhere takes it: no new handle.
    e.map(&sim, 0, 10 * P, P, &mut spare, &[0]).unwrap();
    assert_eq!((sim.counts().mem_create, spare.len(), sim.used(0)), (3, 0, 3 * P));
    e.unmap(&sim, 0, 2 * P, P, &mut spare).unwrap();
    e.unmap(&sim, 0, 4 * P, P, &mut spare).unwrap();
    e.unmap(&sim, 0, 10 * P, P, &mut spare).unwrap();
    assert_eq!((e.mapped, sim.accessible(0), e.pages.len(), spare.len()), (0, 0, 0, 3));
    assert_eq!(sim.counts().mem_release, 0, "unmapping releases nothing");
    release(&sim, &mut spare);
    e.free(&sim, 0).unwrap();
    assert_eq!((sim.used(0), sim.live_vmm()), (0, (0, 0)));
}

#[test]
fn a_failed_map_undoes_its_pages_and_hands_their_handles_back() {
    let sim = SimDriver::new(1, 64 << 20);
    let mut e = Expandable::reserve(&sim, 0, 16 * P, P).unwrap();
    // One access grant covers the whole run, so it fails at its first call. Two handles
    // are handed in: the failed call hands back what it took and what it made.
    for (op, at, back) in [(SimOp::MemCreate, 0, 2), (SimOp::MemMap, 2, 3), (SimOp::MemSetAccess, 0, 4)] {
        let mut spare = vec![sim.mem_create(0, P).unwrap(), sim.mem_create(0, P).unwrap()];
        sim.inject(op, at, SimFault::Fail(DriverError::OutOfMemory));
        assert_eq!(e.map(&sim, 0, 0, 4 * P, &mut spare, &[0]), Err(DriverError::OutOfMemory), "{op:?}");
        assert_eq!((e.mapped, spare.len(), sim.accessible(0)), (0, back, 0), "{op:?}");
        assert!(spare.iter().all(|&h| sim.handle_mapped_at(h) == Some(None)), "{op:?}");
        release(&sim, &mut spare);
        assert_eq!((sim.used(0), sim.live_vmm()), (0, (1, 0)), "{op:?}");
    }
    // The device runs out halfway: nothing stays mapped.
    let small = SimDriver::new(1, 3 * P);
    let mut spare = Vec::new();
    let mut e2 = Expandable::reserve(&small, 0, 16 * P, P).unwrap();
    assert_eq!(e2.map(&small, 0, 0, 4 * P, &mut spare, &[0]), Err(DriverError::OutOfMemory));
    assert_eq!((e2.mapped, spare.len(), small.used(0)), (0, 3, 3 * P));
    e2.map(&small, 0, 0, 3 * P, &mut spare, &[0]).unwrap();
    assert_eq!((small.counts().mem_create, spare.len()), (4, 0), "the handles handed back were mapped");
    e2.unmap(&small, 0, 0, 3 * P, &mut spare).unwrap();
    release(&small, &mut spare);
    e2.free(&small, 0).unwrap();
    let _ = e.free(&sim, 0);
}

#[test]
fn a_page_without_access_is_never_counted_and_is_undone_later() {
    let sim = SimDriver::new(1, 64 << 20);
    let mut spare = Vec::new();
    let mut e = Expandable::reserve(&sim, 0, 16 * P, P).unwrap();
    // Access to the run fails, and unmapping its first page fails too: that page is mapped
    // in the driver, without access, and not in the table; the other three are handed back.
    sim.inject(SimOp::MemSetAccess, 0, SimFault::Fail(DriverError::OutOfMemory));
    sim.inject(SimOp::MemUnmap, 0, SimFault::Fail(DriverError::OutOfMemory));
    assert!(e.map(&sim, 0, 0, 4 * P, &mut spare, &[0]).is_err());
    assert!(!e.is_mapped(0) && !e.is_mapped(P));
    assert_eq!((e.mapped, spare.len(), sim.used(0)), (0, 3, 4 * P), "the orphan still holds its page");
    // Mapping there again undoes the orphan first (released: orphans are never counted).
    e.map(&sim, 0, 0, 4 * P, &mut spare, &[0]).unwrap();
    assert_eq!((e.mapped, sim.used(0), sim.accessible(0), spare.len()), (4 * P, 4 * P, 4 * P, 0));
    assert_eq!(sim.counts().mem_release, 1);
    e.unmap(&sim, 0, 0, 4 * P, &mut spare).unwrap();
    release(&sim, &mut spare);
    e.free(&sim, 0).unwrap();
    assert_eq!((sim.used(0), sim.live_vmm()), (0, (0, 0)));
}

#[test]
fn an_orphan_whose_release_fails_is_released_before_the_range_goes_back() {
    let sim = SimDriver::new(1, 64 << 20);
    let mut spare = Vec::new();
    let mut e = Expandable::reserve(&sim, 0, 16 * P, P).unwrap();
    sim.inject(SimOp::MemSetAccess, 0, SimFault::Fail(DriverError::OutOfMemory));
    sim.inject(SimOp::MemUnmap, 0, SimFault::Fail(DriverError::OutOfMemory));
    assert!(e.map(&sim, 0, 0, P, &mut spare, &[0]).is_err());
    sim.inject(SimOp::MemRelease, 0, SimFault::Fail(DriverError::OutOfMemory));
    assert!(e.free(&sim, 0).is_err(), "the orphan could not be released: the range stays");
    assert_eq!((sim.used(0), sim.live_vmm()), (P, (1, 1)));
    e.free(&sim, 0).unwrap();
    assert_eq!((sim.used(0), sim.live_vmm()), (0, (0, 0)));
}
