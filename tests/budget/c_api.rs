//! `gpupool_pool_set_limit` and `gpupool_pool_get_limit` through the C API on the simulated
//! device (the red team of issue 43): bad pools, devices, limits and out-pointers refused with
//! `GPUPOOL_ERROR_INVALID_VALUE` and a message naming the problem, nothing changed or written;
//! the limit in `gpupool_pool_stats` and `gpupool_stats`; a refusal's status and message.
//!
//! The process allocator reads `GPUPOOL_*` once: the test runs in a process of its own
//! (`common::process::alone`), which sets them before any call.

use crate::common;

use std::ffi::{CStr, c_void};

use common::process::alone;
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
use gpupool::ffi::pools::{
    GPUPOOL_NO_LIMIT, gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool, gpupool_pool_create,
    gpupool_pool_get_limit, gpupool_pool_set_limit, gpupool_pool_stats, gpupool_release_pool,
};
use gpupool::ffi::stats::{gpupool_stats, gpupool_stats_t};
use gpupool::ffi::status::{gpupool_last_error_message, gpupool_status};

use gpupool_status::*;

const MIB: u64 = 1 << 20;

fn last() -> String {
    // SAFETY: the library returns a NUL-terminated string of the calling thread.
    unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy().into_owned()
}

fn limit(pool: u64) -> u64 {
    let mut l = 0;
    // SAFETY: a writable uint64_t.
    assert_eq!(unsafe { gpupool_pool_get_limit(0, pool, &mut l) }, GPUPOOL_SUCCESS, "{}", last());
    l
}

fn stats(pool: Option<u64>) -> gpupool_stats_t {
    let mut s = gpupool_stats_t { size: size_of::<gpupool_stats_t>() as u32, ..Default::default() };
    // SAFETY: a writable struct of `size` bytes.
    let r = unsafe {
        match pool {
            Some(p) => gpupool_pool_stats(0, p, &mut s),
            None => gpupool_stats(0, &mut s),
        }
    };
    assert_eq!(r, GPUPOOL_SUCCESS, "{}", last());
    s
}

#[test]
fn limits_through_c() {
    if !alone() {
        return;
    }
    // SAFETY: before any other thread of this process reads the environment.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "1GiB");
        std::env::set_var("GPUPOOL_SIM_DEVICES", "1");
    }
    let mut pool = 0u64;
    // SAFETY: writable storage for one uint64_t.
    assert_eq!(unsafe { gpupool_pool_create(&mut pool) }, GPUPOOL_SUCCESS);
    assert_eq!(limit(pool), GPUPOOL_NO_LIMIT);
    assert_eq!(limit(0), GPUPOOL_NO_LIMIT);
    assert_eq!(stats(Some(pool)).pool_limit, i64::MAX);
    assert_eq!(gpupool_pool_set_limit(0, pool, 32 * MIB), GPUPOOL_SUCCESS);

    // Bad input: refused, named, nothing changed or written.
    let bad: [(i32, u64, u64, &str); 4] = [
        (0, pool + 999, MIB, "never created"),
        (0, pool, u64::MAX - 1, "over 2^63-1"),
        (3, pool, MIB, "device"),
        (-7, pool, MIB, "device"),
    ];
    for (device, p, bytes, what) in bad {
        assert_eq!(gpupool_pool_set_limit(device, p, bytes), GPUPOOL_ERROR_INVALID_VALUE, "{what}");
        assert!(last().starts_with("gpupool_pool_set_limit: ") && last().contains(what), "{}", last());
    }
    let mut l = 77u64;
    // SAFETY: NULL, or a writable uint64_t.
    unsafe {
        assert_eq!(gpupool_pool_get_limit(0, pool, std::ptr::null_mut()), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(last().contains("bytes is NULL"), "{}", last());
        assert_eq!(gpupool_pool_get_limit(0, pool + 999, &mut l), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(gpupool_pool_get_limit(9, pool, &mut l), GPUPOOL_ERROR_INVALID_VALUE);
    }
    assert_eq!(l, 77, "nothing written on an error");
    assert_eq!(limit(pool), 32 * MIB, "unchanged by the refused calls");
    assert_eq!(stats(Some(pool)).pool_limit, (32 * MIB) as i64);

    // The pool's refusal: out of memory, the pool, its limit and its use named.
    let s = 0x10 as gpupool_stream_t;
    let mut p: *mut c_void = std::ptr::null_mut();
    assert_eq!(gpupool_begin_allocate_to_pool(0, pool, s), GPUPOOL_SUCCESS);
    // SAFETY: writable storage for one pointer.
    assert_eq!(unsafe { gpupool_malloc(&mut p, (20 * MIB) as usize, 0, s) }, GPUPOOL_SUCCESS);
    let mut q: *mut c_void = std::ptr::null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { gpupool_malloc(&mut q, (20 * MIB) as usize, 0, s) }, GPUPOOL_ERROR_OUT_OF_MEMORY);
    assert!(q.is_null(), "nothing written");
    let msg = last();
    for part in [format!("pool {pool:#x}"), "limited to 32.00 MiB".into(), "reserves 20.00 MiB".into()] {
        assert!(msg.starts_with("gpupool_malloc: ") && msg.contains(&part), "{part:?} not in {msg}");
    }
    assert_eq!(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
    // The default pools' limit, read in the device's statistics.
    assert_eq!(gpupool_pool_set_limit(0, 0, 0), GPUPOOL_SUCCESS);
    assert_eq!((limit(0), stats(None).pool_limit), (0, 0));
    // SAFETY: as above.
    assert_eq!(unsafe { gpupool_malloc(&mut q, 512, 0, s) }, GPUPOOL_ERROR_OUT_OF_MEMORY);
    assert!(last().contains("the default pools (pool 0)"), "{}", last());
    assert_eq!(gpupool_pool_set_limit(0, 0, GPUPOOL_NO_LIMIT), GPUPOOL_SUCCESS);
    assert_eq!(stats(None).pool_limit, i64::MAX);

    // Released: the limit stays readable, a new one is refused.
    assert_eq!(gpupool_release_pool(0, pool), GPUPOOL_SUCCESS);
    assert_eq!(gpupool_pool_set_limit(0, pool, MIB), GPUPOOL_ERROR_INVALID_VALUE);
    assert!(last().contains("released"), "{}", last());
    assert_eq!(limit(pool), 32 * MIB);
    // SAFETY: the block allocated above.
    assert_eq!(unsafe { gpupool_free(p) }, GPUPOOL_SUCCESS);
}
