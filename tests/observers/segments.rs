//! Segment observers (PyTorch `attachAllocatorTraceTracker`) on the simulated device: what they
//! are told matches the segments a snapshot shows and the reserved bytes, frees and unmappings
//! are told while the memory is still the segment's, a panicking observer is contained, an
//! observer that allocates gets an error, and attach and detach race with allocating threads.

use crate::common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{MIB, check, sim, sim_with};
use gpupool::config::Config;
use gpupool::driver::DevicePtr;
use gpupool::driver::sim::SimDriver;
use gpupool::{Allocator, Error, SegmentEvent, SegmentEventKind};

/// Every segment size and page is a multiple of this (PyTorch's 2 MiB rounding of segments,
/// the 2 MiB pages of expandable segments).
const CHUNK: u64 = 2 << 20;

/// What an observer saw: the 2 MiB chunks it was told are held, and every event.
#[derive(Default)]
struct Ledger {
    held: BTreeSet<DevicePtr>,
    events: Vec<SegmentEvent>,
}

impl Ledger {
    fn apply(&mut self, e: &SegmentEvent) {
        assert_eq!(e.address % CHUNK, 0, "{e:?} is not on a 2 MiB boundary");
        assert_eq!(e.bytes as u64 % CHUNK, 0, "{e:?} is not whole 2 MiB chunks");
        for at in (e.address..e.address + e.bytes as u64).step_by(CHUNK as usize) {
            if e.kind.adds() {
                assert!(self.held.insert(at), "{e:?}: {at:#x} told held twice");
            } else {
                assert!(self.held.remove(&at), "{e:?}: {at:#x} taken away but never told held");
            }
        }
        self.events.push(*e);
    }

    fn bytes(&self) -> usize {
        self.held.len() * CHUNK as usize
    }

    /// The chunks held, as coalesced ranges (start, end).
    fn ranges(&self) -> Vec<(DevicePtr, DevicePtr)> {
        coalesce(self.held.iter().map(|&a| (a, a + CHUNK)))
    }
}

fn coalesce(sorted: impl Iterator<Item = (DevicePtr, DevicePtr)>) -> Vec<(DevicePtr, DevicePtr)> {
    let mut out: Vec<(DevicePtr, DevicePtr)> = Vec::new();
    for (s, e) in sorted {
        match out.last_mut() {
            Some(last) if last.1 == s => last.1 = e,
            _ => out.push((s, e)),
        }
    }
    out
}

/// Attaches an observer that keeps a ledger, and at each free or unmapping checks with
/// `check_before` that the driver still holds the memory.
fn ledger(a: &Allocator, check_before: impl Fn(&SegmentEvent, usize) + Send + Sync + 'static) -> Arc<Mutex<Ledger>> {
    let l: Arc<Mutex<Ledger>> = Arc::default();
    let l2 = l.clone();
    a.attach_segment_observer(move |e| {
        let mut l = l2.lock().unwrap();
        if !e.kind.adds() {
            check_before(e, l.bytes());
        }
        l.apply(e);
    });
    l
}

/// The ledger agrees with the reserved bytes and with the snapshot's segments, device 0.
fn agrees(a: &Allocator, l: &Mutex<Ledger>) {
    let l = l.lock().unwrap();
    assert_eq!(l.bytes() as i64, a.stats(0).unwrap().reserved_bytes.all.current, "observed bytes vs reserved");
    let mut segs: Vec<(DevicePtr, DevicePtr)> = a
        .snapshot()
        .unwrap()
        .segments
        .iter()
        .filter(|s| s.device == 0)
        .map(|s| (s.address, s.address + s.total_size as u64))
        .collect();
    segs.sort();
    assert_eq!(l.ranges(), coalesce(segs.into_iter()), "observed ranges vs the snapshot's segments");
}

/// A mix of sizes on three streams, some freed, some kept.
fn workload(a: &Allocator, round: usize) -> Vec<DevicePtr> {
    let mut kept = Vec::new();
    for i in 0..40 {
        let size = [512, 300 << 10, 3 * MIB, 12 * MIB + 5, 40 * MIB][(i + round) % 5];
        let p = a.malloc(size, 0, 1 + (i % 3)).unwrap();
        if (i + round) % 3 == 0 { kept.push(p) } else { a.free(p).unwrap() }
    }
    kept
}

