//! `gpupool_stream_retire` through the C API on the simulated device: the default streams and
//! a device out of range refused with `GPUPOOL_ERROR_INVALID_VALUE`, a capture with
//! `GPUPOOL_ERROR_STREAM_CAPTURE` (the capture still valid), a driver fault with
//! `GPUPOOL_ERROR_CUDA` and a driver panic with `GPUPOOL_ERROR_INTERNAL`, none unwinding out
//! of the export, none writing `waited`; device -1 is the current device; `waited` may be NULL.
//!
//! The process allocator reads `GPUPOOL_*` once: the test runs in a process of its own
//! (`common::process::alone_on_sim`).

use crate::common;

use std::ffi::c_void;

use common::last_error;
use common::process::alone_on_sim;
use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc, gpupool_stream_retire};
use gpupool::ffi::sim::{
    GPUPOOL_SIM_FAULT_ERROR, GPUPOOL_SIM_FAULT_PANIC, gpupool_sim_begin_capture, gpupool_sim_end_capture,
    gpupool_sim_inject_fault, gpupool_sim_set_device,
};
use gpupool::ffi::status::gpupool_status;

use gpupool_status::*;

fn retire(device: i32, stream: usize, waited: &mut i32) -> gpupool_status {
    // SAFETY: storage for one int.
    unsafe { gpupool_stream_retire(device, stream as gpupool_stream_t, waited) }
}

#[test]
fn retire_through_c() {
    if !alone_on_sim("1GiB") {
        return;
    }
    // SAFETY: as in `alone_on_sim`: before the process allocator starts.
    unsafe { std::env::set_var("GPUPOOL_SIM_DEVICES", "2") };
    let s = 0x50usize;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writable storage for one pointer; then the block it got.
    unsafe {
        assert_eq!(gpupool_malloc(&mut p, 1 << 20, 0, s as gpupool_stream_t), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
    }
    let mut waited = 7;
    for stream in [0, 1, 2] {
        assert_eq!(retire(0, stream, &mut waited), GPUPOOL_ERROR_INVALID_VALUE);
        let m = last_error();
        assert!(m.starts_with("gpupool_stream_retire") && m.contains("default streams"), "{m}");
    }
    assert_eq!(retire(9, s, &mut waited), GPUPOOL_ERROR_INVALID_VALUE);
    assert_eq!(gpupool_sim_begin_capture(s as gpupool_stream_t, 0), GPUPOOL_SUCCESS);
    assert_eq!(retire(0, s, &mut waited), GPUPOOL_ERROR_STREAM_CAPTURE);
    let mut valid = 0;
    // SAFETY: storage for one int.
    assert_eq!(unsafe { gpupool_sim_end_capture(s as gpupool_stream_t, &mut valid) }, GPUPOOL_SUCCESS);
    assert_eq!(valid, 1, "the refused retire left the capture valid");
    for (call, fault, status) in [
        (c"cuStreamGetCaptureInfo_v2", GPUPOOL_SIM_FAULT_ERROR, GPUPOOL_ERROR_CUDA),
        (c"cuStreamSynchronize", GPUPOOL_SIM_FAULT_ERROR, GPUPOOL_ERROR_CUDA),
        (c"cuStreamGetCaptureInfo_v2", GPUPOOL_SIM_FAULT_PANIC, GPUPOOL_ERROR_INTERNAL),
        (c"cuStreamSynchronize", GPUPOOL_SIM_FAULT_PANIC, GPUPOOL_ERROR_INTERNAL),
    ] {
        // SAFETY: a NUL-terminated name.
        assert_eq!(unsafe { gpupool_sim_inject_fault(call.as_ptr(), 0, fault) }, GPUPOOL_SUCCESS);
        assert_eq!(retire(0, s, &mut waited), status, "{call:?} {fault}");
        assert!(last_error().starts_with("gpupool_stream_retire"), "{}", last_error());
    }
    assert_eq!(waited, 7, "no refusal wrote waited");
    // SAFETY: NULL is allowed for waited.
    assert_eq!(unsafe { gpupool_stream_retire(0, s as gpupool_stream_t, std::ptr::null_mut()) }, GPUPOOL_SUCCESS);
    assert_eq!(retire(0, s, &mut waited), GPUPOOL_SUCCESS);
    assert_eq!(waited, 1);
    assert_eq!(retire(0, 0x51, &mut waited), GPUPOOL_SUCCESS);
    assert_eq!(waited, 0, "a stream never served");
    assert_eq!(gpupool_sim_set_device(1), GPUPOOL_SUCCESS);
    assert_eq!(retire(-1, s, &mut waited), GPUPOOL_SUCCESS);
    assert_eq!(waited, 0, "device 1 (current) holds nothing of the stream");
    assert_eq!(gpupool_sim_set_device(0), GPUPOOL_SUCCESS);
    assert_eq!(retire(-1, s, &mut waited), GPUPOOL_SUCCESS);
    assert_eq!(waited, 1);
}
