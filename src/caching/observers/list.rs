//! A list of callbacks that threads attach and detach while others call them: the one
//! mechanism behind the out-of-memory observers (`out_of_memory::observers`) and the segment observers
//! (`segment_observers`), generic over the callback's type.
//!
//! The list is copy-on-write behind an `ArcSwap`: a call reads it without a lock. A detach
//! takes the entry out, flags it, and (unless the detaching thread is itself inside a call of
//! the list, where waiting could deadlock two observers detaching each other) waits until no
//! call of it is under way, so that what the callback uses may be dropped after.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

struct Entry<F: ?Sized> {
    id: u64,
    /// Calls of `callback` under way, on any thread.
    running: AtomicUsize,
    /// Set by the detach, before it waits for `running` to reach 0.
    detached: AtomicBool,
    callback: Box<F>,
}

/// Callbacks of type `F` in the order attached. `poll`: how long a detach sleeps between looks
/// at the calls it waits for.
pub(crate) struct ObserverList<F: ?Sized> {
    list: ArcSwap<Vec<Arc<Entry<F>>>>,
    next_id: AtomicU64,
    poll: Duration,
}

impl<F: ?Sized> ObserverList<F> {
    pub fn new(poll: Duration) -> Self {
        ObserverList { list: ArcSwap::from_pointee(Vec::new()), next_id: AtomicU64::new(0), poll }
    }

    /// Appends `callback`; it is called from the next call of [`ObserverList::call_each`] on.
    /// Returns its id, never reused within this list.
    pub fn attach(&self, callback: Box<F>) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry { id, running: AtomicUsize::new(0), detached: AtomicBool::new(false), callback });
        self.list.rcu(|list| {
            let mut next = Vec::with_capacity(list.len() + 1);
            next.extend(list.iter().cloned());
            next.push(entry.clone());
            next
        });
        id
    }

    /// Takes `id` out of the list; false when it is not attached (never was, or detached
    /// already). Unless `inside` (the caller runs inside a call of this list), returns only
    /// once no call of it is under way on any thread; none starts after.
    pub fn detach(&self, id: u64, inside: bool) -> bool {
        let mut found = None;
        self.list.rcu(|list| {
            found = list.iter().find(|e| e.id == id).cloned();
            list.iter().filter(|e| e.id != id).cloned().collect::<Vec<_>>()
        });
        let Some(entry) = found else { return false };
        entry.detached.store(true, Ordering::SeqCst);
        if !inside {
            while entry.running.load(Ordering::SeqCst) > 0 {
                std::thread::sleep(self.poll);
            }
        }
        true
    }

    /// Whether no callback is attached.
    pub fn is_empty(&self) -> bool {
        self.list.load().is_empty()
    }

    /// Calls `call` with every callback attached, in order, on the calling thread, each
    /// counted as running for its detach. A panic in a call is caught (the panic hook has
    /// reported it) and counts as `None`; the others are still called. Returns the results.
    pub fn call_each<R>(&self, mut call: impl FnMut(&F) -> R) -> Vec<Option<R>> {
        let list = self.list.load_full();
        let mut out = Vec::with_capacity(list.len());
        for entry in list.iter() {
            entry.running.fetch_add(1, Ordering::SeqCst);
            if !entry.detached.load(Ordering::SeqCst) {
                out.push(catch_unwind(AssertUnwindSafe(|| call(&entry.callback))).ok());
            }
            entry.running.fetch_sub(1, Ordering::SeqCst);
        }
        out
    }
}
