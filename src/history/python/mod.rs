//! The Python frames of a stack (PyTorch's `CapturedTraceback` with `stacks="all"` or
//! `"python"`): each Python frame of the calling thread is captured as (code object,
//! instruction offset), a reference to the code object held, and interned as a `u32`; file,
//! function and line are read only when a snapshot is taken, under the GIL then (taken with
//! `PyGILState_Ensure`). A process without CPython ([`api::api`] is `None`), or a thread that
//! Python never saw (no thread state: a C++ engine's), captures none and never calls into
//! Python.
//!
//! When: a malloc or free that will capture a stack opens a [`Scope`] before it takes any lock
//! of gpupool's: the thread's frames are read then, the GIL taken for it if the thread
//! released it (PyTorch's bindings release it around each operator, ctypes around each call:
//! PyTorch's own `gather` takes it the same way), and every stack captured during the call
//! (under the shard's lock) carries them. Taking the GIL under a shard's lock could deadlock
//! with a thread that holds the GIL and waits for that lock.
//!
//! References: one per distinct (code object, offset) interned, held until the history is
//! cleared ([`PyFrames::release`], from `Allocator::record_history(None)`) or the allocator
//! dropped; each frame is named first, so that a stack captured before keeps its names. While
//! held, a code object cannot die, so its address names it. When Python is no longer
//! initialised (finalised), the references are left as they are, deliberately leaked: nothing
//! of Python may be called then.
//!
//! Lock order: the GIL, then the table's lock; nothing that may run Python code is called with
//! the lock held (the garbage collector is held off while frames are read: [`api::NoGc`]).
//!
//! `api`: CPython's C API, found at run time in the process (`dlsym(RTLD_DEFAULT, ...)`), so
//! that gpupool needs no Python to build or to link; this file: capture, names, references.

mod api;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::frame::Frame;
use api::{Api, Gil, NoGc, Ptr};

/// Python frames kept of a stack, the innermost ones; deeper callers are cut (as native
/// stacks are at 128 frames).
pub(crate) const MAX_PY_FRAMES: usize = 128;

/// A Python frame's id in a stack's list of instruction pointers: this bit set (no user-space
/// address has it), the id in the rest.
pub(crate) const PY_BIT: usize = 1 << (usize::BITS - 1);

/// Interned Python frames.
#[derive(Default)]
pub(crate) struct PyFrames {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// (code object, offset) to id, for the frames whose code object is held.
    ids: FxHashMap<(usize, i32), u32>,
    /// Frame `id` at `id`.
    frames: Vec<Entry>,
}

struct Entry {
    /// The code object, a reference held; 0 once released.
    code: usize,
    /// The instruction's byte offset (3.11+), or the line (3.10).
    at: i32,
    /// Its name, once read.
    named: Option<Frame>,
}

impl PyFrames {
    /// Reads the calling thread's Python frames (innermost first, at most `out.len()` and
    /// [`MAX_PY_FRAMES`]) and pushes their ids, each with [`PY_BIT`], to `out`; returns how
    /// many.
    ///
    /// # Safety
    /// The thread holds the GIL and `tstate` is its state, of the main interpreter.
    unsafe fn read(&self, api: &Api, tstate: Ptr, out: &mut [usize]) -> usize {
        let max = out.len().min(MAX_PY_FRAMES);
        let mut raw = [(0usize, 0i32); MAX_PY_FRAMES];
        // SAFETY: per this function's contract.
        let n = unsafe { walk(api, tstate, &mut raw[..max]) };
        let mut done = [0usize; MAX_PY_FRAMES];
        let mut n_done = 0;
        {
            let mut t = self.inner.lock();
            for (o, &(code, at)) in out.iter_mut().zip(&raw[..n]) {
                let id = match t.ids.get(&(code, at)) {
                    Some(&id) => {
                        done[n_done] = code;
                        n_done += 1;
                        id
                    }
                    None => {
                        // The reference from `PyFrame_GetCode` becomes the table's.
                        let id = t.frames.len() as u32;
                        t.frames.push(Entry { code, at, named: None });
                        t.ids.insert((code, at), id);
                        id
                    }
                };
                *o = PY_BIT | id as usize;
            }
        }
        for &code in &done[..n_done] {
            // SAFETY: a reference of ours, under the GIL; the frame running the code holds
            // another, so this never frees it.
            unsafe { (api.decref)(code as Ptr) };
        }
        n
    }

