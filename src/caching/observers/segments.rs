//! Segment observers: functions told of every segment gpupool takes from the driver and gives
//! back, and of every page range an expandable segment maps and unmaps (PyTorch's allocator
//! trace tracker, `attachAllocatorTraceTracker`, through which `ProcessGroupNCCL` calls
//! `ncclCommRegister` and `ncclCommDeregister` on every segment).
//!
//! When they run (docs/observers.md):
//! - an allocation or a mapping is told after the driver call, with no lock of gpupool's held:
//!   the shard queues it under its lock and the call delivers its queue once the lock is
//!   dropped (`DeviceAllocator::finish_call`), before the malloc that grew returns;
//! - a free or an unmapping is told before the driver call, with the shard's lock held, as
//!   PyTorch calls its trace tracker under its allocator's mutex: the memory is still the
//!   segment's while the observer deregisters it. The shard's queue is delivered first, so
//!   that each observer sees a range mapped before it is unmapped.
//!
//! The list is copy-on-write behind an `ArcSwap`, read only when `on` says some observer is
//! attached (one relaxed load, on the slow paths that create and free segments). A detach waits
//! for the calls of its observer under way, as the out-of-memory observers' does
//! (`out_of_memory::observers`): each entry counts its calls and has a `detached` flag; a panic in an
//! observer is caught, as there.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::list::ObserverList;

use crate::driver::{DevicePtr, StreamHandle};

/// What happened to a segment or a page range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentEventKind {
    /// An ordinary segment came from the driver (`cuMemAlloc`; PyTorch `SEGMENT_ALLOC`).
    Alloc,
    /// An ordinary segment is about to go back to the driver (`cuMemFree`; `SEGMENT_FREE`).
    Free,
    /// Pages of an expandable segment were mapped (`cuMemMap`; `SEGMENT_MAP`).
    Map,
    /// Pages of an expandable segment are about to be unmapped (`cuMemUnmap`;
    /// `SEGMENT_UNMAP`).
    Unmap,
}

impl SegmentEventKind {
    /// Whether the event adds device memory (`Alloc`, `Map`) rather than takes it away.
    pub fn adds(self) -> bool {
        matches!(self, SegmentEventKind::Alloc | SegmentEventKind::Map)
    }
}

/// One segment event: `bytes` bytes at `address` on `device`, of the segment of `stream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentEvent {
    pub kind: SegmentEventKind,
    /// The device ordinal (never -1).
    pub device: i32,
    /// The first byte of the segment, or of the page range mapped or unmapped.
    pub address: DevicePtr,
    /// Its length in bytes: the segment's size, or whole pages.
    pub bytes: usize,
    /// The stream whose shard owns the segment.
    pub stream: StreamHandle,
    /// The private pool of the segment; 0 for the device's default pools.
    pub pool: u64,
}

/// Names an observer attached with [`crate::Allocator::attach_segment_observer`]. Never reused
/// within one allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentObserverId(u64);

pub(crate) type SegmentObserverFn = dyn Fn(&SegmentEvent) + Send + Sync;

/// The segment observers of one allocator, in the order attached.
pub(crate) struct SegmentObservers {
    list: ObserverList<SegmentObserverFn>,
    /// Observers attached: the one load the slow paths pay with none attached.
    attached: AtomicUsize,
}

impl Default for SegmentObservers {
    fn default() -> Self {
        SegmentObservers { list: ObserverList::new(DETACH_POLL), attached: AtomicUsize::new(0) }
    }
}

