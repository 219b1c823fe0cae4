//! Control of the simulated device (`GPUPOOL_DRIVER=sim`), for tests written in C.
//! `include/gpupool_testing.h` is generated from this file alone (cbindgen-testing.toml).

use std::ffi::{CStr, c_char, c_int, c_void};

use super::status::{boundary, gpupool_status, out_ptr};
use super::{Runtime, gpupool_stream_t, runtime};
use crate::driver::CaptureMode;
use crate::driver::DriverError;
use crate::driver::sim::{SimDriver, SimFault, SimOp};
use crate::error::Error;

fn sim() -> Result<(&'static Runtime, &'static SimDriver), Error> {
    let rt = runtime()?;
    let sim = rt
        .sim
        .as_deref()
        .ok_or_else(|| Error::InvalidValue("the simulated device is not in use (set GPUPOOL_DRIVER=sim)".into()))?;
    Ok((rt, sim))
}

/// Simulated device only: from now on, work queued on `stream` does not complete, so events
/// that gpupool records there stay pending (as behind a long kernel) until
/// `gpupool_sim_release_stream`.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use.
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_sim_hold_stream(stream: gpupool_stream_t) -> gpupool_status {
    boundary("gpupool_sim_hold_stream", || {
        sim()?.1.hold_stream(stream as usize);
        Ok(())
    })
}

/// Simulated device only: how many times gpupool waited for work held on `stream`
/// (`cuEventSynchronize` of an event recorded there, as the high-water rule of expandable
/// segments and the out-of-memory path do); the simulated device completes that work then, as
/// a real one would have run it meanwhile. Written to `*count`.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use or `count` is
/// NULL. Thread-safe.
///
/// # Safety
/// `count` must be NULL or point to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sim_stream_waits(stream: gpupool_stream_t, count: *mut u64) -> gpupool_status {
    boundary("gpupool_sim_stream_waits", || {
        let count = out_ptr(count, "count")?;
        let n = sim()?.1.stream_waits(stream as usize);
        // SAFETY: non-NULL, and the caller passes a writable u64.
        unsafe { count.write(n) };
        Ok(())
    })
}

/// Simulated device only: completes all work queued on `stream` and stops holding it.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use.
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_sim_release_stream(stream: gpupool_stream_t) -> gpupool_status {
    boundary("gpupool_sim_release_stream", || {
        sim()?.1.release_stream(stream as usize);
        Ok(())
    })
}

/// Simulated device only: sets the calling thread's current device, the one device -1 means
/// (the simulated `cudaSetDevice`).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use or `device`
/// is out of range. Affects the calling thread only.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_sim_set_device(device: c_int) -> gpupool_status {
    boundary("gpupool_sim_set_device", || {
        let (rt, _) = sim()?;
        let count = rt.allocator.device_count();
        if !(0..count).contains(&device) {
            return Err(Error::InvalidValue(format!("device {device} is out of range: {count} simulated device(s)")));
        }
        SimDriver::set_current_device(device);
        Ok(())
    })
}

/// Simulated device only: writes to `*pinned` 1 when the `len` bytes at `ptr` lie wholly in
/// pinned host memory of the simulated driver (from `gpupool_host_malloc`, its
/// `cuMemHostAlloc` or `cuMemHostRegister`), else 0: what a copy must read from to be
/// asynchronous on a GPU.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use or `pinned`
/// is NULL. Thread-safe.
///
/// # Safety
/// `pinned` must be NULL or point to a writable `int`; `ptr` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sim_host_pinned(
    ptr: *const c_void,
    len: usize,
    pinned: *mut c_int,
) -> gpupool_status {
    boundary("gpupool_sim_host_pinned", || {
        let out = super::status::out_ptr(pinned, "pinned")?;
        let is = sim()?.1.is_pinned(ptr as usize, len);
        // SAFETY: the caller passes storage for one `int`.
        unsafe { out.write(c_int::from(is)) };
        Ok(())
    })
}

/// Simulated device only: begins capturing `stream` into a CUDA graph on the calling thread
/// (the simulated `cudaStreamBeginCapture`), in `mode`: 0 global, 1 thread-local, 2 relaxed
/// (`cudaStreamCaptureMode`). Until `gpupool_sim_end_capture`, the calls CUDA forbids during
/// capture fail in the simulated driver as on the GPU and invalidate the capture (see
/// `SimDriver::begin_capture`).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use or `mode` is
/// not 0, 1 or 2; `GPUPOOL_ERROR_CUDA` when the stream captures already. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_sim_begin_capture(stream: gpupool_stream_t, mode: c_int) -> gpupool_status {
    boundary("gpupool_sim_begin_capture", || {
        let mode = match mode {
            0 => CaptureMode::Global,
            1 => CaptureMode::ThreadLocal,
            2 => CaptureMode::Relaxed,
            m => return Err(Error::InvalidValue(format!("capture mode {m} is not 0, 1 or 2"))),
        };
        sim()?.1.begin_capture(stream as usize, mode).map_err(|e| Error::driver(e, "beginning a capture"))?;
        Ok(())
    })
}

/// Simulated device only: ends the capture of `stream` (the simulated `cudaStreamEndCapture`)
/// and writes to `*valid` 1 when the capture is valid (a graph would be made), 0 when a
/// forbidden call invalidated it.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use or `valid` is
/// NULL; `GPUPOOL_ERROR_CUDA` when the stream is not capturing. Thread-safe.
///
/// # Safety
/// `valid` must be NULL or point to writable storage for one `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sim_end_capture(stream: gpupool_stream_t, valid: *mut c_int) -> gpupool_status {
    boundary("gpupool_sim_end_capture", || {
        let valid = super::status::out_ptr(valid, "valid")?;
        let ok = sim()?.1.end_capture(stream as usize).map_err(|e| Error::driver(e, "ending a capture"))?;
        // SAFETY: the caller passes storage for one int.
        unsafe { valid.write(c_int::from(ok)) };
        Ok(())
    })
}