fn run_and_agree(a: &Allocator, sim: &Arc<SimDriver>) -> Arc<Mutex<Ledger>> {
    let s = sim.clone();
    // Before a free or unmapping, the driver still holds (and has accessible) what was told.
    let l = ledger(a, move |e, told| match e.kind {
        SegmentEventKind::Free => assert!(s.used(0) >= told, "{e:?} told after the driver had it back"),
        _ => assert!(s.accessible(0) >= told, "{e:?} told after the pages were unmapped"),
    });
    let mut kept = Vec::new();
    for round in 0..4 {
        kept.extend(workload(a, round));
        agrees(a, &l);
        check(a);
        if round % 2 == 1 {
            for p in kept.drain(..kept.len() / 2) {
                a.free(p).unwrap();
            }
            a.empty_cache(0).unwrap();
            agrees(a, &l);
        }
    }
    for p in kept {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    agrees(a, &l);
    assert_eq!(l.lock().unwrap().bytes(), 0, "everything given back was told");
    l
}

#[test]
fn ordinary_segments_are_told_as_the_snapshot_shows_them() {
    let (a, sim) = sim(1, 1 << 30);
    let l = run_and_agree(&a, &sim);
    let l = l.lock().unwrap();
    assert!(l.events.iter().all(|e| matches!(e.kind, SegmentEventKind::Alloc | SegmentEventKind::Free)));
    assert!(l.events.iter().any(|e| e.kind == SegmentEventKind::Free));
    assert!(l.events.iter().all(|e| e.device == 0 && (1..=3).contains(&e.stream) && e.pool == 0));
}

#[test]
fn expandable_segments_are_told_page_ranges_mapped_and_unmapped() {
    let (a, sim) = sim_with(1, 1 << 30, Config::default());
    let l = run_and_agree(&a, &sim);
    let l = l.lock().unwrap();
    assert!(l.events.iter().all(|e| matches!(e.kind, SegmentEventKind::Map | SegmentEventKind::Unmap)));
    assert!(l.events.iter().any(|e| e.kind == SegmentEventKind::Unmap));
}

#[test]
fn out_of_memory_release_and_the_high_water_rule_are_told_before_the_driver_call() {
    for config in [Config::pytorch(), Config { expandable_reclaim: true, ..Config::default() }] {
        let (a, sim) = sim_with(1, 128 * MIB, config);
        let s = sim.clone();
        let l = ledger(&a, move |_, told| assert!(s.used(0) >= told));
        // Cached on stream 1, then needed by stream 2: released and retried.
        let p = a.malloc(90 * MIB, 0, 1).unwrap();
        a.free(p).unwrap();
        let q = a.malloc(100 * MIB, 0, 2).unwrap();
        assert!(l.lock().unwrap().events.iter().any(|e| !e.kind.adds()), "the release was told");
        agrees(&a, &l);
        a.free(q).unwrap();
        let r = a.malloc(60 * MIB, 0, 3).unwrap();
        agrees(&a, &l);
        a.free(r).unwrap();
        check(&a);
    }
}

#[test]
fn a_panicking_observer_is_contained_and_the_next_still_runs() {
    let (a, _) = sim(1, 1 << 30);
    a.attach_segment_observer(|_| panic!("observer failed"));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    a.attach_segment_observer(move |_| {
        c.fetch_add(1, Ordering::SeqCst);
    });
    let p = a.malloc(MIB, 0, 0).unwrap();
    a.free(p).unwrap();
    a.empty_cache(0).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "alloc and free");
    check(&a);
}

#[test]
fn an_observer_that_allocates_a_segment_gets_an_error() {
    let (a, _) = sim(1, 1 << 30);
    let a = Arc::new(a);
    let weak = Arc::downgrade(&a);
    let results = Arc::new(Mutex::new(Vec::new()));
    let r = results.clone();
    a.attach_segment_observer(move |e| {
        if e.kind == SegmentEventKind::Alloc {
            let a = weak.upgrade().unwrap();
            r.lock().unwrap().push(a.malloc(64 * MIB, 0, 7));
        }
    });
    let p = a.malloc(MIB, 0, 0).unwrap();
    let got = results.lock().unwrap().drain(..).collect::<Vec<_>>();
    assert_eq!(got.len(), 1);
    match &got[0] {
        Err(Error::InvalidValue(m)) => assert!(m.contains("segment observer"), "{m}"),
        other => panic!("expected an error, got {other:?}"),
    }
    // Outside the observer the same request is served.
    let q = a.malloc(64 * MIB, 0, 7).unwrap();
    a.free(q).unwrap();
    a.free(p).unwrap();
    check(&a);
}

#[test]
fn attach_and_detach_race_with_allocating_threads() {
    let (a, _) = sim_with(1, 1 << 30, Config::default());
    let a = Arc::new(a);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let p = a.malloc([3 * MIB, 25 * MIB, 1 << 10][i % 3], 0, 10 + t).unwrap();
                    a.free(p).unwrap();
                    if i % 7 == 0 {
                        a.empty_cache(0).unwrap();
                    }
                    i += 1;
                }
            })
        })
        .collect();
    let late = Arc::new(AtomicBool::new(false));
    let mut told = 0;
    for _ in 0..200 {
        let detached = Arc::new(AtomicBool::new(false));
        let count = Arc::new(AtomicUsize::new(0));
        let (d, c, l) = (detached.clone(), count.clone(), late.clone());
        let id = a.attach_segment_observer(move |_| {
            if d.load(Ordering::SeqCst) {
                l.store(true, Ordering::SeqCst);
            }
            c.fetch_add(1, Ordering::SeqCst);
            std::thread::yield_now();
        });
        std::thread::sleep(std::time::Duration::from_micros(200));
        assert!(a.detach_segment_observer(id));
        detached.store(true, Ordering::SeqCst);
        told += count.load(Ordering::SeqCst);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert!(!late.load(Ordering::SeqCst), "an observer was called after its detach returned");
    assert!(told > 0, "no observer saw any event");
    // Quiescent now: a new observer's ledger follows reserved bytes from here on.
    a.empty_cache(0).unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
    let l = ledger(&a, |_, _| {});
    let kept = workload(&a, 1);
    agrees(&a, &l);
    for p in kept {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    agrees(&a, &l);
    check(&a);
}
