//! The page by rounding attacked at the device's edge (issue 39, `SMALL_PAGES_SAVING`): devices
//! of a few 20 MiB pages and some 2 MiB ones, requests a byte or a small page either side of
//! the 20 MiB edges, several streams; `largest_allocatable` exact after them (a request of the
//! answer succeeds, one byte or one 2 MiB page more fails), and a fault in any virtual memory
//! call of such growths leaving the invariants and the driver's count of device memory right.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};
use gpupool::{Allocator, Error};
use proptest::prelude::*;

/// A request near a 20 MiB edge: `n` large pages and `m` small ones, a byte either side.
fn near_edge() -> impl Strategy<Value = usize> {
    (0usize..6, 0usize..10, -1isize..=1).prop_map(|(n, m, e)| ((n * 20 + m * 2) * MIB).saturating_add_signed(e).max(1))
}

/// A device of `c` pages of 20 MiB and `d` of 2 MiB.
fn capacity() -> impl Strategy<Value = usize> {
    (2usize..10, 0usize..10).prop_map(|(c, d)| (c * 20 + d * 2) * MIB)
}

/// Allocates `sizes` in turn on their streams (failures skipped), freeing every third;
/// checks after each call that the device memory the driver counts is what the statistics
/// say gpupool holds (mapped pages and handles held unmapped).
fn replay(
    config: &Config,
    capacity: usize,
    sizes: &[(usize, usize)],
    drv_fault: Option<(SimOp, u32, bool)>,
) -> (Allocator, std::sync::Arc<SimDriver>, Vec<u64>) {
    let (a, drv) = sim_with(1, capacity, config.clone());
    if let Some((op, nth, oom)) = drv_fault {
        let err = if oom {
            DriverError::OutOfMemory
        } else {
            DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_INJECTED".into() }
        };
        drv.inject(op, nth, SimFault::Fail(err));
    }
    let mut live = Vec::new();
    for (i, &(size, stream)) in sizes.iter().enumerate() {
        live.extend(a.malloc(size, 0, stream));
        if i % 3 == 2 && !live.is_empty() {
            a.free(live.swap_remove(i % live.len())).unwrap();
        }
        counted(&a, &drv, drv_fault.is_some_and(|f| f.0 == SimOp::MemUnmap));
    }
    (a, drv, live)
}

