//! CuPy's compiled hook (`gpupool_cupy_hook_malloc`, `gpupool_cupy_hook_free`,
//! `gpupool_cupy_hook_t` in `src/ffi/plugins.rs`) on the simulated device, called as CuPy's
//! `CFunctionAllocator` calls it, with Rust stand-ins for CuPy's getter of the current stream
//! and CPython's `PyErr_Occurred` and `PyErr_SetString`: blocks follow the stream the getter
//! returns, a failure is raised through `err_set_string` with the right type and message and
//! `(void *)-1` returned, a getter that failed allocates nothing, no `err_set_string` or a NULL
//! `param` fall back to NULL and stderr, the free ignores `-1` and NULL and never reads `param`,
//! and eight threads on their own current streams balance.
//!
//! Each test runs in a process of its own (`common::process::alone`) and calls `setup` first.

use crate::common;

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once};

use common::last_error;
use common::process::alone;
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::plugins::{
    GPUPOOL_CUPY_HOOK_RAISED, gpupool_cupy_hook_free, gpupool_cupy_hook_malloc, gpupool_cupy_hook_t,
};
use gpupool::ffi::stats::{gpupool_stats, gpupool_stats_t};
use gpupool::ffi::status::gpupool_status;

const MIB: usize = 1 << 20;
static SERIAL: Mutex<()> = Mutex::new(());
/// What the stand-in `PyErr_SetString` was given: (the type, the message).
static RAISED: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
/// Whether the stand-in getter fails (and `PyErr_Occurred` then says so).
static GETTER_FAILS: AtomicBool = AtomicBool::new(false);
const OOM_TYPE: usize = 0x0e0e;
const ERROR_TYPE: usize = 0x0e1e;

thread_local! {
    /// The calling thread's current stream, as CuPy keeps it in a `threading.local`.
    static CURRENT: Cell<isize> = const { Cell::new(0x7100) };
}

fn setup() -> std::sync::MutexGuard<'static, ()> {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: before any test's first call into gpupool (every test calls this first,
        // under ONCE), so before the process allocator starts and reads the environment.
        unsafe {
            std::env::set_var("GPUPOOL_DRIVER", "sim");
            std::env::set_var("GPUPOOL_SIM_CAPACITY", "256MiB");
            std::env::set_var("GPUPOOL_SIM_DEVICES", "2");
        }
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

extern "C-unwind" fn getter() -> isize {
    if GETTER_FAILS.load(Ordering::Relaxed) { -1 } else { CURRENT.get() }
}

extern "C-unwind" fn err_occurred() -> *mut c_void {
    if GETTER_FAILS.load(Ordering::Relaxed) { std::ptr::dangling_mut::<c_void>() } else { std::ptr::null_mut() }
}

extern "C-unwind" fn err_set_string(kind: *mut c_void, message: *const c_char) {
    // SAFETY: the hook passes a NUL-terminated string alive for the call.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    RAISED.lock().unwrap().push((kind as usize, text));
}

fn hook(raise: bool) -> gpupool_cupy_hook_t {
    gpupool_cupy_hook_t {
        current_stream: Some(getter),
        stream: std::ptr::null_mut(),
        err_occurred: Some(err_occurred),
        err_set_string: if raise { Some(err_set_string) } else { None },
        out_of_memory: OOM_TYPE as *mut c_void,
        error: ERROR_TYPE as *mut c_void,
    }
}

fn stats(device: c_int) -> gpupool_stats_t {
    let mut s = gpupool_stats_t { size: std::mem::size_of::<gpupool_stats_t>() as u32, ..Default::default() };
    // SAFETY: `s` is a live, writable gpupool_stats_t whose `size` says so.
    assert_eq!(unsafe { gpupool_stats(device, &mut s) }, gpupool_status::GPUPOOL_SUCCESS);
    s
}

fn raised() -> *mut c_void {
    std::ptr::without_provenance_mut(GPUPOOL_CUPY_HOOK_RAISED as usize)
}

fn param(h: &mut gpupool_cupy_hook_t) -> *mut c_void {
    (h as *mut gpupool_cupy_hook_t).cast()
}

#[test]
fn hook_blocks_follow_the_getters_stream() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let mut h = hook(true);
    let before = stats(1);
    // SAFETY (every call below): `param` is a live gpupool_cupy_hook_t whose functions are the
    // stand-ins above; freed pointers come from gpupool.
    unsafe {
        CURRENT.set(0x7100);
        let a = gpupool_cupy_hook_malloc(param(&mut h), 3 * MIB, 1);
        assert!(!a.is_null() && a != raised(), "{}", last_error());
        assert_eq!(stats(1).allocated_bytes.all.current, before.allocated_bytes.all.current + 3 * MIB as i64);
        gpupool_cupy_hook_free(std::ptr::null_mut(), a, 1); // `param` is never read
        assert_eq!(gpupool_cupy_hook_malloc(param(&mut h), 3 * MIB, 1), a); // its stream's cache
        CURRENT.set(0x7200);
        let b = gpupool_cupy_hook_malloc(param(&mut h), 3 * MIB, 1);
        assert!(!b.is_null() && b != a);
        gpupool_cupy_hook_free(param(&mut h), b, 1);
        // b went back to 0x7200: gpupool_malloc for that stream gets it.
        let mut c = std::ptr::null_mut();
        let s = gpupool::ffi::memory::gpupool_malloc(&mut c, 3 * MIB, 1, 0x7200 as gpupool_stream_t);
        assert_eq!((s, c), (gpupool_status::GPUPOOL_SUCCESS, b));
        gpupool::ffi::memory::gpupool_free(c);
        gpupool_cupy_hook_free(param(&mut h), a, 1);
        // A fixed stream: no getter, `stream` used.
        let mut fixed = hook(true);
        fixed.current_stream = None;
        fixed.stream = 0x7200 as gpupool_stream_t;
        assert_eq!(gpupool_cupy_hook_malloc(param(&mut fixed), 3 * MIB, 1), b);
        gpupool_cupy_hook_free(std::ptr::null_mut(), b, 1);
    }
    assert!(RAISED.lock().unwrap().is_empty());
    assert_eq!(stats(1).allocated_bytes.all.current, before.allocated_bytes.all.current);
}

