//! Segment observers: functions the program attaches, told of every segment gpupool takes from
//! the driver or gives back and every page range it maps or unmaps (PyTorch
//! `attachAllocatorTraceTracker`, through which `ProcessGroupNCCL` calls `ncclCommRegister` and
//! `ncclCommDeregister` on each segment). docs/observers.md says when each event is told.

use std::ffi::{c_int, c_void};

use parking_lot::Mutex;

use super::status::{boundary, gpupool_status};
use super::{gpupool_stream_t, runtime};
use crate::error::Error;
use crate::{SegmentEvent, SegmentEventKind, SegmentObserverId};

/// A segment came from the driver (`cuMemAlloc`), told after the call (PyTorch
/// `SEGMENT_ALLOC`).
pub const GPUPOOL_SEGMENT_ALLOC: u32 = 0;
/// A segment is about to go back to the driver (`cuMemFree`), told before the call, while its
/// memory is still valid (`SEGMENT_FREE`).
pub const GPUPOOL_SEGMENT_FREE: u32 = 1;
/// Pages of an expandable segment were mapped (`cuMemMap`), told after (`SEGMENT_MAP`).
pub const GPUPOOL_SEGMENT_MAP: u32 = 2;
/// Pages of an expandable segment are about to be unmapped (`cuMemUnmap`), told before
/// (`SEGMENT_UNMAP`).
pub const GPUPOOL_SEGMENT_UNMAP: u32 = 3;

/// One segment event, owned by gpupool and valid during the observer's call only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct gpupool_segment_event_t {
    /// What happened: `GPUPOOL_SEGMENT_ALLOC`, `_FREE`, `_MAP` or `_UNMAP`.
    pub kind: u32,
    /// The device ordinal (never -1).
    pub device: c_int,
    /// The first byte of the segment, or of the page range mapped or unmapped.
    pub address: *mut c_void,
    /// Its length in bytes: the whole segment, or whole pages (2 MiB, or 20 MiB with
    /// `GPUPOOL_EXPANDABLE_LARGE_PAGES` for large requests).
    pub bytes: usize,
    /// The stream whose pools own the segment.
    pub stream: gpupool_stream_t,
    /// The private pool of the segment (`gpupool_pool_create`); 0 for the default pools.
    pub pool: u64,
}

/// A segment observer, attached with `gpupool_attach_segment_observer`: `user` is the pointer
/// given there, `event` is valid during the call only.
#[allow(non_camel_case_types)]
pub type gpupool_segment_observer_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, event: *const gpupool_segment_event_t)>;

/// The observer as gpupool calls it: "C-unwind", since it may end the thread (see
/// `crate::callout`); the public type stays "C", as in `oom`.
type ObserverPtr = unsafe extern "C-unwind" fn(*mut c_void, *const gpupool_segment_event_t);
type ObserverC = unsafe extern "C" fn(*mut c_void, *const gpupool_segment_event_t);

struct CObserver {
    observer: ObserverPtr,
    user: *mut c_void,
}

// SAFETY: gpupool never dereferences `user`; it passes it back to `observer`, from whichever
// thread makes or gives back a segment, as the caller of gpupool_attach_segment_observer
// promises is safe.
unsafe impl Send for CObserver {}
// SAFETY: as for `Send`.
unsafe impl Sync for CObserver {}

impl CObserver {
    fn call(&self, e: &SegmentEvent) {
        let kind = match e.kind {
            SegmentEventKind::Alloc => GPUPOOL_SEGMENT_ALLOC,
            SegmentEventKind::Free => GPUPOOL_SEGMENT_FREE,
            SegmentEventKind::Map => GPUPOOL_SEGMENT_MAP,
            SegmentEventKind::Unmap => GPUPOOL_SEGMENT_UNMAP,
        };
        let event = gpupool_segment_event_t {
            kind,
            device: e.device,
            address: e.address as *mut c_void,
            bytes: e.bytes,
            stream: e.stream as gpupool_stream_t,
            pool: e.pool,
        };
        // A callout: the observer may end the thread (see `crate::callout`).
        // SAFETY: the caller of gpupool_attach_segment_observer gave a function of this
        // signature, callable with `user` from any thread; `event` lives across the call.
        crate::callout::callout(|| unsafe { (self.observer)(self.user, &event) });
    }
}

/// The observers attached through the C API, by `(observer, user)`, for the detach.
static ATTACHED: Mutex<Vec<(usize, usize, SegmentObserverId)>> = Mutex::new(Vec::new());

