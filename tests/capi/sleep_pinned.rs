//! `GPUPOOL_SLEEP_OFFLOAD_PINNED` through the C API on the simulated device (the red team of
//! issue 23): bad modes, devices and pools refused with `GPUPOOL_ERROR_INVALID_VALUE` and a
//! message naming the problem, nothing written; NULL out-pointers accepted where the header
//! says so; a released pool's kept copy given back; no panic reaching the boundary.
//!
//! The process allocator reads `GPUPOOL_*` once: the test runs in a process of its own
//! (`common::process::alone`), which sets them before any call.

use crate::common;

use std::ffi::c_void;

use common::process::alone;
use common::{last_error, sleep_kept};
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
use gpupool::ffi::pools::{gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool, gpupool_release_pool};
use gpupool::ffi::sleep::{
    GPUPOOL_SLEEP_OFFLOAD_PINNED, gpupool_pool_create_sleepable, gpupool_sleep, gpupool_sleep_host_bytes,
    gpupool_sleep_release_kept, gpupool_wake,
};
use gpupool::ffi::status::gpupool_status;

use gpupool_status::*;

#[test]
fn the_pinned_mode_through_c() {
    if !alone() {
        return;
    }
    // SAFETY: before any other thread of this process reads the environment.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "256MiB");
        std::env::set_var("GPUPOOL_SIM_DEVICES", "1");
    }
    let mut pool = 0u64;
    // SAFETY: writable storage for one uint64_t.
    assert_eq!(unsafe { gpupool_pool_create_sleepable(&mut pool) }, GPUPOOL_SUCCESS);
    let s = 0x10 as gpupool_stream_t;
    let mut p: *mut c_void = std::ptr::null_mut();
    assert_eq!(gpupool_begin_allocate_to_pool(0, pool, s), GPUPOOL_SUCCESS);
    // SAFETY: writable storage for one pointer.
    assert_eq!(unsafe { gpupool_malloc(&mut p, 3 << 20, 0, s) }, GPUPOOL_SUCCESS);
    assert_eq!(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
    // SAFETY: a live block of 3 MiB of the simulated device (host memory).
    unsafe { std::ptr::write_bytes(p as *mut u8, 0xA5, 3 << 20) };

    for mode in [0, 4, 5, u32::MAX] {
        assert_eq!(gpupool_sleep(0, pool, mode), GPUPOOL_ERROR_INVALID_VALUE, "mode {mode}");
        assert!(
            last_error().starts_with("gpupool_sleep: mode") && last_error().contains("is not a sleep mode"),
            "{}",
            last_error()
        );
    }
    assert_eq!(gpupool_sleep(7, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED), GPUPOOL_ERROR_INVALID_VALUE);
    assert_eq!(gpupool_sleep(0, 123_456, GPUPOOL_SLEEP_OFFLOAD_PINNED), GPUPOOL_ERROR_INVALID_VALUE);
    assert!(last_error().contains("never created"), "{}", last_error());
    // Bad devices and pools: refused, nothing written.
    let mut n = 77usize;
    // SAFETY: writable size_t, or NULL.
    unsafe {
        assert_eq!(gpupool_sleep_release_kept(5, pool, &mut n), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(gpupool_sleep_release_kept(-7, pool, &mut n), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(gpupool_sleep_release_kept(0, 1 << 40, &mut n), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(gpupool_sleep_release_kept(0, u64::MAX, &mut n), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(gpupool_sleep_host_bytes(9, &mut n, &mut n), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(n, 77, "nothing written on an error");
        assert_eq!(gpupool_sleep_host_bytes(0, std::ptr::null_mut(), std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_sleep_release_kept(0, 0, std::ptr::null_mut()), GPUPOOL_SUCCESS, "pool 0: nothing kept");
    }

    for _ in 0..3 {
        assert_eq!(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED), GPUPOOL_SUCCESS, "{}", last_error());
        assert_eq!(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED), GPUPOOL_ERROR_INVALID_VALUE);
        // A sleeping pool's copy is in use: release_kept gives nothing and the wake restores.
        // SAFETY: writable size_t.
        assert_eq!(unsafe { gpupool_sleep_release_kept(0, pool, &mut n) }, GPUPOOL_SUCCESS);
        assert_eq!(n, 0);
        assert_eq!(gpupool_release_pool(0, pool), GPUPOOL_ERROR_INVALID_VALUE, "refused while asleep");
        assert_eq!(gpupool_wake(0, pool), GPUPOOL_SUCCESS, "{}", last_error());
        // SAFETY: the block is live and its pool awake.
        assert!(unsafe { std::slice::from_raw_parts(p as *const u8, 3 << 20) }.iter().all(|&b| b == 0xA5));
        assert!(sleep_kept() >= 3 << 20);
    }
    // SAFETY: a live block of this allocator.
    assert_eq!(unsafe { gpupool_free(p) }, GPUPOOL_SUCCESS);
    assert_eq!(gpupool_release_pool(0, pool), GPUPOOL_SUCCESS);
    assert_eq!(sleep_kept(), 0, "release_pool gives the kept copy back");
    assert_eq!(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED), GPUPOOL_ERROR_INVALID_VALUE);
    assert!(last_error().contains("released"), "{}", last_error());
    // SAFETY: NULL out-pointer.
    assert_eq!(unsafe { gpupool_sleep_release_kept(0, pool, std::ptr::null_mut()) }, GPUPOOL_SUCCESS);
    assert_eq!(gpupool_wake(0, pool), GPUPOOL_ERROR_INVALID_VALUE);
}
