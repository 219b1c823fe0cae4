//! The out-of-memory error's message: PyTorch's text (`CUDACachingAllocator.cpp`, the
//! `OutOfMemoryError` raised at the end of `malloc`), with the device's figures.

use super::shard::Request;
use crate::driver::Driver;
use crate::error::Error;
use crate::stats::DeviceStats;
use crate::stats::summary::format_size;

/// The error for `req` on `device`, with its statistics `s` and its byte limit (`None` when
/// no memory fraction is set). Asks the driver for the free memory (`cuMemGetInfo`); says so
/// when it cannot.
pub(crate) fn message(device: i32, driver: &dyn Driver, req: &Request, s: &DeviceStats, limit: Option<i64>) -> Error {
    let (allocated, reserved) = (s.allocated_bytes.all.current as u64, s.reserved_bytes.all.current as u64);
    let capacity = match driver.mem_info(device) {
        Ok(info) => format!(
            "GPU {device} has a total capacity of {} of which {} is free",
            format_size(info.total as u64),
            format_size(info.free as u64)
        ),
        Err(e) => format!("GPU {device}'s free memory could not be read ({e})"),
    };
    let fraction = match limit {
        None => String::new(),
        Some(l) => format!(" The memory fraction set for this device allows gpupool {} in all.", format_size(l as u64)),
    };
    Error::OutOfMemory(format!(
        "CUDA out of memory. Tried to allocate {} (for a request of {} bytes). {capacity}. \
         Of the allocated memory {} is allocated by gpupool, and {} is reserved by gpupool but unallocated.{fraction} \
         If reserved but unallocated memory is large, the cache is fragmented: see the memory summary.",
        format_size(req.segment as u64),
        req.size,
        format_size(allocated),
        format_size(reserved - allocated),
    ))
}
