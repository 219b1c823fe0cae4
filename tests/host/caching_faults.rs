//! Pinned host memory on the simulated device under bad input and driver faults: bad pointers
//! refused, a failing event answered with a wait for the device, injected faults leaving the
//! allocator consistent, and a copy from unpinned memory flagged.

use gpupool::Error;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};

use crate::support::{COPY, host};

#[test]
fn bad_pointers_are_refused_and_change_nothing() {
    let (h, _sim) = host();
    let p = h.malloc(4096).unwrap();
    let before = h.stats();
    let refused = |r: Result<(), Error>, what: &str| match r {
        Err(Error::InvalidPointer(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("{other:?}"),
    };
    let mut local = [0u8; 16];
    refused(h.free(local.as_mut_ptr() as usize), "not pinned host memory from gpupool_host_malloc");
    refused(h.free(p + 16), "inside the pinned block");
    refused(h.record_event(p + 1, COPY), "inside the pinned block");
    refused(h.record_event(0x1000, COPY), "not pinned");
    assert_eq!(h.stats(), before);
    h.free(0).unwrap();
    h.record_event(0, COPY).unwrap();
    h.free(p).unwrap();
    refused(h.free(p), "freed already");
    refused(h.record_event(p, COPY), "not allocated");
    let after = h.stats();
    h.check_invariants();
    assert_eq!(h.malloc(4096).unwrap(), p, "the refused calls left the block free and cached");
    assert_eq!(after.active_requests.current, 0);
}
#[test]
fn a_free_whose_event_fails_waits_for_the_device_instead() {
    let (h, sim) = host();
    sim.hold_stream(COPY);
    let p = h.malloc(4096).unwrap();
    h.record_event(p, COPY).unwrap();
    sim.inject(SimOp::EventCreate, 0, SimFault::Fail(DriverError::OutOfMemory));
    let syncs = sim.counts().device_synchronize;
    h.free(p).unwrap();
    assert_eq!(sim.counts().device_synchronize, syncs + 1, "the device was synchronised instead");
    assert_eq!(h.malloc(4096).unwrap(), p);
    // Neither an event nor a synchronisation: the block waits for empty_cache.
    h.record_event(p, COPY).unwrap();
    sim.inject(SimOp::EventRecord, 0, SimFault::MissingSymbol);
    sim.inject(SimOp::DeviceSynchronize, 0, SimFault::Fail(DriverError::OutOfMemory));
    h.free(p).unwrap();
    let q = h.malloc(4096).unwrap();
    assert_ne!(q, p);
    h.check_invariants();
    h.free(q).unwrap();
    h.empty_cache().unwrap();
    assert_eq!(sim.live_host(), (0, 0), "empty_cache synchronised and released p");
    h.check_invariants();
}

#[test]
fn driver_faults_leave_the_allocator_consistent() {
    let (h, sim) = host();
    sim.inject(SimOp::HostAlloc, 0, SimFault::Fail(DriverError::OutOfMemory));
    match h.malloc(4096) {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("cannot pin 4096 bytes"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.stats().allocations.current, 0);
    let p = h.malloc(4096).unwrap();
    h.free(p).unwrap();
    sim.inject(
        SimOp::HostFree,
        0,
        SimFault::Fail(DriverError::Cuda { call: "cuMemFreeHost", code: 1, name: "X".into() }),
    );
    assert!(matches!(h.empty_cache(), Err(Error::Cuda(_))));
    assert!(h.owns(p), "a block whose release failed stays cached");
    h.check_invariants();
    assert_eq!(h.malloc(4096).unwrap(), p);
    h.free(p).unwrap();
    sim.hold_stream(COPY);
    let q = h.malloc(4096).unwrap();
    h.record_event(q, COPY).unwrap();
    h.free(q).unwrap();
    sim.inject(SimOp::EventQuery, 0, SimFault::Fail(DriverError::OutOfMemory));
    assert!(matches!(h.malloc(4096), Err(Error::Cuda(_))), "a failed poll is a CUDA error, not out of memory");
    h.check_invariants();
    sim.inject(SimOp::StreamDevice, 0, SimFault::MissingSymbol);
    let r = h.malloc(64).unwrap();
    assert!(matches!(h.record_event(r, COPY), Err(Error::DriverUnavailable(_))));
    h.free(r).unwrap();
    sim.release_stream(COPY);
    h.empty_cache().unwrap();
    assert_eq!(sim.live_host(), (0, 0));
    h.check_invariants();
}

#[test]
fn a_copy_from_unpinned_memory_is_flagged() {
    let (h, sim) = host();
    let mut dst = vec![0u8; 4096];
    let src = vec![7u8; 4096];
    // SAFETY: both buffers hold 4096 bytes.
    let pinned = unsafe { sim.memcpy_htod_async(dst.as_mut_ptr() as u64, src.as_ptr() as usize, 4096, COPY) };
    assert!(!pinned);
    assert_eq!(sim.counts().unpinned_copies, 1);
    let p = h.malloc(4096).unwrap();
    // SAFETY: p holds 4096 bytes.
    let pinned = unsafe { sim.memcpy_htod_async(dst.as_mut_ptr() as u64, p, 4096, COPY) };
    assert!(pinned);
    assert!(!sim.is_pinned(p, 4097), "past the block");
    assert_eq!(sim.counts().unpinned_copies, 1);
    h.free(p).unwrap();
}
