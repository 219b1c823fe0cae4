//! Segment observers under threads (issue 40, defects 5 and 6, attacked again): every observer,
//! whenever it was attached, must be told each range mapped before it is told it unmapped, so
//! that its running total is what the pools map. A mapping is told with no lock held, after
//! the call dropped it; a removal with the lock held. Another thread that unmaps a range
//! between the two must not overtake the mapping: the observer would drop the removal (it was
//! never told the range added) and then hold the range for good.

use crate::common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};
use gpupool::{Allocator, SegmentEvent, SleepMode};

const S: usize = 0x10;
const PAGE: u64 = 2 * MIB as u64;

/// An observer's view: the 2 MiB chunks it holds; a chunk told held twice, or taken away
/// while not held, is recorded as a fault.
#[derive(Default)]
struct Ledger {
    held: BTreeSet<(i32, u64)>,
    faults: Vec<String>,
}

impl Ledger {
    fn apply(&mut self, e: &SegmentEvent) {
        for at in (e.address..e.address + e.bytes as u64).step_by(PAGE as usize) {
            let ok = if e.kind.adds() { self.held.insert((e.device, at)) } else { self.held.remove(&(e.device, at)) };
            if !ok {
                self.faults.push(format!("{e:?} at {at:#x}"));
            }
        }
    }
}

fn observe(a: &Allocator) -> (Arc<Mutex<Ledger>>, gpupool::SegmentObserverId) {
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let l = ledger.clone();
    let id = a.attach_segment_observer(move |e| l.lock().unwrap().apply(e));
    (ledger, id)
}

/// An observer's ledger and, for those attached by a hook, its id.
type Watcher = (Arc<Mutex<Ledger>>, Option<gpupool::SegmentObserverId>);

fn unmap_fault() -> SimFault {
    SimFault::Fail(DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_UNKNOWN".into() })
}

/// `empty_cache` fails to unmap a free page (the driver keeps it mapped: told mapped again,
/// queued until the stream's next release); the next `empty_cache`, on another thread, unmaps
/// it: the observer is told it mapped again before it is told it unmapped, and holds nothing.
#[test]
fn pages_the_driver_kept_are_told_mapped_before_the_next_release_unmaps_them() {
    let (a, sim) = sim_with(1, 1 << 30, Config { expandable_segments: true, ..Config::default() });
    let a = Arc::new(a);
    let (ledger, _) = observe(&a);
    let p = a.malloc(8 * MIB, 0, S).unwrap();
    a.free(p).unwrap();
    assert!(!ledger.lock().unwrap().held.is_empty(), "the mapping was told");
    sim.inject(SimOp::MemUnmap, 0, unmap_fault());
    assert!(a.empty_cache(0).is_err(), "the unmapping failed");
    check(&a);
    let a2 = a.clone();
    std::thread::spawn(move || a2.empty_cache(0).unwrap()).join().unwrap();
    check(&a);
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0, "every page is given back");
    let l = ledger.lock().unwrap();
    assert!(l.faults.is_empty(), "{:?}", l.faults);
    assert!(l.held.is_empty(), "the observer holds {} chunks the device no longer maps", l.held.len());
}

/// Observers attached and detached from hooks at every page a sleep unmaps and a wake maps,
/// on two devices with a pool each, blocks freed meanwhile: each ledger stays consistent, and
/// once everything is given back every observer still attached holds nothing.
#[test]
fn observers_attached_and_detached_inside_sleeps_and_wakes_balance() {
    for at in 0..10u32 {
        let config = Config { expandable_segments: true, sleep_chunk: 2 * MIB, sleep_buffers: 2, ..Config::default() };
        let (a, sim) = sim_with(2, 512 * MIB, config);
        let a = Arc::new(a);
        let (first, _) = observe(&a);
        let mut pools = Vec::new();
        for dev in 0..2 {
            let pool = a.pool_create_sleepable();
            a.begin_allocate_to_pool(dev, pool, S).unwrap();
            let blocks: Vec<u64> =
                [30 * MIB, 45 * MIB, 5 * MIB].iter().map(|&n| a.malloc(n, dev, S).unwrap()).collect();
            a.end_allocate_to_pool(dev, pool).unwrap();
            pools.push((dev, pool, blocks));
        }
        let ledgers: Arc<Mutex<Vec<Watcher>>> = Arc::new(Mutex::new(vec![(first.clone(), None)]));
        for (op, skip) in [(SimOp::MemUnmap, at), (SimOp::MemMap, at), (SimOp::MemUnmap, at / 2 + 1)] {
            let (a2, l2) = (a.clone(), ledgers.clone());
            sim.on_call(op, skip, move || {
                let mut ls = l2.lock().unwrap();
                // Detach the last one attached from a hook, then attach a new one.
                if let Some((_, Some(id))) = ls.last().map(|(l, id)| (l.clone(), *id)) {
                    assert!(a2.detach_segment_observer(id));
                    ls.pop();
                }
                let (l, id) = observe(&a2);
                ls.push((l, Some(id)));
            });
        }
        for (dev, pool, blocks) in &pools {
            let (a2, b, d) = (a.clone(), blocks[1], *dev);
            sim.on_call(SimOp::StreamSynchronize, 0, move || {
                a2.free(b).unwrap();
                let _ = a2.empty_cache(d);
            });
            a.sleep(*dev, *pool, SleepMode::Offload).unwrap();
        }
        for (dev, pool, _) in &pools {
            a.wake(*dev, *pool).unwrap();
        }
        sim.clear_hooks();
        check(&a);
        let mapped: usize = (0..2).map(|d| a.stats(d).unwrap().reserved_bytes.all.current as usize).sum();
        assert_eq!(first.lock().unwrap().held.len() * PAGE as usize, mapped, "at {at}: the first observer's total");
        for (dev, pool, blocks) in &pools {
            for &b in [blocks[0], blocks[2]].iter() {
                a.free(b).unwrap();
            }
            a.release_pool(*dev, *pool).unwrap();
            a.empty_cache(*dev).unwrap();
        }
        check(&a);
        for (i, (l, _)) in ledgers.lock().unwrap().iter().enumerate() {
            let l = l.lock().unwrap();
            assert!(l.faults.is_empty(), "at {at}, observer {i}: {:?}", l.faults);
            assert!(l.held.is_empty(), "at {at}, observer {i}: holds {} chunks given back", l.held.len());
        }
    }
}
