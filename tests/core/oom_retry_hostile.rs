//! `oom_retry.rs`'s case (PyTorch #189504: a block freed behind another stream's event serves
//! the request that fills the device, once the out-of-memory path waited) attacked: the block
//! used on several streams, and the events' calls failing at each step (create and record at
//! the free, query at the next malloc, the wait on the out-of-memory path), with ordinary and
//! expandable segments. A failure is an error, never a block handed out twice; the
//! invariants, the statistics and the driver's memory stay right, and once the fault is gone
//! the same request is served from the pool.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};
use gpupool::{Allocator, Error};

const CAPACITY: usize = 64 * MIB;

/// `x` (8 MiB) and `y` (6 MiB) on stream 1, `x` used on `users` (held) and freed, the rest of
/// the device taken on stream 3. Returns the allocator, its driver, and `x`, `y`, the rest.
fn full_behind_events(config: &Config, users: &[usize]) -> (Allocator, std::sync::Arc<SimDriver>, [u64; 3]) {
    let (a, drv) = sim_with(1, CAPACITY, config.clone());
    let x = a.malloc(8 * MIB, 0, 1).unwrap();
    let y = a.malloc(6 * MIB, 0, 1).unwrap();
    for &s in users {
        a.record_stream(x, s).unwrap();
        drv.hold_stream(s);
    }
    a.free(x).unwrap();
    let z = a.malloc(CAPACITY - drv.used(0), 0, 3).unwrap();
    assert_eq!(drv.used(0), CAPACITY);
    (a, drv, [x, y, z])
}

fn configs() -> [(Config, &'static str); 2] {
    [(Config::pytorch(), "ordinary"), (Config::default(), "expandable")]
}

fn cuda() -> SimFault {
    SimFault::Fail(DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_INJECTED".into() })
}

/// Frees `live` and the request's block, releases `users`, empties the cache: nothing left.
fn all_given_back(a: &Allocator, drv: &SimDriver, live: &[u64], users: &[usize]) {
    for &p in live {
        a.free(p).unwrap();
    }
    for &s in users {
        drv.release_stream(s);
    }
    a.empty_cache(0).unwrap();
    check(a);
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocated_bytes.all.current, s.reserved_bytes.all.current), (0, 0));
    assert_eq!(drv.used(0), 0);
}

#[test]
fn a_block_used_on_several_held_streams_is_served_after_waiting_for_each() {
    let users = [2, 4, 5];
    for (config, name) in configs() {
        let (a, drv, [x, y, z]) = full_behind_events(&config, &users);
        let again = a.malloc(8 * MIB, 0, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        if name == "ordinary" {
            assert_eq!(again, x, "{name}: served by the block the events held back");
        }
        let s = a.stats(0).unwrap();
        assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0), "{name}");
        assert_eq!(drv.counts().event_synchronize, users.len() as u64, "{name}: one wait a stream");
        assert_eq!(drv.used(0), CAPACITY, "{name}: nothing more from the driver");
        check(&a);
        all_given_back(&a, &drv, &[again, y, z], &users);
    }
}

#[test]
fn a_failed_wait_on_the_out_of_memory_path_is_an_error_and_the_next_call_is_served() {
    for (config, name) in configs() {
        for nth in 0..3 {
            for fault in [cuda(), SimFault::Fail(DriverError::OutOfMemory)] {
                let users = [2, 4, 5];
                let (a, drv, [x, y, z]) = full_behind_events(&config, &users);
                drv.inject(SimOp::EventSynchronize, nth, fault.clone());
                let before = a.stats(0).unwrap();
                match a.malloc(8 * MIB, 0, 1) {
                    Err(Error::Cuda(_)) => {}
                    other => panic!("{name}, wait {nth} failing with {fault:?}: {other:?}"),
                }
                check(&a);
                let s = a.stats(0).unwrap();
                assert_eq!(s.num_ooms, before.num_ooms, "{name}: a failed wait is no out of memory");
                assert_eq!(s.allocated_bytes.all.current, before.allocated_bytes.all.current, "{name}");
                assert_eq!(drv.used(0), (s.reserved_bytes.all.current + s.unmapped_held_bytes.current) as usize);
                drv.clear_faults();
                let again = a.malloc(8 * MIB, 0, 1).unwrap_or_else(|e| panic!("{name}, {nth}: {e}"));
                assert!(again != y && again != z);
                if name == "ordinary" {
                    assert_eq!(again, x, "{name}: the block the events held back");
                }
                check(&a);
                all_given_back(&a, &drv, &[again, y, z], &users);
            }
        }
    }
}

#[test]
fn events_that_cannot_be_made_at_the_free_leave_the_block_to_the_device_synchronisation() {
    for (config, name) in configs() {
        for op in [SimOp::EventCreate, SimOp::EventRecord] {
            let users = [2, 4];
            let (a, drv) = sim_with(1, CAPACITY, config.clone());
            let x = a.malloc(8 * MIB, 0, 1).unwrap();
            let y = a.malloc(6 * MIB, 0, 1).unwrap();
            for &s in &users {
                a.record_stream(x, s).unwrap();
                drv.hold_stream(s);
            }
            drv.inject(op, 1, cuda());
            a.free(x).unwrap();
            drv.clear_faults();
            let z = a.malloc(CAPACITY - drv.used(0), 0, 3).unwrap();
            let again = a.malloc(8 * MIB, 0, 1).unwrap_or_else(|e| panic!("{name} {op:?}: {e}"));
            assert!(drv.counts().device_synchronize >= 1, "{name} {op:?}: the block awaited the device");
            assert_eq!(a.stats(0).unwrap().num_ooms, 0, "{name} {op:?}");
            assert_eq!(drv.used(0), CAPACITY, "{name} {op:?}");
            check(&a);
            all_given_back(&a, &drv, &[again, y, z], &users);
        }
    }
}

#[test]
fn a_failed_event_query_fails_the_malloc_and_changes_nothing() {
    for (config, name) in configs() {
        let users = [2, 4];
        let (a, drv, [_, y, z]) = full_behind_events(&config, &users);
        drv.release_stream(2);
        drv.inject(SimOp::EventQuery, 0, cuda());
        let before = a.stats(0).unwrap();
        match a.malloc(8 * MIB, 0, 1) {
            Err(Error::Cuda(_)) => {}
            other => panic!("{name}: {other:?}"),
        }
        check(&a);
        let s = a.stats(0).unwrap();
        assert_eq!((s.num_ooms, s.num_alloc_retries), (before.num_ooms, before.num_alloc_retries), "{name}");
        assert_eq!(s.allocated_bytes.all.current, before.allocated_bytes.all.current, "{name}");
        drv.clear_faults();
        let again = a.malloc(8 * MIB, 0, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        check(&a);
        all_given_back(&a, &drv, &[again, y, z], &users);
    }
}
