//! A test's own code run at a chosen driver call ([`SimDriver::on_call`]): the way a test puts
//! another thread's call (a free, an `empty_cache`) at one exact point inside a long operation
//! of the allocator (a sleep between its copies and its unmapping, say), deterministically,
//! where a second thread and a delay would race. The hook runs on the calling thread before
//! the call takes the simulated device's lock and before its fault check, so it may call the
//! allocator and the driver itself; what locks of the allocator's are held at that call is the
//! allocator's business (a hook that needs one of them deadlocks, as another thread would
//! wait).

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::{SimDriver, SimOp};

/// The hooks waiting for their call.
#[derive(Default)]
pub(super) struct Hooks {
    /// Whether any hook was ever set: until then a call looks at nothing else.
    armed: AtomicBool,
    waiting: Mutex<Vec<Hook>>,
}

struct Hook {
    op: SimOp,
    skip: u32,
    run: Box<dyn FnOnce() + Send>,
}

impl SimDriver {
    /// Runs `hook` once, at the start of a later call of kind `op`: the call after `skip`
    /// calls of that kind (counted from the first hook of the kind still waiting: hooks of one
    /// kind run one after another, in the order they were set), on the thread that makes it,
    /// before the call does anything else (a fault injected into the same call fires after the
    /// hook returns). The hook may call the allocator and the driver; a panic in it unwinds
    /// through the call that ran it, as a panic of the driver would.
    pub fn on_call(&self, op: SimOp, skip: u32, hook: impl FnOnce() + Send + 'static) {
        self.hooks.waiting.lock().push(Hook { op, skip, run: Box::new(hook) });
        self.hooks.armed.store(true, Ordering::Release);
        self.armed.store(true, Ordering::Release);
    }

    /// Hooks set that have not run yet.
    pub fn pending_hooks(&self) -> usize {
        self.hooks.waiting.lock().len()
    }

    /// Drops every hook that has not run yet; returns how many there were.
    pub fn clear_hooks(&self) -> usize {
        std::mem::take(&mut *self.hooks.waiting.lock()).len()
    }

    /// The hook check at the start of every call of kind `op`: runs the hook whose turn has
    /// come, with no lock held.
    pub(super) fn run_hooks(&self, op: SimOp) {
        if !self.hooks.armed.load(Ordering::Acquire) {
            return;
        }
        let due = {
            let mut waiting = self.hooks.waiting.lock();
            match waiting.iter().position(|h| h.op == op) {
                Some(i) if waiting[i].skip == 0 => Some(waiting.remove(i)),
                Some(i) => {
                    waiting[i].skip -= 1;
                    None
                }
                None => None,
            }
        };
        if let Some(h) = due {
            (h.run)();
        }
    }
}