    /// Reads the calling thread's Python frames for the stacks captured until the scope is
    /// dropped ([`PyFrames::capture`]), taking the GIL if the thread has a Python thread state
    /// and released it. Call with no lock of gpupool's held. An empty scope, at the cost of
    /// one atomic load, without CPython.
    pub fn scope(&self) -> Scope {
        let Some(api) = api::api() else { return Scope::none() };
        // SAFETY: callable without the GIL; null for a thread Python never saw.
        if !api.initialized() || unsafe { (api.this_thread)() }.is_null() {
            return Scope::none();
        }
        let gil = if api.holding_gil().is_null() { Gil::take(api) } else { None };
        let tstate = api.holding_gil();
        let mut ids = [0usize; MAX_PY_FRAMES];
        // SAFETY: `holding_gil`: this thread holds the GIL, `tstate` is its state.
        let n = if tstate.is_null() { 0 } else { unsafe { self.read(api, tstate, &mut ids) } };
        drop(gil);
        let prev = PENDING.with(|p| p.replace(Some(ids[..n].to_vec())));
        Scope { active: true, prev }
    }

    /// Pushes the ids of the calling thread's Python frames, innermost first, each with
    /// [`PY_BIT`], to `out`; returns how many: those of the thread's open [`Scope`], else,
    /// when the thread holds the GIL, read now; else none (never taking the GIL: the caller
    /// may hold a shard's lock).
    pub fn capture(&self, out: &mut [usize]) -> usize {
        let Some(api) = api::api() else { return 0 };
        let pending = PENDING.with(|p| {
            let p = p.borrow();
            p.as_ref().map(|ids| {
                let n = ids.len().min(out.len());
                out[..n].copy_from_slice(&ids[..n]);
                n
            })
        });
        if let Some(n) = pending {
            return n;
        }
        let tstate = api.holding_gil();
        if tstate.is_null() {
            return 0;
        }
        // SAFETY: this thread holds the GIL (`holding_gil`), of the main interpreter.
        unsafe { self.read(api, tstate, out) }
    }

    /// Whether any frame was captured.
    pub fn is_empty(&self) -> bool {
        self.inner.lock().frames.is_empty()
    }

    /// A namer for one snapshot: holds the GIL (when a frame is still to be named and Python
    /// is initialised) until dropped. Take it before any lock of gpupool's.
    pub fn namer(&self) -> Namer<'_> {
        let api = api::api();
        let gil = match api {
            Some(api) if !self.is_empty() => Gil::take(api),
            _ => None,
        };
        Namer { table: self, api, gil }
    }

    /// Names every frame, then gives back the references to their code objects (under the
    /// GIL, taken here: call with no lock of gpupool's held); the ids stay valid, with their
    /// names. Leaves them when Python is not initialised. For when the history is cleared.
    pub fn release(&self) {
        let Some(api) = api::api() else { return };
        if self.is_empty() {
            return;
        }
        let Some(gil) = Gil::take(api) else { return };
        let mut codes = Vec::new();
        {
            let _no_gc = NoGc::new(api);
            let mut t = self.inner.lock();
            t.ids.clear();
            for e in t.frames.iter_mut().filter(|e| e.code != 0) {
                if e.named.is_none() {
                    // SAFETY: the GIL is held, the code object alive (ours).
                    e.named = Some(unsafe { name(api, e.code, e.at) });
                }
                codes.push(std::mem::take(&mut e.code));
            }
        }
        // Outside the lock, the collector on: a code object freed here may run Python code
        // (a weak reference's callback) that allocates through gpupool.
        for code in codes {
            // SAFETY: our reference, under the GIL.
            unsafe { (api.decref)(code as Ptr) };
        }
        drop(gil);
    }
}

thread_local! {
    /// The Python frames of the calling thread's open [`Scope`], if any.
    static PENDING: std::cell::RefCell<Option<Vec<usize>>> = const { std::cell::RefCell::new(None) };
}

/// The Python frames read for one call ([`PyFrames::scope`]); the thread's earlier ones (an
/// outer call's, when an out-of-memory observer allocates) come back when it is dropped.
pub(crate) struct Scope {
    active: bool,
    prev: Option<Vec<usize>>,
}

impl Scope {
    /// A scope that reads nothing and changes nothing.
    pub fn none() -> Scope {
        Scope { active: false, prev: None }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if self.active {
            let prev = self.prev.take();
            let _ = PENDING.try_with(|p| p.replace(prev));
        }
    }
}

