//! The other frameworks' allocator functions (`src/ffi/plugins.rs`, `gpupool_plugins.h`) on
//! the simulated device, called as CuPy and ONNX Runtime call them: the stream CuPy's `param`
//! names and the stream `gpupool_ort_set_stream` sets decide which blocks are reused; freed
//! blocks come back to the cache and `gpupool_ort_empty_cache` gives them to the driver; bad
//! devices, sizes too large and foreign pointers fail with NULL or nothing, a message, and no
//! change to the statistics; eight threads at once account for every byte.
//!
//! The process allocator reads `GPUPOOL_*` once: each test runs in a process of its own
//! (`common::process::alone`) and calls `setup` first there. Each checks only what its own calls
//! change, under one lock, so that the tests stay right when they share one allocator.

use crate::common;

use std::ffi::{c_int, c_void};
use std::sync::{Mutex, Once};

use common::last_error;
use common::process::alone;
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::gpupool_empty_cache;
use gpupool::ffi::plugins::{
    gpupool_cupy_free, gpupool_cupy_malloc, gpupool_ort_alloc, gpupool_ort_empty_cache, gpupool_ort_free,
    gpupool_ort_set_stream,
};
use gpupool::ffi::stats::{gpupool_stats, gpupool_stats_t};
use gpupool::ffi::status::gpupool_status;

const MIB: usize = 1 << 20;
static SERIAL: Mutex<()> = Mutex::new(());

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

fn stats(device: c_int) -> gpupool_stats_t {
    let mut s = gpupool_stats_t { size: std::mem::size_of::<gpupool_stats_t>() as u32, ..Default::default() };
    // SAFETY: `s` is a live, writable gpupool_stats_t whose `size` says so.
    assert_eq!(unsafe { gpupool_stats(device, &mut s) }, gpupool_status::GPUPOOL_SUCCESS);
    s
}

fn stream(n: usize) -> *mut c_void {
    (0x5000 + n * 0x100) as *mut c_void
}

#[test]
fn cupy_blocks_are_reused_on_their_stream_only() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let before = stats(1);
    // SAFETY (every call below): the pointers passed to free come from gpupool or are only
    // compared with its blocks; `param` is a stream handle, never dereferenced.
    unsafe {
        let a = gpupool_cupy_malloc(stream(1), 3 * MIB, 1);
        assert!(!a.is_null(), "{}", last_error());
        let now = stats(1);
        assert_eq!(now.allocation.all.current, before.allocation.all.current + 1);
        assert_eq!(now.allocated_bytes.all.current, before.allocated_bytes.all.current + 3 * MIB as i64);
        gpupool_cupy_free(stream(1), a, 1);
        // The same stream gets the block back; another stream does not.
        let b = gpupool_cupy_malloc(stream(1), 3 * MIB, 1);
        assert_eq!(a, b);
        let c = gpupool_cupy_malloc(stream(2), 3 * MIB, 1);
        assert!(!c.is_null(), "{}", last_error());
        assert_ne!(c, a);
        // `param` and `device_id` of the free are ignored: gpupool knows the block.
        gpupool_cupy_free(std::ptr::null_mut(), b, 0);
        gpupool_cupy_free(stream(7), c, 5);
        let after = stats(1);
        assert_eq!(after.allocation.all.current, before.allocation.all.current);
        assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
        assert_eq!(stats(1).allocation.all.allocated, before.allocation.all.allocated + 3);
    }
}

