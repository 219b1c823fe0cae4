//! A driver call that panics or whose symbol is missing, one test each: what the memory
//! fraction counted is given back, and the missing function is named.

use crate::common;

use common::{MIB, check, sim};
use gpupool::Error;
use gpupool::driver::sim::{SimFault, SimOp};

use crate::faults::{CAPACITY, guarded, quiet_injected_panics};

/// cudarc panics on the first call of a function that `libcuda.so.1` lacks (an old driver
/// without `cuMemAlloc_v2`). With a memory fraction set, the bytes the allocator counted
/// against the limit before calling the driver must be given back, or every later malloc
/// fails as out of memory on an empty device.
#[test]
fn a_panicking_driver_call_gives_back_what_the_memory_fraction_counted() {
    quiet_injected_panics();
    let (a, drv) = sim(1, CAPACITY);
    a.set_memory_fraction(0.5, 0).unwrap();
    for _ in 0..4 {
        drv.inject_panic(SimOp::MemAlloc, 0);
        let r = guarded(|| a.malloc(MIB, 0, 0));
        assert!(!matches!(r, Some(Ok(_))), "a malloc whose cuMemAlloc panicked returned a block");
        check(&a);
    }
    assert_eq!(drv.pending_faults(), 0);
    let half = CAPACITY / 2;
    match a.malloc(half, 0, 0) {
        Ok(p) => a.free(p).unwrap(),
        Err(e) => panic!("{} MiB under a limit of {} MiB on an empty device: {e}", half / MIB, half / MIB),
    }
    a.empty_cache(0).unwrap();
    check(&a);
    assert_eq!(drv.used(0), 0);
}

/// A driver function missing from `libcuda.so.1`, reported by the driver layer as
/// unavailable, reaches the caller as `Error::DriverUnavailable` naming the function, and
/// changes nothing.
#[test]
fn a_missing_driver_symbol_is_reported_by_name() {
    let (a, drv) = sim(1, CAPACITY);
    a.set_memory_fraction(0.5, 0).unwrap();
    for kind in [SimOp::MemAlloc, SimOp::CurrentDevice] {
        drv.inject(kind, 0, SimFault::MissingSymbol);
        let device = if kind == SimOp::CurrentDevice { -1 } else { 0 };
        match a.malloc(MIB, device, 0) {
            Err(Error::DriverUnavailable(m)) => assert!(m.contains(kind.symbol()), "{m}"),
            other => panic!("{other:?}"),
        }
        check(&a);
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    }
    let p = a.malloc(CAPACITY / 2, 0, 0).unwrap();
    a.free(p).unwrap();
    drv.inject(SimOp::MemInfo, 0, SimFault::MissingSymbol);
    match a.set_memory_fraction(0.25, 0) {
        Err(Error::DriverUnavailable(m)) => assert!(m.contains("cuMemGetInfo_v2"), "{m}"),
        other => panic!("{other:?}"),
    }
    check(&a);
}
