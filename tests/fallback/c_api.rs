//! `gpupool_pool_create_ex` through the C API (the red team): a NULL out-pointer and unknown
//! flag bits refused with `GPUPOOL_ERROR_INVALID_VALUE` and a message naming the problem,
//! nothing written; a fallback pool serving a default `gpupool_malloc` once the device is full.
//!
//! The process allocator reads `GPUPOOL_*` once: the test runs in a process of its own
//! (`common::process::alone`), which sets them before any call.

use crate::common;

use std::ffi::{CStr, c_void};

use common::process::alone;
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
use gpupool::ffi::pools::{
    GPUPOOL_POOL_NO_SPLIT, GPUPOOL_POOL_USE_ON_OOM, gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool,
    gpupool_pool_create_ex, gpupool_pool_stats,
};
use gpupool::ffi::stats::gpupool_stats_t;
use gpupool::ffi::status::{gpupool_last_error_message, gpupool_status};

use gpupool_status::*;

const MIB: usize = 1 << 20;

fn last() -> String {
    // SAFETY: the library returns a NUL-terminated string of the calling thread.
    unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy().into_owned()
}

fn malloc(size: usize, s: gpupool_stream_t) -> (gpupool_status, *mut c_void) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writable storage for one pointer.
    let r = unsafe { gpupool_malloc(&mut p, size, 0, s) };
    (r, p)
}

#[test]
fn create_ex_through_c() {
    if !alone() {
        return;
    }
    // SAFETY: before any other thread of this process reads the environment.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "64MiB");
        std::env::set_var("GPUPOOL_SIM_DEVICES", "1");
        std::env::set_var("GPUPOOL_CONF", "expandable_segments:False");
    }
    let mut pool = 77u64;
    // SAFETY: NULL, or writable storage for one uint64_t.
    unsafe {
        assert_eq!(gpupool_pool_create_ex(std::ptr::null_mut(), 0), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(last().starts_with("gpupool_pool_create_ex: ") && last().contains("pool is NULL"), "{}", last());
        for bad in [4u32, 0x8000_0000, u32::MAX] {
            assert_eq!(gpupool_pool_create_ex(&mut pool, bad), GPUPOOL_ERROR_INVALID_VALUE, "{bad:#x}");
            assert!(last().contains(&format!("unknown bits {:#x}", bad & !3)), "{}", last());
        }
        assert_eq!(pool, 77, "nothing written on an error");
        assert_eq!(gpupool_pool_create_ex(&mut pool, GPUPOOL_POOL_USE_ON_OOM | GPUPOOL_POOL_NO_SPLIT), GPUPOOL_SUCCESS);
    }
    assert_ne!(pool, 77);
    let s = 0x10 as gpupool_stream_t;
    assert_eq!(gpupool_begin_allocate_to_pool(0, pool, s), GPUPOOL_SUCCESS);
    let (r, p) = malloc(40 * MIB, s);
    assert_eq!(r, GPUPOOL_SUCCESS, "{}", last());
    assert_eq!(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
    // SAFETY: the block allocated above.
    assert_eq!(unsafe { gpupool_free(p) }, GPUPOOL_SUCCESS);
    // The device holds 40 of 64 MiB for the pool: the default request falls back, whole.
    let (r, q) = malloc(30 * MIB, s);
    assert_eq!(r, GPUPOOL_SUCCESS, "{}", last());
    let mut st = gpupool_stats_t { size: size_of::<gpupool_stats_t>() as u32, ..Default::default() };
    // SAFETY: a writable struct of `size` bytes.
    assert_eq!(unsafe { gpupool_pool_stats(0, pool, &mut st) }, GPUPOOL_SUCCESS);
    assert_eq!(st.allocated_bytes.all.current, (40 * MIB) as i64, "the unsplit pool's whole block");
    // SAFETY: the block allocated above.
    assert_eq!(unsafe { gpupool_free(q) }, GPUPOOL_SUCCESS);
}
