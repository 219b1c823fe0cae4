//! Out-of-memory observers: functions the program attaches, called when an allocation fails
//! (PyTorch `attachOutOfMemoryObserver`), which may free memory and ask for one more attempt
//! (RMM `failure_callback_resource_adaptor`).

use std::cell::Cell;
use std::ffi::{c_int, c_void};

use parking_lot::Mutex;

use super::runtime;
use super::stats::gpupool_stats_t;
use super::status::{boundary, gpupool_status};
use crate::OomObserverId;
use crate::error::Error;

/// An out-of-memory observer, attached with `gpupool_attach_oom_observer`.
///
/// - `device`: the device ordinal of the failed request (never -1).
/// - `requested`: the bytes the caller asked `gpupool_malloc` for, before rounding (PyTorch's
///   observers get the size of the segment it failed to allocate; the error message names
///   both).
/// - `stats`: the device's statistics once the request had failed (`num_ooms` counts it,
///   `num_alloc_retries` the cache release before it), the same snapshot for every observer.
///   Owned by gpupool and valid during the call only; `stats->size` bytes of it are valid
///   (this library's `sizeof(gpupool_stats_t)`; a program built against an older header reads
///   the fields it knows).
/// - `user`: the pointer given to `gpupool_attach_oom_observer`, passed back as it is.
///
/// It runs on the thread whose request failed, with no lock of gpupool's held: it may call any
/// gpupool function (`gpupool_free`, `gpupool_stats`, `gpupool_empty_cache`,
/// `gpupool_memory_summary`, `gpupool_malloc`...), and `gpupool_oom_retry` to ask for one
/// more attempt. It may end its thread (`pthread_exit`, or a cancellation acted on at a
/// cancellation point in it): gpupool then finishes the failed request (the other observers
/// still run, no retry is made) and the thread's end goes on out of `gpupool_malloc`, the
/// program's cleanup handlers run. Otherwise it must return (no `longjmp` out of it), and a
/// C++ observer must catch its exceptions: one that escapes into gpupool is undefined
/// behaviour, as for any C callback.
#[allow(non_camel_case_types)]
pub type gpupool_oom_observer_fn =
    Option<unsafe extern "C" fn(device: c_int, requested: usize, stats: *const gpupool_stats_t, user: *mut c_void)>;

/// The observer as gpupool calls it: "C-unwind", since it may end the thread (a forced unwind
/// that `crate::callout` stops). The public type stays "C" (C sees no difference), so that
/// Rust code passing an `extern "C"` function keeps compiling.
type ObserverPtr = unsafe extern "C-unwind" fn(c_int, usize, *const gpupool_stats_t, *mut c_void);
type ObserverC = unsafe extern "C" fn(c_int, usize, *const gpupool_stats_t, *mut c_void);

/// A C observer and its `user` pointer, as the allocator's list keeps it.
struct CObserver {
    observer: ObserverPtr,
    user: *mut c_void,
}

// SAFETY: gpupool never dereferences `user`; it passes it back to `observer`, on whichever
// thread's request fails. That `observer` may be called so with it from any thread is what the
// caller of `gpupool_attach_oom_observer` promises (its documentation says so).
unsafe impl Send for CObserver {}
// SAFETY: as for `Send`: shared only to be passed back to `observer`.
unsafe impl Sync for CObserver {}

/// Where a C observer's `gpupool_oom_retry` lands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// This thread is not running a C observer.
    Outside,
    /// It is, and no retry was asked yet.
    NotAsked,
    Asked,
}

thread_local! {
    static RETRY: Cell<Retry> = const { Cell::new(Retry::Outside) };
}

/// The observers attached through the C API, by `(observer, user)`, to find the id that
/// `gpupool_detach_oom_observer` needs. The process-wide allocator lives as long as the
/// process, so one list serves it.
static ATTACHED: Mutex<Vec<(usize, usize, OomObserverId)>> = Mutex::new(Vec::new());

impl CObserver {
    /// Calls the observer; returns whether it called `gpupool_oom_retry`.
    fn call(&self, event: &crate::OomEvent<'_>) -> bool {
        let stats = gpupool_stats_t::from(event.stats);
        let outer = RETRY.replace(Retry::NotAsked);
        // A callout: the observer may end the thread (see `crate::callout`).
        // SAFETY: the caller of gpupool_attach_oom_observer gave a function of this signature
        // and a `user` it may be called with from any thread; `stats` lives across the call.
        crate::callout::callout(|| unsafe { (self.observer)(event.device, event.requested, &stats, self.user) });
        RETRY.replace(outer) == Retry::Asked
    }
}

