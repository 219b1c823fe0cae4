//! CPython's C API, found at run time in the process (`dlsym(RTLD_DEFAULT, ...)`), so that
//! gpupool needs no Python to build or to link: under CPython (PyTorch's pluggable allocator,
//! ctypes) the interpreter's exported functions are there; in a C or C++ program they are not,
//! and [`api`] is `None` for the life of the process.
//!
//! Only functions CPython 3.10 to 3.13 export are used, each by its documented contract:
//! `PyThreadState_GetFrame`, `PyFrame_GetCode` and `PyFrame_GetBack` return new references
//! (3.9+); `PyFrame_GetLasti` (3.11+; absent in 3.10, where the line is read at capture with
//! `PyFrame_GetLineNumber`); `PyCode_Addr2Line`; `PyGC_Disable`/`PyGC_Enable` (3.10+). Whether
//! the calling thread holds the GIL is read as `PyGILState_Check` reads it, without its
//! shortcut (it answers 1 to every thread once sub-interpreters exist, in 3.10 and 3.11): the
//! thread state running now (`_PyThreadState_UncheckedGet`, `PyThreadState_GetUnchecked` in
//! 3.13) must be this thread's own (`PyGILState_GetThisThreadState`) and of the main
//! interpreter.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// A `PyObject *`, `PyThreadState *` or `PyInterpreterState *`, opaque.
pub(crate) type Ptr = *mut c_void;

/// The functions used, each found by name.
pub(crate) struct Api {
    pub is_initialized: unsafe extern "C" fn() -> c_int,
    pub current: unsafe extern "C" fn() -> Ptr,
    pub this_thread: unsafe extern "C" fn() -> Ptr,
    pub interpreter_of: unsafe extern "C" fn(Ptr) -> Ptr,
    pub main_interpreter: unsafe extern "C" fn() -> Ptr,
    pub thread_frame: unsafe extern "C" fn(Ptr) -> Ptr,
    pub frame_back: unsafe extern "C" fn(Ptr) -> Ptr,
    pub frame_code: unsafe extern "C" fn(Ptr) -> Ptr,
    /// `PyFrame_GetLasti`: `None` before 3.11.
    pub frame_lasti: Option<unsafe extern "C" fn(Ptr) -> c_int>,
    pub frame_line: unsafe extern "C" fn(Ptr) -> c_int,
    pub addr2line: unsafe extern "C" fn(Ptr, c_int) -> c_int,
    pub decref: unsafe extern "C" fn(Ptr),
    pub getattr: unsafe extern "C" fn(Ptr, *const c_char) -> Ptr,
    pub as_utf8: unsafe extern "C" fn(Ptr) -> *const c_char,
    pub err_clear: unsafe extern "C" fn(),
    pub err_occurred: unsafe extern "C" fn() -> Ptr,
    pub gc_disable: unsafe extern "C" fn() -> c_int,
    pub gc_enable: unsafe extern "C" fn() -> c_int,
    /// `PyGILState_Ensure`, which ends the calling thread (`pthread_exit`) when it waits for the
    /// GIL while the interpreter finalises: "C-unwind", and called as a callout ([`Gil::take`]).
    pub gil_ensure: unsafe extern "C-unwind" fn() -> c_int,
    pub gil_release: unsafe extern "C" fn(c_int),
    /// `Py_IsFinalizing` (3.13+) or `_Py_IsFinalizing` (before): `None` when neither is found.
    pub is_finalizing: Option<unsafe extern "C" fn() -> c_int>,
}

/// The API when the process runs CPython 3.10 or later, looked up the first time it is asked
/// for (a few microseconds, once), `None` when any function is missing.
pub(crate) fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(lookup).as_ref()
}

/// The address of `name` (NUL-terminated) in the process's global symbols, if any.
fn find(name: &str) -> Option<*mut c_void> {
    debug_assert!(name.ends_with('\0'));
    // SAFETY: `name` is NUL-terminated; RTLD_DEFAULT searches the global scope and reads
    // nothing else.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr().cast()) };
    (!p.is_null()).then_some(p)
}

