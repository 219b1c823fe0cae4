//! `fork()`: CUDA does not survive it, and a child must not use what the parent cached.
//!
//! A CUDA context belongs to the process that created it: in a forked child every driver call
//! fails, and a pointer from the parent's cache names the parent's memory. Worse, another
//! thread of the parent may have held one of gpupool's locks at the moment of the fork (or been
//! inside its first start); in the child that lock stays held forever. So in a child forked
//! from a process that began to use gpupool, every call of every allocator returns
//! [`Error::DriverUnavailable`] before it takes any lock (PyTorch refuses the same way:
//! "Cannot re-initialize CUDA in forked subprocess"). The parent is unaffected; a child forked
//! before the parent used gpupool may use it.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Error;

static IN_FORKED_CHILD: AtomicBool = AtomicBool::new(false);

/// Whether this process began to use gpupool: an allocator was made, or the process-wide one's
/// start began ([`watch`]). A child forked before that is a process like any other (as PyTorch
/// refuses only a child of a parent that initialised CUDA).
static BEGUN: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_child() {
    // Async-signal-safe: atomic loads and stores.
    if BEGUN.load(Ordering::Relaxed) {
        IN_FORKED_CHILD.store(true, Ordering::Relaxed);
    }
}

/// Registers the child handler (`pthread_atfork`).
extern "C" fn register() {
    // SAFETY: registers a handler that only touches atomics.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
}

/// On Linux the handler is registered when the library is loaded (an `.init_array` entry, run
/// before any thread can call into it), not at the first start: registered there, a fork while
/// another thread was inside the process-wide allocator's first start left the child waiting
/// for ever on a start no thread of its own would finish (`tests/c/test_fork.c`,
/// `during-start`).
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static REGISTER_AT_LOAD: extern "C" fn() = register;

/// Marks this process as using gpupool, before it takes any of gpupool's locks: from here on a
/// forked child refuses every call. Where the handler is not registered at load (not Linux),
/// registers it now, once per process.
pub(crate) fn watch() {
    if !BEGUN.load(Ordering::Relaxed) {
        BEGUN.store(true, Ordering::SeqCst);
    }
    #[cfg(not(target_os = "linux"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| register());
    }
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
