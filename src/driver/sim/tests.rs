//! The simulated driver's unit tests: injected faults, of each kind, fire on the call chosen; a host
//! wait runs held work up to its event.

use super::*;
use crate::driver::ops::*;

#[test]
fn a_fault_fires_on_the_chosen_call_of_its_kind_only() {
    let sim = SimDriver::new(1, 1 << 30);
    sim.inject(SimOp::MemAlloc, 2, SimFault::Fail(DriverError::OutOfMemory));
    let _ = sim.event_create(0).unwrap();
    let a = sim.mem_alloc(0, 4096).unwrap();
    let b = sim.mem_alloc(0, 4096).unwrap();
    assert_eq!(sim.mem_alloc(0, 4096), Err(DriverError::OutOfMemory), "the third call fails");
    assert_eq!(sim.pending_faults(), 0);
    let c = sim.mem_alloc(0, 4096).unwrap();
    for p in [a, b, c] {
        sim.mem_free(0, p).unwrap();
    }
    assert_eq!((sim.used(0), sim.live_allocations()), (0, 0));
}

#[test]
fn a_missing_symbol_is_reported_by_name_and_a_panic_names_it_too() {
    let sim = SimDriver::new(1, 1 << 30);
    sim.inject(SimOp::MemInfo, 0, SimFault::MissingSymbol);
    match sim.mem_info(0) {
        Err(DriverError::Unavailable(m)) => assert!(m.contains("cuMemGetInfo_v2"), "{m}"),
        other => panic!("{other:?}"),
    }
    sim.inject_panic(SimOp::CurrentDevice, 0);
    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.current_device())).unwrap_err();
    let msg = payload.downcast_ref::<String>().unwrap();
    assert!(msg.starts_with("Missing symbol cuCtxGetCurrent: ") && msg.ends_with(SIM_PANIC_MARK), "{msg}");
    // The state's lock was released by the unwinding, and nothing changed.
    assert_eq!(sim.current_device(), Ok(0));
    sim.inject(SimOp::EventDestroy, 0, SimFault::Fail(DriverError::OutOfMemory));
    let ev = sim.event_create(0).unwrap();
    sim.event_destroy(0, ev);
    assert_eq!(sim.live_events(), 1, "a failed destroy leaves the event alive");
    sim.event_destroy(0, ev);
    assert_eq!(sim.live_events(), 0);
    sim.inject_panic(SimOp::MemAlloc, 5);
    assert_eq!(sim.clear_faults(), 1);
    sim.mem_free(0, sim.mem_alloc(0, 512).unwrap()).unwrap();
}

#[test]
fn a_host_wait_runs_held_work_up_to_its_event_and_is_counted() {
    let sim = SimDriver::new(1, 64 << 20);
    let (early, late) = (sim.event_create(0).unwrap(), sim.event_create(0).unwrap());
    sim.hold_stream(7);
    sim.event_record(0, early, 7).unwrap();
    sim.event_record(0, late, 7).unwrap();
    assert!(!sim.event_query(early).unwrap(), "held work does not run");
    sim.event_synchronize(early).unwrap();
    assert_eq!(sim.stream_waits(7), 1);
    assert!(sim.event_query(early).unwrap() && !sim.event_query(late).unwrap(), "only up to the event waited for");
    sim.event_synchronize(early).unwrap();
    assert_eq!(sim.stream_waits(7), 1, "a wait for work already run is not counted");
    sim.release_stream(7);
    sim.event_synchronize(late).unwrap();
    assert_eq!((sim.stream_waits(7), sim.stream_waits(8)), (1, 0), "nor one on a stream not held");
    for ev in [early, late] {
        sim.event_destroy(0, ev);
    }
}

#[test]
fn a_hook_counts_each_call_once_the_lock_free_calls_included() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    let sim = SimDriver::new(1, 1 << 30);
    for op in [SimOp::ThreadExchangeCaptureMode, SimOp::CurrentDevice] {
        let ran = Arc::new(AtomicU32::new(0));
        let r = ran.clone();
        sim.on_call(op, 1, move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        let call = || match op {
            SimOp::CurrentDevice => drop(sim.current_device().unwrap()),
            _ => drop(sim.exchange_capture_mode(CaptureMode::Global).unwrap()),
        };
        call();
        assert_eq!((ran.load(Ordering::SeqCst), sim.pending_hooks()), (0, 1), "{op:?}: skipped once");
        call();
        assert_eq!((ran.load(Ordering::SeqCst), sim.pending_hooks()), (1, 0), "{op:?}: the second call");
    }
}

