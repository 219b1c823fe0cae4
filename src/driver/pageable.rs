//! Ordinary (pageable) host memory of gpupool's own: anonymous private mappings (`mmap`),
//! given back to the operating system when unmapped (`munmap`), not kept in a heap. What a
//! sleeping pool's host copy is made of (`caching::sleep::copy`): it leaves no pinned memory behind
//! and, unmapped at wake, truly returns to the system (vLLM#16663 is the complaint about a
//! host copy that stayed). The default `host_map` and `host_unmap` of
//! [`HostMemoryOps`](super::ops::HostMemoryOps) are these; the simulated driver's call them
//! after counting the call and injecting faults.

use super::{DriverError, HostPtr};
use crate::os::mapping;

/// Maps `size` bytes (more than 0) of zeroed, readable and writable anonymous memory, which the
/// kernel backs on first touch (no `MAP_POPULATE`: the threads that first write it fault
/// its pages in parallel). `huge_pages`: asks for transparent huge pages (`MADV_HUGEPAGE`),
/// one fault per 2 MiB instead of per 4 KiB; ignored where the kernel has none. Thread-safe.
///
/// Errors: [`DriverError::OutOfMemory`] when the kernel refuses the mapping (no address space,
/// or overcommit refused it); never panics.
pub fn map(size: usize, huge_pages: bool) -> Result<HostPtr, DriverError> {
    if size == 0 {
        return Err(DriverError::OutOfMemory);
    }
    let p = mapping::anonymous(size, libc::PROT_READ | libc::PROT_WRITE, false).ok_or(DriverError::OutOfMemory)?;
    if huge_pages {
        // SAFETY: advice on the mapping just made; a kernel without THP returns EINVAL, which
        // changes nothing.
        unsafe { libc::madvise(p as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
    }
    Ok(p as HostPtr)
}

/// Unmaps `size` bytes at `ptr`, a mapping from [`map`] of that size, giving its pages back to
/// the system. The caller has made sure nothing reads or writes it any more. Thread-safe.
///
/// Errors: [`DriverError::Cuda`] naming `munmap` with its `errno` when the kernel refuses (a
/// range that was never mapped); never panics.
pub fn unmap(ptr: HostPtr, size: usize) -> Result<(), DriverError> {
    // SAFETY: per this function's contract, a mapping of ours that nothing uses any more.
    unsafe { mapping::unmap(ptr, size) }.map_err(|e| DriverError::Cuda {
        call: "munmap",
        code: e.raw_os_error().unwrap_or(0),
        name: "errno".into(),
    })
}
