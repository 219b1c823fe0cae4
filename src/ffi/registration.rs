//! Registration for transports: the whole mapped range of the segment under a pointer
//! gpupool handed out, and a dma-buf descriptor of it, so that an RDMA or NVLink transport
//! registers each mapping once and never a tensor (`caching::registration`,
//! docs/transports.md).

use std::ffi::{c_int, c_void};
use std::os::fd::IntoRawFd;

use super::status::{boundary, gpupool_status, out_ptr};
use super::{gpupool_stream_t, runtime};

/// The mapped range of a segment that a transport registers (`gpupool_segment_mapped_range`).
/// Plain data, written by gpupool, owned by the caller.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct gpupool_mapped_range_t {
    /// The range's first byte: the segment's start (an ordinary segment), or the first byte of
    /// the run of pages mapped side by side around the pointer (an expandable segment).
    pub address: *mut c_void,
    /// Its length in bytes: the whole segment, or whole pages (2 MiB each, or 20 MiB with
    /// `GPUPOOL_EXPANDABLE_LARGE_PAGES`). A multiple of the host page size.
    pub bytes: usize,
    /// The segment's start: for an ordinary segment, `address` again.
    pub segment_address: *mut c_void,
    /// The segment's size in bytes: an expandable segment's whole reserved address range,
    /// mapped or not; for an ordinary segment, `bytes` again.
    pub segment_bytes: usize,
    /// The device ordinal.
    pub device: c_int,
    /// 1 for an expandable segment, whose range grows and shrinks (`GPUPOOL_SEGMENT_MAP`,
    /// `GPUPOOL_SEGMENT_UNMAP`); 0 for an ordinary segment, fixed until `GPUPOOL_SEGMENT_FREE`.
    pub expandable: c_int,
    /// The stream whose pools own the segment, as the segment observers' events name it.
    pub stream: gpupool_stream_t,
    /// The private pool of the segment (`gpupool_pool_create`); 0 for the default pools.
    pub pool: u64,
}

/// Gives a transport what it registers for the memory at `ptr`: the whole mapped range around
/// it (`*range`) and, when `dmabuf_fd` is not NULL, a dma-buf file descriptor of exactly that
/// range (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`), the
/// descriptor `ibv_reg_dmabuf_mr(pd, 0, range->bytes, range->address, fd, access)` registers.
/// docs/transports.md says what NIXL, UCX, ibverbs, NCCL and Mooncake call with it.
///
/// - `ptr`: any byte of a live allocation of gpupool's (`gpupool_malloc`, a private pool's, a
///   plug-in's), interior pointers included.
/// - The range: an ordinary segment (`cuMemAlloc`) whole; in an expandable segment, the run of
///   pages mapped side by side around `ptr`'s page, however many physical allocations it spans:
///   CUDA lets one dma-buf span several, all of one device with identical properties, as
///   gpupool's pages are. A page unmapped in the middle of a segment (its cache released
///   between live blocks) cuts it into runs: ask once per run, with a pointer into each; CUDA
///   refuses a range that is not wholly mapped. PyTorch has no such call: its transports ask
///   `cuMemGetAddressRange`, which answers one physical allocation of an expandable segment,
///   and a registration past it fails (Mooncake #2511).
/// - The descriptor: the caller owns it and closes it (`close`) when done; its size
///   (`lseek(fd, 0, SEEK_END)`) is `range->bytes`, and offset 0 in it is `range->address`.
///   It names the physical memory mapped when it was made: when a segment observer tells
///   `GPUPOOL_SEGMENT_UNMAP` over the range (before the pages go) or `GPUPOOL_SEGMENT_FREE`,
///   deregister what was registered with it; after `GPUPOOL_SEGMENT_MAP` next to or inside a
///   range, ask again (the run grew) rather than register the new pages apart. CUDA asks for
///   a new descriptor whenever the physical memory of a range changes. It needs
///   `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (the NVIDIA open kernel modules, Linux 5.12 and
///   later); gpupool makes its expandable segments' pages GPUDirect RDMA capable where the
///   device allows it (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`), as NCCL's
///   `ncclCuMemAlloc` does.
///
/// Not from inside a segment observer: the stream's lock may be held by the call that told
/// it. Note the event's range there and ask once the observer has returned.
///
/// Errors, each with `gpupool_last_error_message` naming the problem, nothing written and no
/// descriptor left open: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `range`; called from inside a
/// segment observer; `ptr` in a pool that sleeps, whose memory is unmapped until
/// `gpupool_wake`); `GPUPOOL_ERROR_INVALID_POINTER` (`ptr` NULL or in no segment of gpupool's,
/// or in a block that is not allocated: freed, cached, or unmapped address space);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` (no driver, or one that cannot export dma-bufs:
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` is 0, or `libcuda.so.1` lacks the call);
/// `GPUPOOL_ERROR_CUDA`, `GPUPOOL_ERROR_OUT_OF_MEMORY` (the driver refused the descriptor).
///
/// Thread-safe: call from any thread while others allocate and free. It locks the stream's
/// pools for the lookup (and the driver's call, with `dmabuf_fd`), as a `gpupool_malloc` on
/// that stream does; it is not on the hit path and costs nothing there.
///
/// # Safety
/// `range` must be NULL or writable for one `gpupool_mapped_range_t`; `dmabuf_fd` NULL or
/// writable for one `int`. `ptr` is only compared with gpupool's addresses.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_segment_mapped_range(
    ptr: *const c_void,
    range: *mut gpupool_mapped_range_t,
    dmabuf_fd: *mut c_int,
) -> gpupool_status {
    boundary("gpupool_segment_mapped_range", || {
        let out = out_ptr(range, "range")?;
        let allocator = &runtime()?.allocator;
        let (run, fd) = if dmabuf_fd.is_null() {
            (allocator.mapped_range(ptr as u64)?, None)
        } else {
            let (run, fd) = allocator.mapped_range_dmabuf(ptr as u64)?;
            (run, Some(fd))
        };
        let value = gpupool_mapped_range_t {
            address: run.base as *mut c_void,
            bytes: run.bytes,
            segment_address: run.segment_base as *mut c_void,
            segment_bytes: run.segment_bytes,
            device: run.device,
            expandable: run.expandable as c_int,
            stream: run.stream as gpupool_stream_t,
            pool: run.pool,
        };
        // SAFETY: `range` is non-NULL and writable per this function's contract; `dmabuf_fd`
        // was found non-NULL above and is writable per the same.
        unsafe {
            out.write(value);
            if let Some(fd) = fd {
                dmabuf_fd.write(fd.into_raw_fd());
            }
        }
        Ok(())
    })
}