#[test]
fn each_map_is_classified_against_the_handle_last_mapped_at_its_address() {
    let sim = SimDriver::new(1, 1 << 30);
    let g = SIM_GRANULARITY;
    let base = sim.address_reserve(0, 4 * g).unwrap();
    let at = |i: u64| base + i * g as u64;
    let (h1, h2, h3) = (sim.mem_create(0, g).unwrap(), sim.mem_create(0, g).unwrap(), sim.mem_create(0, g).unwrap());
    let abc = |s: &SimDriver| {
        let c = s.counts();
        assert!(c.map_fresh <= c.map_new);
        (c.map_returnable, c.map_same, c.map_new, c.map_runs, c.map_runs_spared, c.va_pages_first_mapped)
    };
    // A run of two maps at addresses never mapped: new, new.
    sim.mem_map(0, at(0), g, h1).unwrap();
    sim.mem_map(0, at(1), g, h2).unwrap();
    sim.mem_set_access(0, at(0), 2 * g, &[0], true).unwrap();
    assert_eq!(abc(&sim), (0, 0, 2, 1, 0, 2));
    // h1 back where it was: same, a run wholly spared; h2 moved to page 2: new.
    sim.mem_unmap(0, at(0), g).unwrap();
    sim.mem_unmap(0, at(1), g).unwrap();
    sim.mem_map(0, at(0), g, h1).unwrap();
    sim.mem_set_access(0, at(0), g, &[0], true).unwrap();
    sim.mem_map(0, at(2), g, h2).unwrap();
    sim.mem_set_access(0, at(2), g, &[0], true).unwrap();
    assert_eq!(abc(&sim), (0, 1, 3, 3, 1, 3));
    // Page 1's last handle, h2, is mapped at page 2 now: h3 there is new. Once h2 is unmapped
    // (held, not released), h3 at page 2 is returnable: h2 could have stayed there.
    sim.mem_map(0, at(1), g, h3).unwrap();
    sim.mem_set_access(0, at(1), g, &[0], true).unwrap();
    assert_eq!(abc(&sim), (0, 1, 4, 4, 1, 3));
    sim.mem_unmap(0, at(1), g).unwrap();
    sim.mem_unmap(0, at(2), g).unwrap();
    sim.mem_map(0, at(2), g, h3).unwrap();
    sim.mem_set_access(0, at(2), g, &[0], true).unwrap();
    assert_eq!(abc(&sim), (1, 1, 4, 5, 2, 3));
    // Page 2's last handle is h3 now; once h3 is released, h2 there is new: the page is gone.
    sim.mem_unmap(0, at(2), g).unwrap();
    sim.mem_release(0, h3).unwrap();
    sim.mem_map(0, at(2), g, h2).unwrap();
    sim.mem_set_access(0, at(2), g, &[0], true).unwrap();
    assert_eq!(abc(&sim), (1, 1, 5, 6, 2, 3));
    // A peer's grant over mapped pages closes no run; a freed range is forgotten.
    sim.mem_set_access(0, at(0), g, &[0], true).unwrap();
    assert_eq!(abc(&sim).3, 6);
    for p in [0, 2] {
        sim.mem_unmap(0, at(p), g).unwrap();
    }
    sim.address_free(0, base, 4 * g).unwrap();
    assert_eq!(sim.handle_mapped_at(h1), Some(None));
    let base2 = sim.address_reserve(0, 4 * g).unwrap();
    sim.mem_map(0, base2, g, h1).unwrap();
    sim.mem_set_access(0, base2, g, &[0], true).unwrap();
    let c = sim.counts();
    assert_eq!((c.map_same, c.map_new, c.map_fresh, c.va_pages_first_mapped), (1, 6, 4, 4), "a freed range forgotten");
    sim.mem_unmap(0, base2, g).unwrap();
    sim.address_free(0, base2, 4 * g).unwrap();
    for h in [h1, h2] {
        sim.mem_release(0, h).unwrap();
    }
}
