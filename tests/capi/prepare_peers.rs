//! `gpupool_sleep_prepare` and `gpupool_enable_peer_access` through the C API on a simulated
//! host of three devices: bad modes, devices, pools and pairs refused with
//! `GPUPOOL_ERROR_INVALID_VALUE` and a message naming the problem, nothing written; a NULL
//! `pinned` accepted; a prepared copy counted as kept and used by the sleep; a peer enabled
//! once, the second call a no-op.
//!
//! The process allocator reads `GPUPOOL_*` once: the test runs in a process of its own
//! (`common::process::alone`), which sets them before any call.

use crate::common;

use std::ffi::c_void;

use common::process::alone;
use common::{last_error, sleep_kept};
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
use gpupool::ffi::peers::gpupool_enable_peer_access;
use gpupool::ffi::pools::{gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool};
use gpupool::ffi::sleep::{
    GPUPOOL_SLEEP_DISCARD, GPUPOOL_SLEEP_OFFLOAD_PINNED, gpupool_pool_create_sleepable, gpupool_sleep,
    gpupool_sleep_prepare, gpupool_wake,
};
use gpupool::ffi::status::gpupool_status;

use gpupool_status::*;

#[test]
fn prepare_and_peers_through_c() {
    if !alone() {
        return;
    }
    // SAFETY: before any other thread of this process reads the environment.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "256MiB");
        std::env::set_var("GPUPOOL_SIM_DEVICES", "3");
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

    let mut pinned = 12345usize;
    for (device, pool, mode, says) in
        [(0, pool, 0, "mode 0"), (0, pool, 9, "mode 9"), (5, pool, 3, "device"), (0, 0x4000_0000_0000_0999, 3, "pool")]
    {
        // SAFETY: a writable size_t.
        let st = unsafe { gpupool_sleep_prepare(device, pool, mode, &mut pinned) };
        assert_eq!(st, GPUPOOL_ERROR_INVALID_VALUE, "{device} {pool:#x} {mode}");
        let m = last_error();
        assert!(m.starts_with("gpupool_sleep_prepare") && m.contains(says), "{m}");
        assert_eq!(pinned, 12345, "nothing written");
    }
    assert_eq!(sleep_kept(), 0, "nothing pinned by a refused call");
    // SAFETY: a writable size_t.
    assert_eq!(unsafe { gpupool_sleep_prepare(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED, &mut pinned) }, GPUPOOL_SUCCESS);
    assert!(pinned >= 3 << 20 && pinned == sleep_kept(), "{pinned}");
    // SAFETY: NULL is allowed.
    assert_eq!(unsafe { gpupool_sleep_prepare(0, pool, GPUPOOL_SLEEP_DISCARD, std::ptr::null_mut()) }, GPUPOOL_SUCCESS);
    assert_eq!(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED), GPUPOOL_SUCCESS);
    assert_eq!(sleep_kept(), 0, "the prepared copy is in use");
    // SAFETY: a writable size_t.
    assert_eq!(
        unsafe { gpupool_sleep_prepare(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED, &mut pinned) },
        GPUPOOL_ERROR_INVALID_VALUE
    );
    assert!(last_error().contains("sleep"), "{}", last_error());
    assert_eq!(gpupool_wake(0, pool), GPUPOOL_SUCCESS);
    assert_eq!(sleep_kept(), pinned);

    for (device, peer, says) in [(0, 0, "its own peer"), (3, 0, "device 3"), (0, -1, "peer -1"), (-1, 1, "device -1")] {
        assert_eq!(gpupool_enable_peer_access(device, peer), GPUPOOL_ERROR_INVALID_VALUE, "{device} {peer}");
        let m = last_error();
        assert!(m.starts_with("gpupool_enable_peer_access") && m.contains(says), "{m}");
    }
    assert_eq!(gpupool_enable_peer_access(2, 0), GPUPOOL_SUCCESS);
    assert_eq!(gpupool_enable_peer_access(2, 0), GPUPOOL_SUCCESS, "a second call does nothing");
    assert_eq!(gpupool_enable_peer_access(0, 2), GPUPOOL_SUCCESS, "the other way");
    // SAFETY: a live block from gpupool_malloc, freed once.
    assert_eq!(unsafe { gpupool_free(p) }, GPUPOOL_SUCCESS);
}