#[test]
fn hook_failures_are_raised_with_their_type_and_message() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let mut h = hook(true);
    let before = stats(0);
    // SAFETY: as above.
    unsafe {
        assert_eq!(gpupool_cupy_hook_malloc(param(&mut h), 1 << 40, 0), raised());
        assert_eq!(gpupool_cupy_hook_malloc(param(&mut h), MIB, 5), raised());
    }
    let got = std::mem::take(&mut *RAISED.lock().unwrap());
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].0, OOM_TYPE);
    assert!(got[0].1.starts_with("gpupool_cupy_hook_malloc failed (gpupool status 2): "), "{}", got[0].1);
    assert!(got[0].1.contains("out of memory"), "{}", got[0].1);
    assert_eq!(got[1].0, ERROR_TYPE);
    assert!(got[1].1.starts_with("gpupool_cupy_hook_malloc failed (gpupool status 1): device 5"), "{}", got[1].1);
    assert_eq!(stats(0).allocated_bytes.all.current, before.allocated_bytes.all.current);
    // A NULL type falls back to NULL and stderr, as without err_set_string.
    h.out_of_memory = std::ptr::null_mut();
    let mut quiet = hook(false);
    // SAFETY: as above.
    unsafe {
        assert!(gpupool_cupy_hook_malloc(param(&mut h), 1 << 40, 0).is_null());
        assert!(gpupool_cupy_hook_malloc(param(&mut quiet), 1 << 40, 0).is_null());
        assert!(last_error().starts_with("gpupool_cupy_hook_malloc: "), "{}", last_error());
        assert!(gpupool_cupy_hook_malloc(std::ptr::null_mut(), MIB, 0).is_null());
        assert!(last_error().contains("param is NULL"), "{}", last_error());
        assert!(gpupool_cupy_hook_malloc(param(&mut quiet), 0, 0).is_null()); // size 0
    }
    assert!(RAISED.lock().unwrap().is_empty());
    assert_eq!(stats(0).allocated_bytes.all.current, before.allocated_bytes.all.current);
}

#[test]
fn a_failed_getter_allocates_nothing() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let mut h = hook(true);
    let before = stats(0);
    GETTER_FAILS.store(true, Ordering::Relaxed);
    // SAFETY: as above.
    let p = unsafe { gpupool_cupy_hook_malloc(param(&mut h), MIB, 0) };
    GETTER_FAILS.store(false, Ordering::Relaxed);
    assert_eq!(p, raised());
    assert!(RAISED.lock().unwrap().is_empty(), "the getter's own exception stays");
    assert_eq!(stats(0), before);
}

#[test]
fn hook_free_ignores_the_raised_value_and_null_and_refuses_foreign_pointers() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let before = stats(0);
    let mut local = 0u64;
    // SAFETY: only compared with gpupool's blocks.
    unsafe {
        gpupool_cupy_hook_free(std::ptr::null_mut(), raised(), 0);
        gpupool_cupy_hook_free(std::ptr::null_mut(), std::ptr::null_mut(), 0);
        assert_eq!(stats(0), before);
        gpupool_cupy_hook_free(std::ptr::null_mut(), (&raw mut local).cast(), 0);
    }
    assert!(last_error().starts_with("gpupool_cupy_hook_free: "), "{}", last_error());
    assert_eq!(stats(0), before);
}

#[test]
fn eight_threads_on_their_own_current_streams_balance() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let before = stats(0);
    std::thread::scope(|s| {
        for t in 0..8isize {
            s.spawn(move || {
                CURRENT.set(0x9000 + t * 0x100);
                let mut h = hook(true);
                let mut kept = Vec::new();
                for i in 0..2000usize {
                    // SAFETY: as above; each thread's own hook and blocks.
                    unsafe {
                        let p = gpupool_cupy_hook_malloc(param(&mut h), 4096 + (i % 17) * 512, 0);
                        assert!(!p.is_null() && p != raised(), "{}", last_error());
                        kept.push(p);
                        if kept.len() > 8 {
                            gpupool_cupy_hook_free(std::ptr::null_mut(), kept.swap_remove(i % 8), 0);
                        }
                    }
                }
                for p in kept {
                    // SAFETY: as above.
                    unsafe { gpupool_cupy_hook_free(std::ptr::null_mut(), p, 0) };
                }
            });
        }
    });
    assert!(RAISED.lock().unwrap().is_empty());
    let after = stats(0);
    assert_eq!(after.allocation.all.current, before.allocation.all.current);
    assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert_eq!(after.allocation.all.allocated, before.allocation.all.allocated + 16_000);
}