thread_local! {
    /// The calling thread is running segment observers: a request of theirs that needs a new
    /// segment fails (see [`observing`]), and a detach from inside does not wait.
    static OBSERVING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is inside a segment observer.
pub(crate) fn observing() -> bool {
    OBSERVING.try_with(Cell::get).unwrap_or(false)
}

const DETACH_POLL: Duration = Duration::from_micros(50);

impl SegmentObservers {
    /// Whether any observer is attached (relaxed: a thread sees an attach that happened before
    /// its call, as program order or a synchronisation makes it).
    #[inline]
    pub fn on(&self) -> bool {
        self.attached.load(Ordering::Relaxed) != 0
    }

    /// Attaches `observer`, behind a filter that tells it only of what it saw added (see
    /// [`Told`]).
    pub fn attach(&self, observer: Box<SegmentObserverFn>) -> SegmentObserverId {
        let told = Told::default();
        let id = self.list.attach(Box::new(move |e: &SegmentEvent| told.pass(e, &*observer)));
        self.attached.fetch_add(1, Ordering::SeqCst);
        SegmentObserverId(id)
    }

    /// Takes `id` out of the list; false when it is not attached. Unless called from inside a
    /// segment observer, returns once no call of it is under way; none starts after.
    pub fn detach(&self, id: SegmentObserverId) -> bool {
        let found = self.list.detach(id.0, observing());
        if found {
            self.attached.fetch_sub(1, Ordering::SeqCst);
        }
        found
    }

    /// Calls every observer with each of `events`, in order, on the calling thread. A panic in
    /// an observer is caught (the panic hook has reported it); the others still run.
    pub fn deliver(&self, events: &[SegmentEvent]) {
        if events.is_empty() {
            return;
        }
        let outer = OBSERVING.replace(true);
        let _done = scopeguard::guard((), |()| OBSERVING.set(outer));
        for event in events {
            self.list.call_each(|observer| observer(event));
        }
    }
}

/// The ranges one observer was told added and not yet taken away, by (device, first byte):
/// its end. A `Free` or `Unmap` reaches the observer only for the parts of its range that it
/// was told added, each stretch of them as one event: a segment made before the attach (or a
/// page mapped then) is never told taken away, so that every observer's bytes added minus
/// taken away stays the bytes of the segments made since its attach. Kept on the slow paths
/// only, while the observer is attached; its lock is never held while the observer runs.
#[derive(Default)]
struct Told {
    ranges: parking_lot::Mutex<std::collections::BTreeMap<(i32, DevicePtr), DevicePtr>>,
}

impl Told {
    /// Calls `observer` with `e`, or with the parts of a removal it was told added.
    fn pass(&self, e: &SegmentEvent, observer: &SegmentObserverFn) {
        let (start, end) = (e.address, e.address + e.bytes as u64);
        let parts = {
            let mut ranges = self.ranges.lock();
            let parts = take(&mut ranges, e.device, start, end);
            if e.kind.adds() {
                // Told once: a range told added again (the driver kept a page an unmapping
                // was told of) is one range.
                ranges.insert((e.device, start), end);
            }
            parts
        };
        if e.kind.adds() {
            return observer(e);
        }
        for (a, b) in parts {
            observer(&SegmentEvent { address: a, bytes: (b - a) as usize, ..*e });
        }
    }
}

/// Takes `start..end` of `device` out of `ranges` (disjoint, by (device, first byte): end), and
/// returns the stretches of it that were there, in order, neighbours joined.
fn take(
    ranges: &mut std::collections::BTreeMap<(i32, DevicePtr), DevicePtr>,
    device: i32,
    start: DevicePtr,
    end: DevicePtr,
) -> Vec<(DevicePtr, DevicePtr)> {
    // Disjoint ranges in reverse order of start have decreasing ends too.
    let overlapping: Vec<(DevicePtr, DevicePtr)> = ranges
        .range((device, 0)..(device, end))
        .rev()
        .take_while(|(_, hi)| **hi > start)
        .map(|(&(_, lo), &hi)| (lo, hi))
        .collect();
    let mut parts: Vec<(DevicePtr, DevicePtr)> = Vec::new();
    for (lo, hi) in overlapping.into_iter().rev() {
        ranges.remove(&(device, lo));
        // What lies outside `start..end` stays.
        if lo < start {
            ranges.insert((device, lo), start);
        }
        if hi > end {
            ranges.insert((device, end), hi);
        }
        let (a, b) = (lo.max(start), hi.min(end));
        match parts.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => parts.push((a, b)),
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn event(address: DevicePtr) -> SegmentEvent {
        SegmentEvent { kind: SegmentEventKind::Alloc, device: 0, address, bytes: 1, stream: 0, pool: 0 }
    }

    #[test]
    fn only_what_was_told_added_is_told_taken_away() {
        let obs = SegmentObservers::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        obs.attach(Box::new(move |e| s.lock().unwrap().push((e.kind, e.address, e.bytes))));
        let ev = |kind, address, bytes| SegmentEvent { kind, device: 0, address, bytes, stream: 0, pool: 0 };
        use SegmentEventKind::{Free, Map, Unmap};
        // Made before the attach: never told.
        obs.deliver(&[ev(Free, 0x1000, 0x100), ev(Unmap, 0x9000, 0x100)]);
        // Pages 0x20..0x40 and 0x40..0x60 mapped, then 0x10..0x50 unmapped: 0x20..0x50 told, as
        // one event; then the rest, 0x50..0x60, within a larger unmapping.
        obs.deliver(&[ev(Map, 0x20, 0x20), ev(Map, 0x40, 0x20), ev(Unmap, 0x10, 0x40), ev(Unmap, 0x0, 0x100)]);
        // Another device's range at the same address is apart.
        obs.deliver(&[SegmentEvent { device: 1, ..ev(Map, 0x20, 0x10) }, ev(Unmap, 0x20, 0x10)]);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            [(Map, 0x20, 0x20), (Map, 0x40, 0x20), (Unmap, 0x20, 0x30), (Unmap, 0x50, 0x10), (Map, 0x20, 0x10)]
        );
    }

    #[test]
    fn on_follows_the_list_and_a_panic_is_caught() {
        let obs = SegmentObservers::default();
        assert!(!obs.on());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let a = obs.attach(Box::new(|_| panic!("observer failed")));
        let s = seen.clone();
        let b = obs.attach(Box::new(move |e| s.lock().unwrap().push((e.address, observing()))));
        assert!(obs.on());
        obs.deliver(&[event(1), event(2)]);
        assert_eq!(*seen.lock().unwrap(), [(1, true), (2, true)]);
        assert!(!observing(), "the thread's flag is reset");
        assert!(obs.detach(a));
        assert!(obs.on());
        assert!(obs.detach(b));
        assert!(!obs.detach(b), "detached twice");
        assert!(!obs.on());
    }
}