fn lookup() -> Option<Api> {
    macro_rules! f {
        ($name:literal, $t:ty) => {
            // SAFETY: the symbol is CPython's function of that name, whose C signature is `$t`
            // (CPython's headers, 3.10 to 3.13).
            unsafe { std::mem::transmute::<*mut c_void, $t>(find(concat!($name, "\0"))?) }
        };
    }
    let current = find("PyThreadState_GetUnchecked\0").or_else(|| find("_PyThreadState_UncheckedGet\0"))?;
    Some(Api {
        is_initialized: f!("Py_IsInitialized", unsafe extern "C" fn() -> c_int),
        // SAFETY: both names are `PyThreadState *(void)`.
        current: unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> Ptr>(current) },
        this_thread: f!("PyGILState_GetThisThreadState", unsafe extern "C" fn() -> Ptr),
        interpreter_of: f!("PyThreadState_GetInterpreter", unsafe extern "C" fn(Ptr) -> Ptr),
        main_interpreter: f!("PyInterpreterState_Main", unsafe extern "C" fn() -> Ptr),
        thread_frame: f!("PyThreadState_GetFrame", unsafe extern "C" fn(Ptr) -> Ptr),
        frame_back: f!("PyFrame_GetBack", unsafe extern "C" fn(Ptr) -> Ptr),
        frame_code: f!("PyFrame_GetCode", unsafe extern "C" fn(Ptr) -> Ptr),
        frame_lasti: find("PyFrame_GetLasti\0").map(|p| {
            // SAFETY: `int PyFrame_GetLasti(PyFrameObject *)`.
            unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(Ptr) -> c_int>(p) }
        }),
        frame_line: f!("PyFrame_GetLineNumber", unsafe extern "C" fn(Ptr) -> c_int),
        addr2line: f!("PyCode_Addr2Line", unsafe extern "C" fn(Ptr, c_int) -> c_int),
        decref: f!("Py_DecRef", unsafe extern "C" fn(Ptr)),
        getattr: f!("PyObject_GetAttrString", unsafe extern "C" fn(Ptr, *const c_char) -> Ptr),
        as_utf8: f!("PyUnicode_AsUTF8", unsafe extern "C" fn(Ptr) -> *const c_char),
        err_clear: f!("PyErr_Clear", unsafe extern "C" fn()),
        err_occurred: f!("PyErr_Occurred", unsafe extern "C" fn() -> Ptr),
        gc_disable: f!("PyGC_Disable", unsafe extern "C" fn() -> c_int),
        gc_enable: f!("PyGC_Enable", unsafe extern "C" fn() -> c_int),
        gil_ensure: f!("PyGILState_Ensure", unsafe extern "C-unwind" fn() -> c_int),
        gil_release: f!("PyGILState_Release", unsafe extern "C" fn(c_int)),
        is_finalizing: find("Py_IsFinalizing\0").or_else(|| find("_Py_IsFinalizing\0")).map(|p| {
            // SAFETY: both names are `int (void)`, callable without the GIL.
            unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(p) }
        }),
    })
}

impl Api {
    /// The calling thread's state if it holds the GIL of the main interpreter of an
    /// initialised Python; null otherwise (a thread that released the GIL, one Python never
    /// saw, a sub-interpreter's, a Python finalising). Needs no GIL.
    pub fn holding_gil(&self) -> Ptr {
        // SAFETY: each of these may be called without the GIL: they read the runtime's flag
        // and thread-local or atomic state, and the interpreter of a thread state that is
        // this thread's own and current, which cannot go away under it.
        unsafe {
            if (self.is_initialized)() == 0 {
                return std::ptr::null_mut();
            }
            let t = (self.current)();
            if t.is_null() || t != (self.this_thread)() || (self.interpreter_of)(t) != (self.main_interpreter)() {
                return std::ptr::null_mut();
            }
            t
        }
    }

    /// Whether Python is initialised (not yet, or no longer: finalising).
    pub fn initialized(&self) -> bool {
        // SAFETY: callable at any time, without the GIL.
        unsafe { (self.is_initialized)() != 0 }
    }

    /// Whether the interpreter is finalising (`Py_IsFinalizing`): a thread that waits for the
    /// GIL then is ended by CPython, so gpupool does not wait for it. False when the function
    /// is not found (a callout stops the end all the same, see [`Gil::take`]).
    pub fn finalizing(&self) -> bool {
        // SAFETY: callable at any time, without the GIL.
        self.is_finalizing.is_some_and(|f| unsafe { f() } != 0)
    }
}

/// Python's garbage collector held off while this lives (restored as it was when dropped):
/// what gpupool does with the GIL held must run no Python code, for it may hold a lock that
/// the code (a `__del__` that frees a tensor) would take again. Creating a frame object (3.11+)
/// may otherwise start a collection. Take with the GIL held; drop before releasing it.
pub(crate) struct NoGc<'a> {
    api: &'a Api,
    was_enabled: bool,
}

impl<'a> NoGc<'a> {
    pub fn new(api: &'a Api) -> NoGc<'a> {
        // SAFETY: the caller holds the GIL.
        NoGc { api, was_enabled: unsafe { (api.gc_disable)() } != 0 }
    }
}

impl Drop for NoGc<'_> {
    fn drop(&mut self) {
        if self.was_enabled {
            // SAFETY: the GIL is still held (see `NoGc`).
            unsafe { (self.api.gc_enable)() };
        }
    }
}

/// The GIL, taken with `PyGILState_Ensure` (re-entrant: a thread that holds it already keeps
/// it), released when dropped.
pub(crate) struct Gil<'a> {
    api: &'a Api,
    state: c_int,
}

impl<'a> Gil<'a> {
    /// Takes the GIL if Python is initialised and not finalising; `None` when not. Call with
    /// no lock of gpupool's held: a thread holding the GIL may be waiting for one.
    ///
    /// While the interpreter finalises, CPython ends a thread that waits for the GIL
    /// (`pthread_exit` in `PyGILState_Ensure`): how daemon threads end at a program's exit, some
    /// of them inside gpupool. So the GIL is not asked for once finalising has begun, and asked
    /// for as a callout (`crate::callout`): a thread ended while it waits (finalising began
    /// after the check) gets `None`, and its end goes on once its gpupool call is done.
    pub fn take(api: &'a Api) -> Option<Gil<'a>> {
        if !api.initialized() || api.finalizing() {
            return None;
        }
        // SAFETY: Python is initialised; Ensure may be called from any thread.
        let state = crate::callout::callout(|| unsafe { (api.gil_ensure)() })?;
        Some(Gil { api, state })
    }
}

impl Drop for Gil<'_> {
    fn drop(&mut self) {
        // SAFETY: pairs the Ensure of `take`, on the same thread.
        unsafe { (self.api.gil_release)(self.state) };
    }
}