/// The invariants hold and the driver's bytes are the reserved and held bytes; with
/// `orphans`, whole 2 MiB pages more: a page the driver would not unmap is kept as an orphan,
/// counted nowhere until the next release (`expandable/segment.rs`).
fn counted(a: &Allocator, drv: &SimDriver, orphans: bool) {
    check(a);
    let s = a.stats(0).unwrap();
    let held = (s.reserved_bytes.all.current + s.unmapped_held_bytes.current) as usize;
    let used = drv.used(0);
    if orphans {
        assert!(used >= held && (used - held) % (2 * MIB) == 0, "driver {used}, gpupool {held}: {s:?}");
    } else {
        assert_eq!(used, held, "the driver holds other bytes than gpupool counts: {s:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn largest_allocatable_is_exact_near_the_page_edges(
        sizes in proptest::collection::vec((near_edge(), 0usize..2), 0..7),
        capacity in capacity(),
        fraction in proptest::sample::select(vec![1.0, 0.8]),
        more in proptest::sample::select(vec![1usize, 2 * MIB]),
    ) {
        let config = Config { per_process_memory_fraction: fraction, ..Config::default() };
        let (a, _, _) = replay(&config, capacity, &sizes, None);
        let answer = a.largest_allocatable(0, 0).unwrap();
        if answer > 0 {
            let p = a.malloc(answer, 0, 0);
            prop_assert!(p.is_ok(), "a request of the answer, {} bytes, failed: {:?}", answer, p);
        }
        check(&a);
        let (b, _, _) = replay(&config, capacity, &sizes, None);
        let answer = b.largest_allocatable(0, 0).unwrap();
        match b.malloc(answer + more, 0, 0) {
            Err(Error::OutOfMemory(_)) => {}
            other => prop_assert!(false, "{} bytes more than the answer {} gave {:?}", more, answer, other),
        }
        check(&b);
    }

    #[test]
    fn a_fault_in_a_growth_near_the_edge_keeps_the_count(
        sizes in proptest::collection::vec((near_edge(), 0usize..2), 1..7),
        capacity in capacity(),
        op in proptest::sample::select(vec![SimOp::MemCreate, SimOp::MemMap, SimOp::MemSetAccess, SimOp::MemUnmap, SimOp::MemRelease, SimOp::AddressReserve]),
        nth in 0u32..40,
        oom in any::<bool>(),
    ) {
        let (a, drv, live) = replay(&Config::default(), capacity, &sizes, Some((op, nth, oom)));
        for p in live {
            a.free(p).unwrap();
        }
        let _ = a.empty_cache(0);
        counted(&a, &drv, op == SimOp::MemUnmap);
        drv.clear_faults();
        a.empty_cache(0).unwrap();
        counted(&a, &drv, false);
        prop_assert_eq!((drv.used(0), drv.live_vmm(), drv.live_allocations()), (0, (0, 0), 0));
    }

    #[test]
    fn largest_allocatable_is_exact_after_a_fault_near_the_edge(
        sizes in proptest::collection::vec((near_edge(), 0usize..2), 1..7),
        capacity in capacity(),
        op in proptest::sample::select(vec![SimOp::MemCreate, SimOp::MemMap, SimOp::MemUnmap, SimOp::MemRelease]),
        nth in 0u32..40,
        fraction in proptest::sample::select(vec![1.0, 0.8]),
    ) {
        let config = Config { per_process_memory_fraction: fraction, ..Config::default() };
        let fault = Some((op, nth, false));
        let (a, drv, _) = replay(&config, capacity, &sizes, fault);
        drv.clear_faults();
        let answer = a.largest_allocatable(0, 1).unwrap();
        if answer > 0 {
            let p = a.malloc(answer, 0, 1);
            prop_assert!(p.is_ok(), "a request of the answer, {} bytes, failed: {:?}", answer, p);
        }
        let (b, drv, _) = replay(&config, capacity, &sizes, fault);
        drv.clear_faults();
        let answer = b.largest_allocatable(0, 1).unwrap();
        match b.malloc(answer + 1, 0, 1) {
            Err(Error::OutOfMemory(_)) => {}
            other => prop_assert!(false, "one byte more than the answer {} gave {:?}", answer, other),
        }
    }
}

#[test]
fn a_page_left_to_the_driver_by_a_failed_unmap_counts_as_what_release_and_retry_frees() {
    // The case the fault proptest saved: a growth's map runs out of memory and its undoing
    // cannot unmap one page, which stays an orphan, counted nowhere, until a release frees it.
    let sizes = [(54 * MIB + 1, 1), (16 * MIB, 0), (6 * MIB, 1), (36 * MIB, 1), (28 * MIB + 1, 1)];
    let fault = Some((SimOp::MemUnmap, 29, false));
    let build = || {
        let (a, drv, live) = replay(&Config::default(), 66 * MIB, &sizes, fault);
        drv.clear_faults();
        let s = a.stats(0).unwrap();
        let counted = (s.reserved_bytes.all.current + s.unmapped_held_bytes.current) as usize;
        assert_eq!(drv.used(0) - counted, 2 * MIB, "one orphaned page");
        (a, drv, live)
    };
    let (a, _drv, _live) = build();
    let answer = a.largest_allocatable(0, 1).unwrap();
    let p = a.malloc(answer, 0, 1);
    assert!(p.is_ok(), "a request of the answer, {answer} bytes, failed: {p:?}");
    check(&a);
    let (b, _drv, _live) = build();
    assert_eq!(b.largest_allocatable(0, 1).unwrap(), answer);
    match b.malloc(answer + 1, 0, 1) {
        Err(Error::OutOfMemory(_)) => {}
        other => panic!("one byte more than the answer, {answer} + 1, gave {other:?}"),
    }
    check(&b);
}
