//! Calls out of gpupool into code that may end the calling thread, and that thread's end once
//! gpupool has finished the call it was in (issue 40, defect 8).
//!
//! A program's callback (an out-of-memory or segment observer, a stream filter, a pool's
//! allocator, an output function) may call `pthread_exit`, or act on a `pthread_cancel`; CPython
//! ends a thread that waits for the GIL while the interpreter finalises (`PyGILState_Ensure`
//! calls `pthread_exit`), which is how daemon threads that allocate through gpupool end at a
//! Python program's exit. glibc ends a thread with a forced unwind: it runs every frame's
//! cleanups up to the thread's start and can be stopped by no catch. Rust's `catch_unwind`,
//! which gpupool's C entry points use so that no panic crosses into C, catches it all the same
//! and, unable to rethrow it, aborts the process ("FATAL: exception not rethrown"); an
//! `extern "C"` function aborts too when an unwind leaves it.
//!
//! So a forced unwind is stopped where it enters gpupool: [`callout`] calls the foreign code
//! through `gpupool_callout` (`src/callout.c`), which registers a jump buffer as glibc's
//! `pthread_cleanup_push` does in C without exceptions; the unwinder runs the cleanups of the
//! callee's frames and jumps back there, and [`callout`] returns `None` with the thread marked
//! as exiting. gpupool then finishes its call as if the callback had returned, so that its
//! locks are released and its state and statistics stay consistent (rather than unwind its own
//! frames from the middle of a change: an unmapping is told to observers with the shard locked,
//! before the driver call), and its C entry point goes on with the unwind once the call is
//! done ([`continue_exit`]), outside every `catch_unwind`: the program's own cleanups then run
//! as they would have, and the thread ends with the value it gave `pthread_exit` (or
//! `PTHREAD_CANCELED`). Rust panics are still caught at the entry point. Called through the
//! Rust API, with no C entry point around, the end leaves the call as a panic whose payload
//! `gpupool::ffi::is_thread_exit` recognises (the LD_PRELOAD shim goes on with it).
//!
//! Where the exit goes on: an entry point that is not on the hit path checks the mark when its
//! call ends (`ffi::status::boundary`); the hit path's (malloc and free from the cache) do not
//! look at it, so the cold paths that may call out there end their call with a panic whose
//! payload is [`ThreadExit`] ([`raise_if_exiting`], at a point where the call is complete),
//! which the entry point's `catch_unwind` takes like any panic and turns into
//! [`continue_exit`]. A malloc whose block is complete when its thread's exit is found gives
//! the block back first: the pointer never reaches the program.
//!
//! Cancellation: inside a call of a cold entry point, gpupool's own code runs with
//! cancellation disabled ([`Entry`]): it reaches cancellation points (closing a descriptor,
//! reading `/proc`, sleeping while a detach waits) at which an unwind through Rust frames that
//! were never written for one would abort. The program's state is restored around each
//! callout, so a callback is cancelled where the program expects it. A request to cancel that
//! arrives meanwhile is acted on at the thread's next cancellation point after gpupool returns.
//!
//! Only glibc's forced unwinds are stopped (another runtime's, with a stop function of its own,
//! still aborts at the entry point); elsewhere than glibc, `pthread_exit` does not unwind and
//! [`callout`] just calls.

use std::cell::Cell;
use std::ffi::{c_int, c_void};

/// The payload of the panic that carries a thread's exit, stopped in a callout, from the point
/// where the call it was in is complete to its C entry point ([`raise_if_exiting`]). Never a
/// bug: the entry point goes on with the exit ([`continue_exit`]), reporting nothing.
pub(crate) struct ThreadExit;

#[derive(Clone, Copy)]
struct State {
    /// The thread's exit was stopped in a callout and waits for the call to end.
    exiting: bool,
    /// A cold entry point's call, or a cold path of the hit path's, is under way and goes on
    /// with the exit itself once it is done: [`raise_if_exiting`] leaves it alone.
    deferred: bool,
    /// The program's cancellation state, which [`Entry`] replaced with
    /// `PTHREAD_CANCEL_DISABLE`; `None` outside an [`Entry`].
    caller_cancel: Option<c_int>,
    /// The block a growth made for the malloc under way when observers are to be told of the
    /// growth at the call's end ([`note_block`]); 0 for none.
    grown: u64,
}

