//! Device memory shared between processes: a block exported by its owner, imported by another
//! process on the same GPU, closed there; PyTorch's `torch.multiprocessing` sharing of CUDA
//! tensors for C and C++ engines (a scheduler handing tensors to a worker, prefill and decode
//! processes passing KV-cache blocks). `include/gpupool_ipc.h` is generated from this file
//! alone (cbindgen-ipc.toml). docs/ipc.md has the protocol, its limits and its tests.

use std::ffi::{c_int, c_void};

use super::runtime;
use super::status::{boundary, gpupool_status, out_ptr};
use crate::error::Error;

/// Bytes of a `gpupool_ipc_handle_t`.
pub const GPUPOOL_IPC_HANDLE_SIZE: usize = 160;
const _: () = assert!(GPUPOOL_IPC_HANDLE_SIZE == crate::IPC_HANDLE_SIZE);

/// A handle to an exported block: plain bytes of a fixed size, to send to another process as
/// they are (a pipe, a socket, shared memory, a file); the same bytes for every export of one
/// block until its owner frees it. It names the owner process (pid and start time), the
/// device (by UUID), the export and the block's size; it carries no secret (any process of
/// the same user that may ptrace the owner can import it).
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct gpupool_ipc_handle_t {
    /// The handle's bytes, opaque: sent as they are, never read by the program.
    pub bytes: [u8; GPUPOOL_IPC_HANDLE_SIZE],
}

/// Exports the block at `ptr` (the start of a block from `gpupool_malloc`, live) to other
/// processes and writes its handle to `*handle`. Exporting the same block again writes the
/// same bytes.
///
/// Blocks of expandable segments (gpupool's default) are shared page by page: each 2 MiB (or
/// 20 MiB) page the block touches is exported as a POSIX file descriptor
/// (`cuMemExportToShareableHandle`), so the importer maps only those pages (neighbouring
/// blocks on the same pages are visible to it). Blocks of ordinary segments
/// (`expandable_segments:False`) are shared through the segment's `cuIpcGetMemHandle` and the
/// block's offset in it (the importer maps the whole segment). PyTorch does the same for
/// `torch.multiprocessing` (`CudaIPCSentData`), sharing whole expandable segments.
///
/// From now on the block's `gpupool_free` does not reuse it while another process holds an
/// import: it stays allocated (counted in `allocated_bytes`, as PyTorch's limbo does) until
/// every importer has called `gpupool_ipc_close` or exited (killed included); the next
/// `gpupool_ipc_*` call, `gpupool_empty_cache`, `gpupool_ipc_reclaim` or out-of-memory retry
/// on its device then frees it. A
/// block freed while no process holds it is freed at once, and a later import of its handle
/// fails. So free a block only once the other process imported it (or knows not to).
///
/// Errors, each changing nothing: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `handle`; a pool that
/// sleeps; a pool whose segments come from the program's allocator);
/// `GPUPOOL_ERROR_INVALID_POINTER` (not the start of a live block from gpupool);
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` (a driver without the sharing calls, or one that
/// refused file-descriptor handles in `cuMemCreate`: the message says which);
/// `GPUPOOL_ERROR_CUDA`, `GPUPOOL_ERROR_OUT_OF_MEMORY` (the driver or the system could not
/// make the descriptors or the shared record: too many open files, for one).
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only compared with gpupool's blocks; `handle` must be NULL or point to writable
/// storage for one `gpupool_ipc_handle_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_ipc_export(
    ptr: *const c_void,
    handle: *mut gpupool_ipc_handle_t,
) -> gpupool_status {
    boundary("gpupool_ipc_export", || {
        let out = out_ptr(handle, "handle")?;
        let bytes = runtime()?.allocator.ipc_export(ptr as u64)?;
        // SAFETY: the caller passes storage for one handle.
        unsafe { out.write(gpupool_ipc_handle_t { bytes }) };
        Ok(())
    })
}

