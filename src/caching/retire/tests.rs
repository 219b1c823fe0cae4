//! `Allocator::retire_stream` on the simulated device: a wait only for a stream gpupool holds
//! something of, the wait completing the stream's work, and each refusal leaving every pool
//! and capture as it was.

use std::sync::Arc;

use crate::caching::allocator::Allocator;
use crate::config::Config;
use crate::driver::sim::{SimDriver, SimOp};
use crate::driver::{CaptureMode, DriverError};
use crate::error::Error;

const MIB: usize = 1 << 20;

fn sim() -> (Allocator, Arc<SimDriver>) {
    let drv = Arc::new(SimDriver::new(2, 1 << 30));
    (Allocator::new(drv.clone(), Config::default()), drv)
}

#[test]
fn a_stream_gpupool_never_served_costs_no_wait() {
    let (a, drv) = sim();
    assert!(!a.retire_stream(0, 7).unwrap());
    let x = a.malloc(MIB, 0, 5).unwrap();
    a.free(x).unwrap();
    assert!(!a.retire_stream(0, 7).unwrap(), "stream 7 has no shard");
    assert!(!a.retire_stream(1, 5).unwrap(), "stream 5 has a shard on device 0, not 1");
    assert_eq!(drv.counts().stream_synchronize, 0);
    assert!(a.retire_stream(0, 5).unwrap(), "a block was freed on stream 5");
    assert_eq!(drv.counts().stream_synchronize, 1);
}

/// Stream 5's work is held; an event of it guards a block of stream 6 (`record_stream`). The
/// retire waits for stream 5, after which the block is free without another wait.
#[test]
fn the_wait_completes_the_streams_work() {
    let (a, drv) = sim();
    let kept = a.malloc(MIB, 0, 5).unwrap();
    drv.hold_stream(5);
    let y = a.malloc(4 * MIB, 0, 6).unwrap();
    a.record_stream(y, 5).unwrap();
    a.free(y).unwrap();
    assert!(a.retire_stream(0, 5).unwrap());
    assert_eq!(drv.stream_waits(5), 1, "the host waited for stream 5's held work");
    let waits_before = drv.counts().event_synchronize;
    assert_eq!(a.malloc(4 * MIB, 0, 6).unwrap(), y, "the block is free once stream 5's work is done");
    assert_eq!(drv.counts().event_synchronize, waits_before);
    a.free(kept).unwrap();
}

#[test]
fn refusals_name_the_problem_and_change_nothing() {
    let (a, drv) = sim();
    let x = a.malloc(MIB, 0, 5).unwrap();
    a.free(x).unwrap();
    let before = a.stats(0).unwrap();
    for stream in [0, 1, 2] {
        match a.retire_stream(0, stream) {
            Err(Error::InvalidValue(m)) => assert!(m.contains("default streams"), "{m}"),
            other => panic!("stream {stream}: {other:?}"),
        }
    }
    match a.retire_stream(9, 5) {
        Err(Error::InvalidValue(m)) => assert!(m.contains("device 9 is out of range"), "{m}"),
        other => panic!("{other:?}"),
    }
    // A capture: refused before any wait, the capture still valid.
    drv.begin_capture(5, CaptureMode::Global).unwrap();
    match a.retire_stream(0, 5) {
        Err(Error::Capture(m)) => assert!(m.contains("captures a CUDA graph"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(drv.end_capture(5).unwrap(), "the capture was not invalidated");
    // The driver's failures: reading the capture status, then the wait itself.
    let fault = || DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_UNKNOWN".into() };
    for op in [SimOp::StreamGetCaptureInfo, SimOp::StreamSynchronize] {
        drv.inject_fault(op, 0, fault());
        match a.retire_stream(0, 5) {
            Err(Error::Cuda(m)) => assert!(m.contains("before it is destroyed"), "{op:?}: {m}"),
            other => panic!("{op:?}: {other:?}"),
        }
    }
    assert_eq!(drv.counts().capture_violations, 0);
    assert_eq!(a.stats(0).unwrap(), before, "no refusal changed the statistics");
    assert!(a.retire_stream(0, 5).unwrap(), "and a retire after them waits");
    a.check_invariants().unwrap();
}