/// Simulated device only: invalidates the capture of `stream`, as a call of the program's own
/// that CUDA forbids during capture would (a `cudaMalloc` in global mode, a kernel launch that
/// fails): `gpupool_sim_end_capture` then reports it failed.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use or `stream` is
/// not capturing. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_sim_invalidate_capture(stream: gpupool_stream_t) -> gpupool_status {
    boundary("gpupool_sim_invalidate_capture", || {
        if !sim()?.1.invalidate_capture(stream as usize) {
            return Err(Error::InvalidValue(format!("stream {:#x} is not capturing", stream as usize)));
        }
        Ok(())
    })
}

/// `gpupool_sim_inject_fault`'s fault: the call fails with `CUDA_ERROR_UNKNOWN` (999), as a
/// driver failure gpupool has no special path for.
pub const GPUPOOL_SIM_FAULT_ERROR: u32 = 0;
/// `gpupool_sim_inject_fault`'s fault: the call fails with `CUDA_ERROR_OUT_OF_MEMORY`, as a
/// device (or, for `cuMemHostAlloc` and `mmap`, a host) with no memory left.
pub const GPUPOOL_SIM_FAULT_OUT_OF_MEMORY: u32 = 1;
/// `gpupool_sim_inject_fault`'s fault: the call fails as a `libcuda.so.1` without the
/// function would be reported (an old driver).
pub const GPUPOOL_SIM_FAULT_MISSING_SYMBOL: u32 = 2;
/// `gpupool_sim_inject_fault`'s fault: the call panics, as cudarc does on its first call of a
/// function the installed driver lacks; gpupool's boundary turns it into
/// `GPUPOOL_ERROR_INTERNAL` with every pool as it was.
pub const GPUPOOL_SIM_FAULT_PANIC: u32 = 3;

/// Simulated device only: makes a later call of the driver function named `call` fail as
/// `fault` says (`GPUPOOL_SIM_FAULT_*`): the call after `skip` calls of that function that went
/// through (so `skip` 0 is the next one), counted from the first fault of that function still
/// waiting (faults of one function fire one after another, in the order injected). `call` is
/// the CUDA driver function's name as `libcuda.so.1` exports it (`cuMemMap`, `cuMemCreate`,
/// `cuMemAlloc_v2`, `cuEventRecord`, `cuMemcpyDtoHAsync_v2`, ...), or `mmap` / `munmap` for the
/// host memory of a sleeping pool's copy: every call gpupool makes of the driver can be
/// failed, so that tests in C reach every failure path. The faulted call changes nothing in
/// the simulated device before it fails.
///
/// Errors (nothing injected): `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in
/// use, `call` is NULL or names no driver function gpupool calls (the message lists them), or
/// `fault` is none of the four. Thread-safe.
///
/// # Safety
/// `call` must be NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sim_inject_fault(call: *const c_char, skip: u32, fault: u32) -> gpupool_status {
    boundary("gpupool_sim_inject_fault", || {
        if call.is_null() {
            return Err(Error::InvalidValue("call is NULL: name a driver function, such as \"cuMemMap\"".into()));
        }
        // SAFETY: non-NULL and NUL-terminated, per this function's contract.
        let name = unsafe { CStr::from_ptr(call) }.to_bytes();
        let Some(op) = SimOp::ALL.iter().copied().find(|op| op.symbol().as_bytes() == name) else {
            let known: Vec<&str> = SimOp::ALL.iter().map(|op| op.symbol()).collect();
            return Err(Error::InvalidValue(format!(
                "call \"{}\" is no driver function gpupool calls; one of: {}",
                String::from_utf8_lossy(name),
                known.join(", ")
            )));
        };
        let fault = match fault {
            GPUPOOL_SIM_FAULT_ERROR => {
                SimFault::Fail(DriverError::Cuda { call: op.symbol(), code: 999, name: "CUDA_ERROR_UNKNOWN".into() })
            }
            GPUPOOL_SIM_FAULT_OUT_OF_MEMORY => SimFault::Fail(DriverError::OutOfMemory),
            GPUPOOL_SIM_FAULT_MISSING_SYMBOL => SimFault::MissingSymbol,
            GPUPOOL_SIM_FAULT_PANIC => SimFault::Panic,
            f => {
                return Err(Error::InvalidValue(format!(
                    "fault {f} is none of GPUPOOL_SIM_FAULT_ERROR, _OUT_OF_MEMORY, _MISSING_SYMBOL and _PANIC (0 to 3)"
                )));
            }
        };
        sim()?.1.inject(op, skip, fault);
        Ok(())
    })
}

/// Simulated device only: drops every fault injected that has not fired yet, and writes how
/// many there were to `*pending` (when `pending` is not NULL): a test checks with it that each
/// fault it injected fired.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use. Thread-safe.
///
/// # Safety
/// `pending` must be NULL or point to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sim_clear_faults(pending: *mut usize) -> gpupool_status {
    boundary("gpupool_sim_clear_faults", || {
        let n = sim()?.1.clear_faults();
        if !pending.is_null() {
            // SAFETY: non-NULL, and the caller passes a writable size_t.
            unsafe { pending.write(n) };
        }
        Ok(())
    })
}
