//! Out-of-memory observers: functions called when a request fails after release-and-retry,
//! before its error returns (PyTorch `attachOutOfMemoryObserver`, whose observers
//! `DeviceCachingAllocator::malloc` calls after `stats.num_ooms += 1`, with its lock released,
//! just before it raises `OutOfMemoryError`). An observer may ask for one more attempt, as the
//! callback of RMM's `failure_callback_resource_adaptor` does by returning true.
//!
//! Nothing here runs on the hit path: the list is read only once a request has failed.
//!
//! The list is copy-on-write behind an `ArcSwap`: a failing request takes a snapshot without a
//! lock, attach and detach replace it, so any thread may attach or detach while others
//! allocate or fail. A detach must also wait for the calls of its observer that are under way
//! (a C library frees `user` after it): each entry counts its calls, and a call checks the
//! entry's `detached` flag after counting itself, which with sequentially consistent
//! operations means that either the detach sees the call and waits, or the call sees the flag
//! and skips the observer.

use std::cell::Cell;
use std::time::Duration;

use crate::caching::observers::list::ObserverList;
use crate::stats::DeviceStats;

/// What an out-of-memory observer is told of the request that failed.
#[derive(Clone, Copy, Debug)]
pub struct OomEvent<'a> {
    /// The device ordinal the request resolved to (never -1).
    pub device: i32,
    /// Bytes the caller asked for, before rounding. PyTorch passes its observers the size of
    /// the segment it failed to allocate instead; the error message names both.
    pub requested: usize,
    /// The device's statistics once the request had failed: `num_ooms` counts it already, and
    /// the cache has been released (`num_alloc_retries`). One snapshot for every observer.
    pub stats: &'a DeviceStats,
}

/// Names an observer attached with [`crate::Allocator::attach_oom_observer`], for
/// [`crate::Allocator::detach_oom_observer`]. Never reused within one allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OomObserverId(u64);

/// An observer: returns true to ask for one more attempt.
pub(crate) type ObserverFn = dyn Fn(&OomEvent<'_>) -> bool + Send + Sync;

/// The observers of one allocator, in the order attached.
pub(crate) struct OomObservers {
    list: ObserverList<ObserverFn>,
}

impl Default for OomObservers {
    fn default() -> Self {
        OomObservers { list: ObserverList::new(DETACH_POLL) }
    }
}

thread_local! {
    /// The calling thread is running out-of-memory observers. A request of theirs that fails
    /// calls no observer (an observer that allocates would otherwise recurse for as long as the
    /// device stays full), and a detach from inside an observer does not wait (two observers
    /// detaching each other from two threads would wait for each other).
    static NOTIFYING: Cell<bool> = const { Cell::new(false) };
}

/// How long a detach sleeps between looks at the calls it waits for: observers run after an
/// out-of-memory error, rarely, and may take long (a snapshot written to disk).
const DETACH_POLL: Duration = Duration::from_micros(200);

impl OomObservers {
    /// Appends `observer` to the list; it is called from the next failing request on.
    pub fn attach(&self, observer: Box<ObserverFn>) -> OomObserverId {
        OomObserverId(self.list.attach(observer))
    }

    /// Takes the observer `id` out of the list. Returns false when it is not attached (never
    /// was, or detached already). Unless called from inside an observer, returns only once no
    /// call of it is under way on any thread; no call starts after.
    pub fn detach(&self, id: OomObserverId) -> bool {
        self.list.detach(id.0, NOTIFYING.get())
    }

    /// Calls every observer, in the order attached, on the calling thread, with the statistics
    /// `stats` returns (read once, and only if some observer is attached). Returns whether any
    /// asked for one more attempt. Calls none, and returns false, on a thread that is running
    /// observers already. A panic in an observer is caught here (the panic hook has reported
    /// it): that observer asks for nothing, and the others are still called.
    pub fn notify(&self, device: i32, requested: usize, stats: impl FnOnce() -> DeviceStats) -> bool {
        if NOTIFYING.get() || self.list.is_empty() {
            return false;
        }
        let stats = stats();
        let event = OomEvent { device, requested, stats: &stats };
        NOTIFYING.set(true);
        let _done = scopeguard::guard((), |()| NOTIFYING.set(false));
        self.list.call_each(|observer| observer(&event)).into_iter().any(|asked| asked == Some(true))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn observers_run_in_order_and_any_may_ask_for_a_retry() {
        let obs = OomObservers::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        for i in 0..3 {
            let seen = seen.clone();
            obs.attach(Box::new(move |e| {
                seen.lock().unwrap().push((i, e.device, e.requested));
                i == 1
            }));
        }
        assert!(obs.notify(2, 77, DeviceStats::default));
        assert_eq!(*seen.lock().unwrap(), [(0, 2, 77), (1, 2, 77), (2, 2, 77)]);
    }

    #[test]
    fn no_observer_reads_no_statistics() {
        let obs = OomObservers::default();
        assert!(!obs.notify(0, 1, || panic!("statistics read with no observer attached")));
        let id = obs.attach(Box::new(|_| true));
        assert!(obs.detach(id));
        assert!(!obs.detach(id), "detached twice");
        assert!(!obs.notify(0, 1, || panic!("statistics read after the last detach")));
    }

    #[test]
    fn a_panicking_observer_asks_nothing_and_the_next_still_runs() {
        let obs = OomObservers::default();
        let after = Arc::new(AtomicBool::new(false));
        obs.attach(Box::new(|_| panic!("observer failed")));
        let a = after.clone();
        obs.attach(Box::new(move |_| {
            a.store(true, Ordering::SeqCst);
            false
        }));
        assert!(!obs.notify(0, 1, DeviceStats::default));
        assert!(after.load(Ordering::SeqCst));
        assert!(!NOTIFYING.get(), "the thread's flag is reset");
    }

    #[test]
    fn a_detach_waits_for_the_call_under_way() {
        let obs = Arc::new(OomObservers::default());
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        let finished = Arc::new(AtomicBool::new(false));
        let f = finished.clone();
        let id = obs.attach(Box::new(move |_| {
            entered_tx.send(()).unwrap();
            go_rx.lock().unwrap().recv().unwrap();
            f.store(true, Ordering::SeqCst);
            false
        }));
        let o = obs.clone();
        let caller = std::thread::spawn(move || o.notify(0, 1, DeviceStats::default));
        entered_rx.recv().unwrap();
        let o = obs.clone();
        let fin = finished.clone();
        let detacher = std::thread::spawn(move || {
            assert!(o.detach(id));
            assert!(fin.load(Ordering::SeqCst), "detach returned while its observer was running");
        });
        std::thread::sleep(Duration::from_millis(20));
        assert!(!detacher.is_finished(), "detach did not wait");
        go_tx.send(()).unwrap();
        detacher.join().unwrap();
        assert!(!caller.join().unwrap());
    }

    #[test]
    fn an_observer_may_detach_itself_and_a_nested_failure_calls_none() {
        let obs = Arc::new(OomObservers::default());
        let calls = Arc::new(AtomicUsize::new(0));
        let id = Arc::new(Mutex::new(None));
        let (o, c, i) = (Arc::downgrade(&obs), calls.clone(), id.clone());
        *id.lock().unwrap() = Some(obs.attach(Box::new(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
            let o = o.upgrade().unwrap();
            assert!(!o.notify(0, 1, || panic!("a nested failure read statistics")), "nested call");
            assert!(o.detach(i.lock().unwrap().unwrap()), "returns at once from inside");
            false
        })));
        assert!(!obs.notify(0, 1, DeviceStats::default));
        assert!(!obs.notify(0, 1, DeviceStats::default));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
