//! Control of the simulated device (`GPUPOOL_DRIVER=sim`), for tests written in C.
//! `include/gpupool_testing.h` is generated from this file alone (cbindgen-testing.toml).

use std::ffi::{c_int, c_void};

use super::status::{boundary, gpupool_status};
use super::{Runtime, gpupool_stream_t, runtime};
use crate::driver::sim::SimDriver;
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
pub extern "C" fn gpupool_sim_hold_stream(stream: gpupool_stream_t) -> gpupool_status {
    boundary("gpupool_sim_hold_stream", || {
        sim()?.1.hold_stream(stream as usize);
        Ok(())
    })
}

/// Simulated device only: completes all work queued on `stream` and stops holding it.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when the simulated device is not in use.
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn gpupool_sim_release_stream(stream: gpupool_stream_t) -> gpupool_status {
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
pub extern "C" fn gpupool_sim_set_device(device: c_int) -> gpupool_status {
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
pub unsafe extern "C" fn gpupool_sim_host_pinned(ptr: *const c_void, len: usize, pinned: *mut c_int) -> gpupool_status {
    boundary("gpupool_sim_host_pinned", || {
        let out = super::status::out_ptr(pinned, "pinned")?;
        let is = sim()?.1.is_pinned(ptr as usize, len);
        // SAFETY: the caller passes storage for one `int`.
        unsafe { out.write(c_int::from(is)) };
        Ok(())
    })
}