/// Maps the block of another process's `gpupool_ipc_export` into this process, on `device`
/// (-1: the calling thread's current device; the device the handle names, whatever its
/// ordinal here), and writes its address to `*ptr`: the same bytes as the owner's block,
/// `size` bytes from it valid here. Kernels and copies in this process may use it at once;
/// ordering with the owner's work is the program's (events, or a message after a
/// synchronisation). End it with `gpupool_ipc_close`; `gpupool_free` refuses it. Importing a
/// handle twice maps it twice (two pointers for pages; one pointer, counted twice, for an
/// ordinary segment), each closed once.
///
/// The owner's descriptors are taken with `pidfd_open` + `pidfd_getfd` (Linux 5.6 or later):
/// this process needs ptrace permission over the owner (the same user; Yama's
/// `/proc/sys/kernel/yama/ptrace_scope` at 0, or 1 with the owner a descendant of this
/// process; no seccomp filter refusing `pidfd_getfd`, as Docker's default one does without
/// `CAP_SYS_PTRACE`). Address space grows by the block's pages, nothing more.
///
/// Errors, each changing nothing: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `handle` or `ptr`; a
/// handle whose magic, version or checksum is wrong; one for another device, naming both
/// UUIDs; one whose owner process has exited; one whose block the owner freed; this process's
/// own export; a device out of range); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` (the owner's
/// descriptors cannot be taken, the message says why; a driver without the sharing calls);
/// `GPUPOOL_ERROR_OUT_OF_MEMORY`, `GPUPOOL_ERROR_CUDA` (the driver's).
///
/// Thread-safe.
///
/// # Safety
/// `handle` must be NULL or point to one readable `gpupool_ipc_handle_t` (any bytes); `ptr`
/// NULL or writable storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_ipc_import(
    handle: *const gpupool_ipc_handle_t,
    device: c_int,
    ptr: *mut *mut c_void,
) -> gpupool_status {
    boundary("gpupool_ipc_import", || {
        let out = out_ptr(ptr, "ptr")?;
        if handle.is_null() {
            return Err(Error::InvalidValue("handle is NULL; it must point to a gpupool_ipc_handle_t".into()));
        }
        // SAFETY: the caller passes one readable handle; read unaligned as plain bytes.
        let h = unsafe { handle.read_unaligned() };
        let p = runtime()?.allocator.ipc_import(&h.bytes, device)?;
        // SAFETY: the caller passes storage for one pointer.
        unsafe { out.write(p as *mut c_void) };
        Ok(())
    })
}

/// Ends an import: unmaps it from this process and drops its use at the owner, which may
/// reuse the block once no other process holds it. `ptr` is the pointer `gpupool_ipc_import`
/// wrote. The program must have finished its work on the memory (synchronise first).
///
/// Errors: `GPUPOOL_ERROR_INVALID_POINTER` (not an open import: never imported, or closed
/// already), changing nothing; `GPUPOOL_ERROR_CUDA` when the driver refuses to unmap: the
/// import stays open with the steps done so far, and a second call finishes it.
///
/// Thread-safe.
///
/// # Safety
/// `ptr` is only looked up, never dereferenced: any value is safe.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_ipc_close(ptr: *mut c_void) -> gpupool_status {
    boundary("gpupool_ipc_close", || runtime()?.allocator.ipc_close(ptr as u64))
}

/// Frees the exported blocks that were freed while imported (in limbo) and that no running
/// process holds any more: their importers closed them, exited or were killed. Writes how
/// many to `*reclaimed` when it is not NULL. Every other `gpupool_ipc_*` call and
/// `gpupool_empty_cache` do the same, and a request that finds its device out of memory
/// reclaims that device's first; call it to see the memory back in the statistics sooner.
/// It (and `gpupool_empty_cache`) also gives back, in every export of this process, live ones
/// included, the importer slots of processes that died holding an import, so that they serve
/// new importers (an import that finds all 64 slots taken clears those itself).
///
/// Errors: `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
///
/// # Safety
/// `reclaimed` must be NULL or point to writable storage for one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_ipc_reclaim(reclaimed: *mut usize) -> gpupool_status {
    boundary("gpupool_ipc_reclaim", || {
        let n = runtime()?.allocator.ipc_reclaim();
        if !reclaimed.is_null() {
            // SAFETY: the caller passes NULL or storage for one size_t.
            unsafe { reclaimed.write(n) };
        }
        Ok(())
    })
}