const FRESH: State = State { exiting: false, deferred: false, caller_cancel: None, grown: 0 };

thread_local! {
    // Constant, without a destructor: reached from a pthread key's destructor too.
    static STATE: Cell<State> = const { Cell::new(FRESH) };
}

/// `src/callout.c`, declared in a module of its own so that cbindgen, run over the whole crate,
/// leaves the declarations out of the C header.
///
/// cbindgen:ignore
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod c {
    use std::ffi::{c_int, c_void};

    unsafe extern "C-unwind" {
        /// Calls `body(data)`; 1 when a forced unwind left it (stopped there).
        pub(super) fn gpupool_callout(body: extern "C-unwind" fn(*mut c_void), data: *mut c_void) -> c_int;
        /// Goes on with the forced unwind `gpupool_callout` stopped.
        pub(super) fn gpupool_continue_exit() -> !;
    }

    unsafe extern "C" {
        /// `pthread_setcancelstate(PTHREAD_CANCEL_DISABLE)`; the state before.
        pub(super) fn gpupool_cancel_disable() -> c_int;
        /// `pthread_setcancelstate(old)`.
        pub(super) fn gpupool_cancel_restore(old: c_int);
    }
}
#[cfg(all(target_os = "linux", target_env = "gnu"))]
use c::{gpupool_callout, gpupool_cancel_disable, gpupool_cancel_restore, gpupool_continue_exit};

/// Calls `&mut dyn FnMut()` behind `data`: what `gpupool_callout` calls.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C-unwind" fn trampoline(data: *mut c_void) {
    // SAFETY: `data` is the `&mut dyn FnMut()` that `callout` lends for the call.
    let body = unsafe { &mut *data.cast::<&mut dyn FnMut()>() };
    body();
}

/// Disables cancellation on the calling thread; returns its state before, for
/// [`restore_cancel`] (in C: the libc crate does not declare glibc's `pthread_setcancelstate`).
pub(crate) fn disable_cancel() -> c_int {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: a plain call on the calling thread's state.
    return unsafe { gpupool_cancel_disable() };
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    0
}

/// Sets the calling thread's cancellation state back to `old`, from [`disable_cancel`].
pub(crate) fn restore_cancel(old: c_int) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: a plain call on the calling thread's state, with a state it gave.
    unsafe {
        gpupool_cancel_restore(old)
    };
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = old;
}

