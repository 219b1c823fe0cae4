//! What sleep and wake tell the rest of the program (issue 40, defects 4 to 6): segment
//! observers are told every page a sleep gives back and a wake maps again, and never of a
//! segment they did not see made (an observer attached late); `largest_allocatable` answers 0
//! while the default pools sleep, since every unrouted malloc is refused then.

use crate::common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::{Allocator, SegmentEvent, SleepMode};

const S: usize = 0x10;

fn config() -> Config {
    Config { expandable_segments: true, ..Config::default() }
}

/// An observer's view: the 2 MiB chunks it was told held; a chunk told held twice, or taken
/// away without being told held, fails the test.
#[derive(Default)]
struct Ledger {
    held: BTreeSet<u64>,
    unmapped: usize,
    mapped: usize,
}

impl Ledger {
    fn apply(&mut self, e: &SegmentEvent) {
        assert_eq!((e.address % (2 * MIB as u64), e.bytes % (2 * MIB)), (0, 0), "{e:?}");
        for at in (e.address..e.address + e.bytes as u64).step_by(2 * MIB) {
            if e.kind.adds() {
                assert!(self.held.insert(at), "{e:?}: {at:#x} told held twice");
            } else {
                assert!(self.held.remove(&at), "{e:?}: {at:#x} taken away but never told held");
            }
        }
        if e.kind.adds() { self.mapped += e.bytes } else { self.unmapped += e.bytes }
    }

    fn bytes(&self) -> usize {
        self.held.len() * 2 * MIB
    }
}

fn observe(a: &Allocator) -> Arc<Mutex<Ledger>> {
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let l = ledger.clone();
    a.attach_segment_observer(move |e| l.lock().unwrap().apply(e));
    ledger
}

fn reserved(a: &Allocator) -> usize {
    a.stats(0).unwrap().reserved_bytes.all.current as usize
}

#[test]
fn an_observer_attached_late_is_told_nothing_of_what_it_did_not_see_made() {
    for expandable in [true, false] {
        let (a, _) = sim_with(1, 1 << 30, Config { expandable_segments: expandable, ..Config::default() });
        let early: Vec<u64> = [30 * MIB, 3 * MIB, 100_000].iter().map(|&n| a.malloc(n, 0, S).unwrap()).collect();
        let ledger = observe(&a);
        let late: Vec<u64> = [40 * MIB, 5 * MIB].iter().map(|&n| a.malloc(n, 0, S).unwrap()).collect();
        let grown = ledger.lock().unwrap().bytes();
        assert!(grown > 0);
        for p in early.into_iter().chain(late) {
            a.free(p).unwrap();
        }
        a.empty_cache(0).unwrap();
        check(&a);
        assert_eq!(reserved(&a), 0);
        let l = ledger.lock().unwrap();
        assert_eq!(l.bytes(), 0, "expandable {expandable}: what it was told of is all given back");
        assert_eq!(l.unmapped, l.mapped, "expandable {expandable}: nothing made before the attach told taken away");
    }
}

#[test]
fn sleep_and_wake_are_told_to_segment_observers() {
    for mode in [SleepMode::Offload, SleepMode::OffloadPinned, SleepMode::Discard] {
        let (a, _) = sim_with(1, 1 << 30, config());
        let ledger = observe(&a);
        let pool = a.pool_create_sleepable();
        a.begin_allocate_to_pool(0, pool, S).unwrap();
        let blocks: Vec<u64> = [30 * MIB, 7 * MIB, 45 * MIB].iter().map(|&n| a.malloc(n, 0, S).unwrap()).collect();
        a.end_allocate_to_pool(0, pool).unwrap();
        let default = a.malloc(10 * MIB, 0, S).unwrap();
        let pool_bytes = a.pool_stats(0, pool).unwrap().stats.reserved_bytes.all.current as usize;
        assert_eq!(ledger.lock().unwrap().bytes(), reserved(&a));
        a.sleep(0, pool, mode).unwrap();
        // The pool's pages went back to the driver: the observer holds only the default pools'.
        assert_eq!(ledger.lock().unwrap().bytes(), reserved(&a) - pool_bytes, "{mode:?}: asleep");
        a.wake(0, pool).unwrap();
        assert_eq!(ledger.lock().unwrap().bytes(), reserved(&a), "{mode:?}: awake");
        check(&a);
        for p in blocks.into_iter().chain([default]) {
            a.free(p).unwrap();
        }
        a.release_pool(0, pool).unwrap();
        a.empty_cache(0).unwrap();
        assert_eq!(reserved(&a), 0);
        assert_eq!(ledger.lock().unwrap().bytes(), 0, "{mode:?}: all given back");
    }
}

#[test]
fn the_largest_request_is_0_while_the_default_pools_sleep() {
    let (a, _) = sim_with(1, 1 << 30, config());
    let p = a.malloc(30 * MIB, 0, S).unwrap();
    assert!(a.largest_allocatable(0, S).unwrap() > 500 * MIB);
    a.sleep(0, 0, SleepMode::Offload).unwrap();
    assert!(a.malloc(512, 0, S).is_err(), "the default pools refuse while they sleep");
    assert_eq!(a.largest_allocatable(0, S).unwrap(), 0);
    assert_eq!(a.largest_allocatable(0, 0x99).unwrap(), 0, "a stream never used");
    a.wake(0, 0).unwrap();
    assert!(a.largest_allocatable(0, S).unwrap() > 500 * MIB);
    // A sleeping private pool's free pages give nothing back to a request of the default
    // pools: the answer is what a malloc gets.
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, S).unwrap();
    let (x, y) = (a.malloc(200 * MIB, 0, S).unwrap(), a.malloc(20 * MIB, 0, S).unwrap());
    a.end_allocate_to_pool(0, pool).unwrap();
    a.sleep(0, pool, SleepMode::Discard).unwrap();
    a.free(x).unwrap();
    let largest = a.largest_allocatable(0, S).unwrap();
    let q = a.malloc(largest, 0, S).unwrap();
    a.free(q).unwrap();
    assert!(a.malloc(largest + 64 * MIB, 0, S).is_err(), "the answer is within a page of the largest served");
    a.wake(0, pool).unwrap();
    for b in [y, p] {
        a.free(b).unwrap();
    }
    check(&a);
}