#[test]
fn cupy_failures_return_null_and_change_nothing() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let before = stats(0);
    // SAFETY: as above.
    unsafe {
        assert!(gpupool_cupy_malloc(stream(1), MIB, 2).is_null());
        assert!(last_error().starts_with("gpupool_cupy_malloc: "), "{}", last_error());
        assert!(gpupool_cupy_malloc(stream(1), MIB, -7).is_null());
        assert!(gpupool_cupy_malloc(stream(1), 1 << 40, 0).is_null());
        assert!(last_error().contains("out of memory"), "{}", last_error());
        assert!(gpupool_cupy_malloc(stream(1), 0, 0).is_null());
        // A foreign pointer, an interior one, and one freed twice: refused, nothing changes.
        let mut local = 0u64;
        gpupool_cupy_free(std::ptr::null_mut(), (&mut local as *mut u64).cast(), 0);
        assert!(last_error().starts_with("gpupool_cupy_free: "), "{}", last_error());
        let a = gpupool_cupy_malloc(stream(3), MIB, 0);
        assert!(!a.is_null());
        gpupool_cupy_free(std::ptr::null_mut(), a.cast::<u8>().add(512).cast(), 0);
        assert_eq!(stats(0).allocation.all.current, before.allocation.all.current + 1);
        gpupool_cupy_free(std::ptr::null_mut(), a, 0);
        let mid = stats(0);
        gpupool_cupy_free(std::ptr::null_mut(), a, 0);
        assert_eq!(stats(0), mid);
    }
    let after = stats(0);
    assert_eq!(after.allocation.all.current, before.allocation.all.current);
    assert_eq!(after.num_ooms, before.num_ooms + 1);
}

#[test]
fn ort_allocates_for_its_stream_and_empties_the_cache() {
    if !alone() {
        return;
    }
    let _serial = setup();
    // SAFETY: as above.
    unsafe {
        assert_eq!(gpupool_empty_cache(-1), gpupool_status::GPUPOOL_SUCCESS);
        let before = stats(0);
        assert!(gpupool_ort_alloc(0).is_null());
        let a = gpupool_ort_alloc(5 * MIB);
        assert!(!a.is_null(), "{}", last_error());
        gpupool_ort_free(a);
        // Reused at once on the same (default) stream.
        let b = gpupool_ort_alloc(5 * MIB);
        assert_eq!(a, b);
        gpupool_ort_free(b);
        // Another stream: the cached block stays with the legacy default stream.
        assert_eq!(gpupool_ort_set_stream(stream(9) as gpupool_stream_t), gpupool_status::GPUPOOL_SUCCESS);
        let c = gpupool_ort_alloc(5 * MIB);
        assert!(!c.is_null());
        assert_ne!(c, a);
        gpupool_ort_free(c);
        let d = gpupool_ort_alloc(5 * MIB);
        assert_eq!(c, d);
        gpupool_ort_free(d);
        gpupool_ort_set_stream(std::ptr::null_mut());
        gpupool_ort_free(std::ptr::null_mut());
        let mut local = 0u64;
        gpupool_ort_free((&mut local as *mut u64).cast());
        assert!(last_error().starts_with("gpupool_ort_free: "), "{}", last_error());
        let cached = stats(0);
        assert!(cached.reserved_bytes.all.current > before.reserved_bytes.all.current);
        assert_eq!(cached.allocated_bytes.all.current, before.allocated_bytes.all.current);
        gpupool_ort_empty_cache();
        assert_eq!(stats(0).reserved_bytes.all.current, before.reserved_bytes.all.current);
        assert!(gpupool_ort_alloc(1 << 40).is_null());
        assert!(last_error().starts_with("gpupool_ort_alloc: "), "{}", last_error());
    }
}

#[test]
fn eight_threads_of_ort_and_cupy_calls_balance() {
    if !alone() {
        return;
    }
    let _serial = setup();
    let before = stats(0);
    std::thread::scope(|s| {
        for t in 0..8usize {
            s.spawn(move || {
                let mut live = Vec::new();
                for i in 0..2_000usize {
                    let size = 512 + (i * 7919 + t * 104_729) % (3 * MIB);
                    // SAFETY: as above; every pointer freed came from the matching malloc.
                    unsafe {
                        let p =
                            if t % 2 == 0 { gpupool_ort_alloc(size) } else { gpupool_cupy_malloc(stream(t), size, 0) };
                        assert!(!p.is_null(), "{}", last_error());
                        live.push(p);
                        if live.len() > 4 {
                            let q = live.swap_remove(i % live.len());
                            if t % 2 == 0 { gpupool_ort_free(q) } else { gpupool_cupy_free(stream(t), q, 0) }
                        }
                    }
                }
                for q in live {
                    // SAFETY: as above.
                    unsafe { gpupool_ort_free(q) };
                }
            });
        }
    });
    let after = stats(0);
    assert_eq!(after.allocation.all.current, before.allocation.all.current);
    assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert_eq!(after.allocation.all.allocated, before.allocation.all.allocated + 16_000);
}