/// Calls `f`, which calls foreign code that may end the calling thread (a C callback, CPython)
/// and holds nothing that needs dropping: its result, or `None` when the thread's exit or
/// cancellation left it (stopped there: the thread ends once the gpupool call it is in is
/// done, see the module docs).
///
/// The program's cancellation state is in force during the call, and the callee may call
/// gpupool again (each entry point starts afresh). On a thread whose exit waits already the
/// call is made all the same: the observers of the rest of the call must still be told of
/// what it does (a segment unmapped that one of them registered), and an exit asked for again
/// is stopped again (a cancellation that began is not acted on twice).
pub(crate) fn callout<R>(f: impl FnOnce() -> R) -> Option<R> {
    let st = STATE.get();
    // The callee's own gpupool calls start afresh: not deferred, no cancellation state of
    // gpupool's, no exit waiting (a later observer's calls run as calls of a live thread).
    STATE.set(FRESH);
    if let Some(state) = st.caller_cancel {
        restore_cancel(state);
    }
    let (out, stopped) = call(f);
    if st.caller_cancel.is_some() {
        disable_cancel();
    }
    STATE.set(State { exiting: st.exiting || stopped, ..st });
    if stopped { None } else { out }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn call<R>(f: impl FnOnce() -> R) -> (Option<R>, bool) {
    let mut f = Some(f);
    let mut out = None;
    let mut body = || out = f.take().map(|f| f());
    let mut body: &mut dyn FnMut() = &mut body;
    // SAFETY: `trampoline` calls `body`, which lives across the call.
    let stopped = unsafe { gpupool_callout(trampoline, (&raw mut body).cast()) } != 0;
    (out, stopped)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn call<R>(f: impl FnOnce() -> R) -> (Option<R>, bool) {
    (Some(f()), false)
}

/// Whether the calling thread's exit waits for the call it is in to end.
pub(crate) fn exiting() -> bool {
    STATE.get().exiting
}

/// Whether a call that goes on with a thread's end itself is under way ([`Entry`],
/// [`Deferred`]).
pub(crate) fn deferred() -> bool {
    STATE.get().deferred
}

/// Notes `ptr`, the block a growth made for the malloc under way, whose observers are told of
/// the growth at the call's end: if one of them ends the thread, the block goes back
/// (`DeviceAllocator::finish_slow`). Replaces an earlier note.
pub(crate) fn note_block(ptr: u64) {
    STATE.set(State { grown: ptr, ..STATE.get() });
}

/// The block [`note_block`] noted, 0 for none; the note is cleared.
pub(crate) fn take_block() -> u64 {
    let st = STATE.get();
    STATE.set(State { grown: 0, ..st });
    st.grown
}

/// The end of a malloc made on a cold path of the hit path's (`r` its result), when the
/// calling thread ended in a callout during it and no cold path around ends the call itself:
/// the block, which the program will never get, goes back through `give_back`, and the end goes
/// on ([`raise_if_exiting`]). Otherwise `r` as it is.
pub(crate) fn end_of_malloc<E>(r: Result<u64, E>, give_back: impl FnOnce(u64)) -> Result<u64, E> {
    let st = STATE.get();
    if !st.exiting || st.deferred {
        return r;
    }
    take_block();
    if let Ok(p) = &r
        && *p != 0
    {
        give_back(*p);
    }
    raise_if_exiting();
    r
}

/// At a point where the call under way is complete (its locks released, its state consistent)
/// on the hit path's cold paths: when the thread's exit waits, unwinds with [`ThreadExit`] to
/// the C entry point, which goes on with the exit. Does nothing inside a call that goes on with
/// the exit itself ([`Entry`], [`Deferred`]).
pub(crate) fn raise_if_exiting() {
    let st = STATE.get();
    if st.exiting && !st.deferred {
        std::panic::resume_unwind(Box::new(ThreadExit));
    }
}

/// Goes on with the thread's exit that a callout stopped, from the caller's frame: the rest of
/// the unwind runs the cleanups of the frames from here to the thread's start (or the
/// program's next `pthread_cleanup_push`). Call outside every `catch_unwind`, from a frame
/// that may unwind (`extern "C-unwind"`). Never returns.
pub(crate) fn continue_exit() -> ! {
    STATE.set(FRESH);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: the thread's exit was stopped by `gpupool_callout`, whose registration is gone;
    // the registrations before it are the program's and the thread's, all alive.
    unsafe {
        gpupool_continue_exit()
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    unreachable!("no callout stops a thread's exit here")
}

/// A call of a cold C entry point (`ffi::status::boundary`): cancellation disabled, and a
/// thread's exit stopped in a callout left for the entry point to go on with once the call
/// is done. Restores both when dropped.
pub(crate) struct Entry {
    prev: State,
    cancel: c_int,
}

impl Entry {
    pub fn enter() -> Entry {
        let prev = STATE.get();
        let cancel = disable_cancel();
        STATE.set(State { deferred: true, caller_cancel: Some(cancel), ..prev });
        Entry { prev, cancel }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        restore_cancel(self.cancel);
        let exiting = STATE.get().exiting;
        STATE.set(State { exiting, ..self.prev });
    }
}

/// A cold path of the hit path's that ends the call itself (a malloc's detour, which may give
/// its block back): [`raise_if_exiting`] leaves the call alone while this lives; the path
/// checks [`exiting`] at its end. Restores the previous state when dropped.
pub(crate) struct Deferred(bool);

impl Deferred {
    pub fn enter() -> Deferred {
        let st = STATE.get();
        STATE.set(State { deferred: true, ..st });
        Deferred(st.deferred)
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        let st = STATE.get();
        STATE.set(State { deferred: self.0, ..st });
    }
}