/// Attaches a segment observer: `observer(user, event)` is told of every segment of any device
/// that gpupool takes from the driver or gives back, and of every page range of an expandable
/// segment it maps or unmaps (PyTorch `attachAllocatorTraceTracker`; `ProcessGroupNCCL`
/// registers each segment with `ncclCommRegister` on `GPUPOOL_SEGMENT_ALLOC`/`MAP` and
/// deregisters it with `ncclCommDeregister` on `GPUPOOL_SEGMENT_FREE`/`UNMAP`).
///
/// - When: `GPUPOOL_SEGMENT_ALLOC` and `GPUPOOL_SEGMENT_MAP` after the driver call, on the
///   thread of the `gpupool_malloc` that grew, with no lock of gpupool's held, before that
///   malloc returns; `GPUPOOL_SEGMENT_FREE` and `GPUPOOL_SEGMENT_UNMAP` before the driver call
///   (the memory is still valid), on the thread of the call that gives it back
///   (`gpupool_empty_cache`, a malloc that releases cache, `gpupool_release_pool`, the free of a
///   released pool's last block: docs/observers.md lists them), with that stream's pools
///   locked, as PyTorch calls its trace tracker under its allocator's mutex. Every observer sees a range added before it is taken away.
/// - What: for each observer, bytes added minus bytes taken away equals the reserved bytes
///   (`gpupool_stats`' `reserved_bytes`) of the segments made since its attach, whenever no
///   call is under way. Segments that existed before the attach are not told.
/// - The observer may call CUDA and NCCL. It must not call gpupool: a `gpupool_malloc` from it
///   that needs a new segment fails with `GPUPOOL_ERROR_INVALID_VALUE`, and a call on the
///   stream of a FREE or UNMAP event would wait forever for the lock held. It may end its
///   thread (`pthread_exit`, or a cancellation acted on in it): gpupool then finishes the call
///   that told it (every observer is still told of the call's other events, and a malloc whose
///   growth it was told of gives its block back, since the program never gets it), and the
///   thread's end goes on out of that call, the program's cleanup handlers run. Otherwise it
///   must return (no `longjmp`), and a C++ observer must catch its exceptions.
/// - `user`: any pointer, passed back; gpupool never reads it. It must stay usable, from any
///   thread, until `gpupool_detach_segment_observer` returns.
///
/// With no observer attached, the calls that make or give back segments pay one relaxed load;
/// a cached malloc and free make none, and pay nothing.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `observer`, or this pair attached already);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Nothing changes on error.
///
/// Thread-safe: attach and detach from any thread while others allocate.
///
/// # Safety
/// `observer` must be NULL or a function of the signature of `gpupool_segment_observer_fn`,
/// safe to call with `user` from any thread until it is detached.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_attach_segment_observer(
    observer: gpupool_segment_observer_fn,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_attach_segment_observer", || {
        let observer = observer.ok_or_else(|| Error::InvalidValue("observer is NULL".into()))?;
        let allocator = &runtime()?.allocator;
        let key = (observer as usize, user as usize);
        let mut attached = ATTACHED.lock();
        if attached.iter().any(|&(f, u, _)| (f, u) == key) {
            return Err(Error::InvalidValue(format!(
                "this segment observer is attached already with user {user:p}: each (observer, user) pair is \
                 attached once, so that gpupool_detach_segment_observer knows which to detach"
            )));
        }
        // SAFETY: one calling convention; "C-unwind" only lets the thread's end leave it.
        let observer = unsafe { std::mem::transmute::<ObserverC, ObserverPtr>(observer) };
        let c = CObserver { observer, user };
        let id = allocator.attach_segment_observer(move |event| c.call(event));
        attached.push((key.0, key.1, id));
        Ok(())
    })
}

/// Detaches the segment observer attached with this `observer` and `user`. Called from outside
/// any segment observer, it returns once no call of it is under way on any thread, and none
/// starts after: `user` may then be freed. Called from inside one, it returns at once. The
/// caller must not hold a lock that the observer takes.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when no segment observer is attached with this pair
/// (NULL `observer` included); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`. Nothing changes on error.
///
/// Thread-safe.
///
/// # Safety
/// Any values are safe: they are only compared with those attached.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_detach_segment_observer(
    observer: gpupool_segment_observer_fn,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_detach_segment_observer", || {
        let allocator = &runtime()?.allocator;
        let key = (observer.map_or(0, |f| f as usize), user as usize);
        let id = {
            let mut attached = ATTACHED.lock();
            let at = attached.iter().position(|&(f, u, _)| (f, u) == key).ok_or_else(|| {
                Error::InvalidValue(format!("no segment observer is attached with this function and user {user:p}"))
            })?;
            attached.remove(at).2
        };
        // Without the list's lock: the detach may wait for a call under way.
        allocator.detach_segment_observer(id);
        Ok(())
    })
}
