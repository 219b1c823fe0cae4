//! How PyTorch's caching rules meet bad input and driver failures on the simulated device: bad
//! pointers and values named, device -1 taken as the current device, and failures reported and
//! undone. One test each.

use crate::common;

use common::{MIB, check, sim};
use gpupool::Error;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimOp};

#[test]
fn bad_pointers_are_named_and_leave_every_pool_as_it_was() {
    let (a, drv) = sim(1, 64 * MIB);
    let p = a.malloc(4096, 0, 0).unwrap();
    let q = a.malloc(4096, 0, 0).unwrap();
    a.free(q).unwrap();
    let before = (a.stats(0).unwrap(), drv.counts());
    let cases =
        [(0xdead_0000u64, "was not allocated by gpupool"), (p + 16, "16 bytes inside the block"), (q, "double free")];
    for (ptr, says) in cases {
        match a.free(ptr) {
            Err(Error::InvalidPointer(m)) => assert!(m.contains(says), "{m}"),
            other => panic!("free({ptr:#x}) gave {other:?}"),
        }
        match a.record_stream(ptr, 3) {
            Err(Error::InvalidPointer(_)) => {}
            other => panic!("record_stream({ptr:#x}) gave {other:?}"),
        }
        assert_eq!((a.stats(0).unwrap(), drv.counts()), before);
    }
    check(&a);
}

#[test]
fn bad_values_are_named() {
    let (a, _) = sim(2, 64 * MIB);
    for device in [2, -2, i32::MAX] {
        match a.malloc(8, device, 0) {
            Err(Error::InvalidValue(m)) => assert!(m.contains(&format!("device {device} is out of range")), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    match a.malloc(usize::MAX - 10, 0, 0) {
        Err(Error::InvalidValue(m)) => assert!(m.contains("overflows"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.malloc(0, 0, 0).unwrap(), 0);
    assert_eq!(a.free(0), Ok(()));
    assert_eq!(a.stats(0).unwrap().segment.all.current, 0);
}

#[test]
fn device_minus_one_is_the_current_device() {
    let (a, _) = sim(2, 64 * MIB);
    SimDriver::set_current_device(1);
    let p = a.malloc(MIB, -1, 0).unwrap();
    assert_eq!(a.stats(1).unwrap().allocation.all.current, 1);
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
    assert_eq!(a.stats(-1).unwrap().allocation.all.current, 1);
    a.free(p).unwrap();
    SimDriver::set_current_device(0);
    a.empty_cache(-1).unwrap();
    assert_eq!(a.stats(1).unwrap().reserved_bytes.all.current, 0);
    check(&a);
}

#[test]
fn driver_failures_are_reported_and_undone() {
    let (a, drv) = sim(1, 64 * MIB);
    let cuda = |call| DriverError::Cuda { call, code: 999, name: "CUDA_ERROR_UNKNOWN".into() };
    drv.inject_fault(SimOp::MemAlloc, 0, cuda("cuMemAlloc"));
    match a.malloc(MIB, 0, 0) {
        Err(Error::Cuda(m)) => assert!(m.contains("cuMemAlloc failed with CUDA_ERROR_UNKNOWN"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.stats(0).unwrap().segment.all.current, 0);
    let p = a.malloc(MIB, 0, 0).unwrap();
    a.record_stream(p, 5).unwrap();
    drv.inject_fault(SimOp::EventRecord, 0, cuda("cuEventRecord"));
    // Without its event the block waits for a device synchronisation instead: the free
    // succeeds, and the block is not reused before the device has been synchronised.
    a.free(p).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocation.all.current, s.active.all.current), (0, 1), "freed, but held back");
    assert_eq!(a.deferred(0).unwrap().blocks, 1);
    let q = a.malloc(MIB, 0, 0).unwrap();
    assert_ne!(q, p, "not reused before the synchronisation");
    a.free(q).unwrap();
    assert_eq!(a.release_deferred(0).unwrap(), 1);
    assert_eq!(drv.counts().device_synchronize, 1);
    // An event that cannot be created for lack of memory is no out-of-memory for the free.
    let p = a.malloc(MIB, 0, 0).unwrap();
    a.record_stream(p, 5).unwrap();
    drv.inject_fault(SimOp::EventCreate, 0, DriverError::OutOfMemory);
    a.free(p).unwrap();
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    a.release_deferred(0).unwrap();
    // A query that fails is a CUDA error of malloc, not out of memory, and is not counted as one.
    let p = a.malloc(MIB, 0, 0).unwrap();
    a.record_stream(p, 5).unwrap();
    a.free(p).unwrap();
    drv.inject_fault(SimOp::EventQuery, 0, DriverError::OutOfMemory);
    assert!(matches!(a.malloc(MIB, 0, 0), Err(Error::Cuda(m)) if m.contains("CUDA_ERROR_OUT_OF_MEMORY")));
    assert_eq!(a.stats(0).unwrap().num_ooms, 0);
    a.malloc(MIB, 0, 0).map(|p| a.free(p)).unwrap().unwrap();
    // A failing cuMemFree keeps the segment cached.
    drv.inject_fault(SimOp::MemFree, 0, cuda("cuMemFree"));
    assert!(matches!(a.empty_cache(0), Err(Error::Cuda(_))));
    assert_eq!(a.stats(0).unwrap().segment.all.current, 1);
    a.empty_cache(0).unwrap();
    assert_eq!(a.stats(0).unwrap().segment.all.current, 0);
    check(&a);
}