/// --------------------------------------------------------------------------------------------
/// Observers
/// --------------------------------------------------------------------------------------------
///
/// Functions the program attaches. An out-of-memory observer is called when an allocation fails,
/// and may free memory and ask for one more attempt (PyTorch `attachOutOfMemoryObserver`, RMM's
/// `failure_callback_resource_adaptor`). A segment observer is told of every segment gpupool takes
/// from the driver or gives back, and of every page range it maps or unmaps (PyTorch
/// `attachAllocatorTraceTracker`, through which NCCL registers segments). docs/observers.md.
///
/// --------------------------------------------------------------------------------------------
///
/// Attaches an out-of-memory observer: `observer(device, requested, stats, user)` is called
/// when a `gpupool_malloc` (or PyTorch hook) fails for lack of memory on any device, after
/// gpupool released its cache and retried, before `GPUPOOL_ERROR_OUT_OF_MEMORY` returns
/// (PyTorch `attachOutOfMemoryObserver`, which calls its observers at the same point).
///
/// - Several observers may be attached; they are called in the order attached, each once
///   per failed request.
/// - An observer may free memory and call `gpupool_oom_retry` to ask for one more attempt:
///   once every observer has run, if any asked, the allocation is tried once more (from the
///   cache, a new segment, release-and-retry); if that fails too, the observers are not
///   called again and `GPUPOOL_ERROR_OUT_OF_MEMORY` returns, its message read after the last
///   attempt. A request made from inside an observer that fails calls no observer.
/// - `num_ooms` counts the request once, before the observers run (as PyTorch counts), even
///   when a retry then serves it.
/// - `user`: any pointer, passed back to `observer`; gpupool never reads it. It must stay
///   usable by `observer`, from any thread, until `gpupool_detach_oom_observer` returns.
///
/// Nothing of this runs unless a request failed: an attached observer costs the hit path
/// nothing.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `observer`, or this `observer` with this
/// `user` attached already: the pair names the observer for the detach);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Nothing changes on error.
///
/// Thread-safe: attach and detach from any thread while others allocate.
///
/// # Safety
/// `observer` must be NULL or a function of the signature of `gpupool_oom_observer_fn`, safe
/// to call with `user` from any thread until it is detached.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_attach_oom_observer(
    observer: gpupool_oom_observer_fn,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_attach_oom_observer", || {
        let observer = observer.ok_or_else(|| Error::InvalidValue("observer is NULL".into()))?;
        let allocator = &runtime()?.allocator;
        let key = (observer as usize, user as usize);
        let mut attached = ATTACHED.lock();
        if attached.iter().any(|&(f, u, _)| (f, u) == key) {
            return Err(Error::InvalidValue(format!(
                "this observer is attached already with user {user:p}: each (observer, user) pair is attached once, \
                 so that gpupool_detach_oom_observer knows which to detach"
            )));
        }
        // SAFETY: one calling convention; "C-unwind" only lets the thread's end leave it.
        let observer = unsafe { std::mem::transmute::<ObserverC, ObserverPtr>(observer) };
        let c = CObserver { observer, user };
        let id = allocator.attach_oom_observer(move |event| c.call(event));
        attached.push((key.0, key.1, id));
        Ok(())
    })
}

/// Detaches the observer attached with this `observer` and `user`. Called from outside any
/// observer, it returns once no call of it is under way on any thread, and none starts after:
/// `user` may then be freed. Called from inside an observer (its own or another's), it
/// returns at once, and a call on another thread may still be running. While it waits it holds
/// no lock of gpupool's; the caller must not hold one that the observer takes either (a mutex
/// of its own), or the two would wait for each other.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when no observer is attached with this pair (NULL
/// `observer` included); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Nothing changes on error.
///
/// Thread-safe.
///
/// # Safety
/// Any values are safe: they are only compared with those attached.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_detach_oom_observer(
    observer: gpupool_oom_observer_fn,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_detach_oom_observer", || {
        let allocator = &runtime()?.allocator;
        let key = (observer.map_or(0, |f| f as usize), user as usize);
        let id = {
            let mut attached = ATTACHED.lock();
            let at = attached.iter().position(|&(f, u, _)| (f, u) == key).ok_or_else(|| {
                Error::InvalidValue(format!(
                    "no out-of-memory observer is attached with this function and user {user:p}"
                ))
            })?;
            attached.remove(at).2
        };
        // Without the list's lock: the detach may wait for a call under way, which may attach
        // or detach observers itself.
        allocator.detach_oom_observer(id);
        Ok(())
    })
}

/// Called from inside an out-of-memory observer, asks for one more attempt at the allocation
/// that failed, once every observer has run (RMM's `failure_callback_resource_adaptor` asks
/// the same by its callback's return value). Call it after freeing memory the request may use:
/// the attempt is made once, whatever the number of observers that asked.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the calling thread is not running an
/// out-of-memory observer (the request belongs to the thread that failed); nothing changes.
///
/// Thread-safe: it reads and writes the calling thread's state only.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_oom_retry() -> gpupool_status {
    boundary("gpupool_oom_retry", || {
        if RETRY.get() == Retry::Outside {
            return Err(Error::InvalidValue(
                "not called from inside an out-of-memory observer on the thread whose request failed".into(),
            ));
        }
        RETRY.set(Retry::Asked);
        Ok(())
    })
}
