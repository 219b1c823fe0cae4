//! The simulated `cuMemGetHandleForAddressRange` (`DmabufOps::mem_range_dmabuf`) follows CUDA's
//! rules: host-page alignment, one `cuMemAlloc` allocation or one reserved range wholly
//! mapped (by several handles side by side, allowed), of the device named; a real descriptor
//! of the range's size; every fault kind injected fires and changes nothing.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::common::MIB;
use crate::fd_size;
use gpupool::driver::DriverError;
use gpupool::driver::ops::*;
use gpupool::driver::sim::{SIM_GRANULARITY, SimDriver, SimFault, SimOp};

const G: usize = SIM_GRANULARITY;

fn invalid(r: Result<std::os::fd::OwnedFd, DriverError>) -> bool {
    matches!(r, Err(DriverError::Cuda { code: 1, call: "cuMemGetHandleForAddressRange", .. }))
}

#[test]
fn an_allocation_exports_any_page_aligned_part_of_itself_and_nothing_more() {
    let drv = SimDriver::new(2, 256 * MIB);
    let p = drv.mem_alloc(0, 4 * MIB).unwrap();
    assert_eq!(fd_size(&drv.mem_range_dmabuf(0, p, 4 * MIB).unwrap()), 4 * MIB as u64);
    assert_eq!(fd_size(&drv.mem_range_dmabuf(0, p + 4096, 8192).unwrap()), 8192, "a page-aligned part");
    assert!(invalid(drv.mem_range_dmabuf(0, p + 512, 4096)), "an unaligned start");
    assert!(invalid(drv.mem_range_dmabuf(0, p, 4 * MIB - 512)), "an unaligned size");
    assert!(invalid(drv.mem_range_dmabuf(0, p, 0)), "nothing");
    assert!(invalid(drv.mem_range_dmabuf(0, p, 4 * MIB + 4096)), "past the allocation");
    assert!(invalid(drv.mem_range_dmabuf(1, p, 4 * MIB)), "another device's memory");
    assert!(invalid(drv.mem_range_dmabuf(0, u64::MAX - 4095, 4096)), "no memory at all");
    drv.mem_free(0, p).unwrap();
    assert!(invalid(drv.mem_range_dmabuf(0, p, 4096)), "freed memory");
    assert_eq!(drv.counts().dmabufs, 9, "every call counted, failed ones too");
}

#[test]
fn a_reserved_range_exports_only_where_wholly_mapped_across_handles() {
    let drv = SimDriver::new(1, 256 * MIB);
    let base = drv.address_reserve(0, 4 * G).unwrap();
    let handles: Vec<_> = (0..3).map(|_| drv.mem_create(0, G).unwrap()).collect();
    // Pages 0 and 1 side by side, page 3 apart: a hole at page 2.
    for (i, &h) in [0u64, 1, 3].iter().zip(&handles) {
        drv.mem_map(0, base + i * G as u64, G, h).unwrap();
        drv.mem_set_access(0, base + i * G as u64, G, &[0], true).unwrap();
    }
    let fd = drv.mem_range_dmabuf(0, base, 2 * G).unwrap();
    assert_eq!(fd_size(&fd), 2 * G as u64, "two physical allocations side by side make one range");
    assert!(drv.mem_range_dmabuf(0, base + G as u64 / 2, G).is_ok(), "a part of two mappings");
    assert!(invalid(drv.mem_range_dmabuf(0, base, 3 * G)), "a range over the hole");
    assert!(invalid(drv.mem_range_dmabuf(0, base + 2 * G as u64, G)), "the hole itself");
    assert!(drv.mem_range_dmabuf(0, base + 3 * G as u64, G).is_ok(), "the page past the hole alone");
    assert!(invalid(drv.mem_range_dmabuf(0, base + 3 * G as u64, 2 * G)), "past the reservation");
    // The descriptor outlives the unmap (the caller owns it); a new one is refused.
    drv.mem_unmap(0, base, 2 * G).unwrap();
    assert!(invalid(drv.mem_range_dmabuf(0, base, G)));
    assert_eq!(fd_size(&fd), 2 * G as u64);
    drv.mem_unmap(0, base + 3 * G as u64, G).unwrap();
    for h in handles {
        drv.mem_release(0, h).unwrap();
    }
    drv.address_free(0, base, 4 * G).unwrap();
}

#[test]
fn every_fault_kind_fires_on_the_chosen_call_and_changes_nothing() {
    let drv = SimDriver::new(1, 64 * MIB);
    let p = drv.mem_alloc(0, 2 * MIB).unwrap();
    let cuda = DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_UNKNOWN".into() };
    drv.inject(SimOp::MemGetHandleForAddressRange, 1, SimFault::Fail(cuda.clone()));
    assert!(drv.mem_range_dmabuf(0, p, 2 * MIB).is_ok(), "the call before the chosen one");
    assert_eq!(drv.mem_range_dmabuf(0, p, 2 * MIB).unwrap_err(), cuda);
    drv.inject(SimOp::MemGetHandleForAddressRange, 0, SimFault::MissingSymbol);
    match drv.mem_range_dmabuf(0, p, 2 * MIB) {
        Err(DriverError::Unavailable(m)) => assert!(m.contains("cuMemGetHandleForAddressRange"), "{m}"),
        other => panic!("{other:?}"),
    }
    drv.inject_panic(SimOp::MemGetHandleForAddressRange, 0);
    let caught = catch_unwind(AssertUnwindSafe(|| drv.mem_range_dmabuf(0, p, 2 * MIB))).unwrap_err();
    let msg = caught.downcast_ref::<String>().unwrap();
    assert!(msg.contains("Missing symbol cuMemGetHandleForAddressRange"), "{msg}");
    assert_eq!(drv.pending_faults(), 0);
    assert_eq!(fd_size(&drv.mem_range_dmabuf(0, p, 2 * MIB).unwrap()), 2 * MIB as u64, "unharmed");
    drv.mem_free(0, p).unwrap();
    assert_eq!((drv.used(0), drv.live_allocations()), (0, 0));
}