impl Drop for PyFrames {
    fn drop(&mut self) {
        self.release();
    }
}

/// Names Python frames for one snapshot ([`PyFrames::namer`]).
pub(crate) struct Namer<'a> {
    table: &'a PyFrames,
    api: Option<&'static Api>,
    gil: Option<Gil<'static>>,
}

impl Namer<'_> {
    /// The frame of `id` (without [`PY_BIT`]): `{filename, line, name}` as PyTorch writes a
    /// Python frame (`co_filename`, the line of the instruction, `co_name`); `??` when it
    /// cannot be named (Python finalised before it was).
    pub fn frame(&mut self, id: usize) -> Frame {
        let mut t = self.table.inner.lock();
        let Some(e) = t.frames.get_mut(id) else { return unknown() };
        if let Some(f) = &e.named {
            return f.clone();
        }
        let (Some(api), Some(_)) = (self.api, &self.gil) else { return unknown() };
        let _no_gc = NoGc::new(api);
        // SAFETY: the GIL is held (`self.gil`), the code object alive (a reference held).
        let f = unsafe { name(api, e.code, e.at) };
        e.named = Some(f.clone());
        f
    }
}

fn unknown() -> Frame {
    Frame { name: "??".to_string(), filename: "<python>".to_string(), line: 0 }
}

/// Walks the thread's frames, innermost first, into `out`: (code object with a new reference,
/// offset or line); returns how many.
///
/// # Safety
/// The calling thread holds the GIL and `tstate` is its thread state.
unsafe fn walk(api: &Api, tstate: Ptr, out: &mut [(usize, i32)]) -> usize {
    let _no_gc = NoGc::new(api);
    let mut n = 0;
    // SAFETY (each call): the GIL is held; every frame pointer is a reference of ours.
    unsafe {
        let had_error = !(api.err_occurred)().is_null();
        let mut frame = (api.thread_frame)(tstate);
        while !frame.is_null() && n < out.len() {
            let code = (api.frame_code)(frame);
            let at = match api.frame_lasti {
                Some(lasti) => lasti(frame),
                None => (api.frame_line)(frame),
            };
            if !code.is_null() {
                out[n] = (code as usize, at);
                n += 1;
            }
            let back = (api.frame_back)(frame);
            (api.decref)(frame);
            frame = back;
        }
        if !frame.is_null() {
            (api.decref)(frame);
        }
        // A frame object that could not be made (out of memory) leaves an exception: not ours
        // to raise.
        if !had_error && !(api.err_occurred)().is_null() {
            (api.err_clear)();
        }
    }
    n
}

/// The frame of `code` at `at` (an offset, or a line before 3.11).
///
/// # Safety
/// The GIL is held and `code` is a live code object.
unsafe fn name(api: &Api, code: usize, at: i32) -> Frame {
    let code = code as Ptr;
    // SAFETY: per this function's contract.
    unsafe {
        let line = if api.frame_lasti.is_some() { (api.addr2line)(code, at) } else { at };
        let filename = attr(api, code, c"co_filename");
        let name = attr(api, code, c"co_name");
        Frame { name, filename, line: u32::try_from(line).unwrap_or(0) }
    }
}

/// The string attribute `attr` of `obj`, `??` when it is not one.
///
/// # Safety
/// The GIL is held and `obj` is alive.
unsafe fn attr(api: &Api, obj: Ptr, attr: &std::ffi::CStr) -> String {
    // SAFETY: per this function's contract; the UTF-8 buffer lives as long as the string,
    // which is released after the copy.
    unsafe {
        let s = (api.getattr)(obj, attr.as_ptr());
        if s.is_null() {
            (api.err_clear)();
            return "??".to_string();
        }
        let p = (api.as_utf8)(s);
        let out = if p.is_null() {
            (api.err_clear)();
            "??".to_string()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        };
        (api.decref)(s);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_cpython_nothing_is_found_or_captured() {
        // `cargo test` runs no Python: the lookup finds nothing, a capture records nothing and
        // a namer takes no GIL.
        assert!(api::api().is_none());
        let t = PyFrames::default();
        let mut out = [0usize; 8];
        assert_eq!(t.capture(&mut out), 0);
        let scope = t.scope();
        assert!(!scope.active);
        assert_eq!(t.capture(&mut out), 0);
        assert!(t.is_empty());
        assert!(t.namer().gil.is_none());
        assert_eq!(t.namer().frame(3), unknown());
        t.release();
    }
}
