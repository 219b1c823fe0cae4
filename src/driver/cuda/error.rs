//! CUDA's error codes as [`DriverError`]s: out of memory apart, every failure named by
//! `cuGetErrorName`.

use std::ffi::{CStr, c_char};

use cudarc::driver::sys;

use super::DriverError;

pub(super) fn check(call: &'static str, r: sys::CUresult) -> Result<(), DriverError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(DriverError::OutOfMemory);
    }
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let named = unsafe { sys::cuGetErrorName(r, &mut name) } == sys::CUresult::CUDA_SUCCESS && !name.is_null();
    let name = if named {
        // SAFETY: non-null and NUL-terminated, owned by the driver for the process's life.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        "an unknown CUDA error".to_string()
    };
    Err(DriverError::Cuda { call, code: r as i32, name })
}
