//! `fork()`: CUDA does not survive it, and a child must not use what the parent cached.
//!
//! A CUDA context belongs to the process that created it: in a forked child every driver call
//! fails, and a pointer from the parent's cache names the parent's memory. Worse, another
//! thread of the parent may have held one of gpupool's locks at the moment of the fork; in the
//! child that lock stays held forever. So after a fork every call of every allocator in the
//! child returns [`Error::DriverUnavailable`] before it takes any lock (PyTorch refuses the
//! same way: "Cannot re-initialize CUDA in forked subprocess"). The parent is unaffected.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Error;

static IN_FORKED_CHILD: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_child() {
    // Async-signal-safe: one atomic store.
    IN_FORKED_CHILD.store(true, Ordering::Relaxed);
}

/// Registers the child handler (`pthread_atfork`), once per process.
pub(crate) fn watch() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

/// Errors: [`Error::DriverUnavailable`] in a process forked from one that used gpupool.
#[inline(always)]
pub(crate) fn check() -> Result<(), Error> {
    if forked() {
        return Err(forked_error());
    }
    Ok(())
}

/// Whether this process was forked from one that used gpupool.
#[inline(always)]
pub(crate) fn forked() -> bool {
    IN_FORKED_CHILD.load(Ordering::Relaxed)
}

/// The error of every call in a forked child. Out of line: its message stays off the callers'
/// hit paths.
#[cold]
#[inline(never)]
fn forked_error() -> Error {
    Error::DriverUnavailable(
        "gpupool cannot be used in a forked child process: CUDA does not survive fork(), and the parent's cached \
         memory is not the child's. Start child processes with exec (posix_spawn, or Python's 'spawn' start \
         method) and use gpupool there"
            .into(),
    )
}
