//! Stream destruction, interposed: the runtime's `cudaStreamDestroy`, the driver's
//! `cuStreamDestroy_v2` (what `cuStreamDestroy` means from CUDA 4.0 on: `cuda.h`'s `#define`,
//! and `cuGetProcAddress("cuStreamDestroy")` at a version from 4000) and the driver's CUDA 2.0
//! `cuStreamDestroy`, which it still exports. Every lookup the shim answers hands them out as
//! it does the allocation functions: `dlsym` in the driver's or the runtime's handle
//! (`dlsym.rs`), `cuGetProcAddress` and `cudaGetDriverEntryPoint` (`driver_api::ours`). None
//! has a per-thread stream variant: the stream destroyed is always named.
//!
//! Why: gpupool keys a stream's cached blocks by its handle, as PyTorch's `BlockPool` is keyed
//! by `cudaStream_t`, and CUDA gives a destroyed stream's handle to the next stream created at
//! once, while the old stream's work may still run (`docs/rules.md`, "A stream destroyed and
//! another created"). A block the program freed on the old stream (`cudaFreeAsync`,
//! `cuMemFreeAsync`, which the shim serves) would be handed to the new stream while the old
//! one's kernels still read it. So before the real destroy, once gpupool has started, the shim
//! calls [`Allocator::retire_stream`] (`gpupool_stream_retire`) for the stream's device (the
//! driver's `stream_device`: `cuStreamGetCtx`): it waits for the stream
//! (`cuStreamSynchronize`) only when gpupool holds a block or segment of it, so a stream
//! gpupool never served costs a lookup, no wait. PyTorch has nothing to follow here: its
//! streams come from its pool and are never destroyed.
//!
//! The destroy's status is the real function's, unchanged. A retire that fails (the driver's
//! error, a stream that captures a graph, a panic caught) is counted for the exit report and
//! the stream is destroyed all the same, as it would be without the shim. Before gpupool has
//! started nothing of the stream can be in it: the call goes straight through and starts
//! nothing; so do CUDA's default streams (handles 0, 1 and 2, never destroyed: CUDA answers).
//!
//! A real runtime that found the driver through the shim's `dlsym` and `cuGetProcAddress`
//! calls the shim's `cuStreamDestroy_v2` from inside its `cudaStreamDestroy`: a flag of the
//! calling thread lets that inner call through without a second retire.

use std::cell::Cell;
use std::ffi::{c_int, c_void};

use gpupool::Allocator;

use crate::lookups::{STREAM_RETIRE_FAILURES as FAILED, STREAM_RETIRES as RETIRES, STREAM_WAITS as WAITS};
use crate::real::{call_real, real};
use crate::shim::{UNKNOWN, bump, guard};

type DestroyFn = unsafe extern "C" fn(*mut c_void) -> c_int;

thread_local! {
    /// Set while the calling thread is inside a destroy the shim retired: the runtime's
    /// `cudaStreamDestroy` calling the driver's, which then goes straight through.
    static DESTROYING: Cell<bool> = const { Cell::new(false) };
}

/// Clears [`DESTROYING`] when dropped, on an unwind (the thread's exit) out of the real
/// destroy too.
struct Destroying;

impl Drop for Destroying {
    fn drop(&mut self) {
        DESTROYING.set(false);
    }
}

/// Waits for `stream` when gpupool holds anything of it, on the device the driver says the
/// stream belongs to: `Some(waited)`, or `None` when the retire failed.
fn retire(alloc: &Allocator, stream: usize) -> Option<bool> {
    let device = alloc.driver().stream_device(stream).ok()?;
    alloc.retire_stream(device, stream).ok()
}

/// A destroy of `stream`: retired first with `alloc` (gpupool's allocator, if started), then
/// `real`, whose status is returned unchanged.
fn destroy(alloc: Option<&Allocator>, stream: usize, real: impl FnOnce() -> c_int) -> c_int {
    if stream > 2
        && !DESTROYING.get()
        && let Some(alloc) = alloc
    {
        bump(&RETIRES);
        match guard(None, || retire(alloc, stream)) {
            Some(true) => bump(&WAITS),
            Some(false) => {}
            None => bump(&FAILED),
        }
    }
    DESTROYING.set(true);
    let _clear = Destroying;
    real()
}

/// gpupool's allocator when the shim has started it; never starts it.
fn started() -> Option<&'static Allocator> {
    crate::shim::SHIM.get().and_then(Option::as_ref).map(|s| s.alloc)
}

/// `cudaError_t cudaStreamDestroy(cudaStream_t stream)`: once gpupool has started, gpupool
/// waits for `stream` if it holds anything of it (`Allocator::retire_stream`); then the real
/// function, whose status is returned unchanged (`cudaErrorUnknown` without a runtime).
///
/// # Safety
/// As CUDA's `cudaStreamDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cudaStreamDestroy(stream: *mut c_void) -> c_int {
    guard(UNKNOWN, || {
        destroy(started(), stream as usize, || {
            // SAFETY: the real function, with the caller's argument.
            real!(c"cudaStreamDestroy", DestroyFn).map_or(UNKNOWN, |f| unsafe { f(stream) })
        })
    })
}

/// `CUresult cuStreamDestroy_v2(CUstream hStream)`: as [`cudaStreamDestroy`], then the real
/// function (`CUDA_ERROR_NOT_INITIALIZED` without `libcuda.so`, as `driver_api.rs`'s).
///
/// # Safety
/// As CUDA's `cuStreamDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuStreamDestroy_v2(stream: *mut c_void) -> c_int {
    guard(UNKNOWN, || destroy(started(), stream as usize, || call_real!(b"cuStreamDestroy_v2", DestroyFn, stream)))
}

/// `CUresult cuStreamDestroy(CUstream hStream)`, the CUDA 2.0 function the driver still
/// exports (what a program gets that names it without `cuda.h`, or asks `cuGetProcAddress`
/// for at a version before 4000): as [`cuStreamDestroy_v2`].
///
/// # Safety
/// As CUDA's `cuStreamDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cuStreamDestroy(stream: *mut c_void) -> c_int {
    guard(UNKNOWN, || destroy(started(), stream as usize, || call_real!(b"cuStreamDestroy", DestroyFn, stream)))
}

/// The shim's function for a driver symbol as `cuGetProcAddress` names it at `cuda_version`
/// (`driver_api::ours`), if it is a stream destroy: the same whether or not the lookup asked
/// for the per-thread stream's variants, which this function does not have.
pub(crate) fn ours(symbol: &[u8], cuda_version: c_int) -> Option<*mut c_void> {
    match symbol {
        b"cuStreamDestroy" if cuda_version >= 4000 => Some(cuStreamDestroy_v2 as *mut c_void),
        b"cuStreamDestroy" => Some(cuStreamDestroy as *mut c_void),
        _ => None,
    }
}

/// The shim's function for a driver symbol by its exported name (`driver_api::served_by_name`,
/// for `dlsym`), if it is a stream destroy.
#[cfg_attr(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")), allow(dead_code))]
pub(crate) fn driver_by_name(name: &[u8]) -> Option<*mut c_void> {
    match name {
        b"cuStreamDestroy_v2" => Some(cuStreamDestroy_v2 as *mut c_void),
        b"cuStreamDestroy" => Some(cuStreamDestroy as *mut c_void),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use gpupool::config::{Config, DriverKind};
    use gpupool::driver::DriverError;
    use gpupool::driver::sim::{SimDriver, SimOp};

    use super::*;

    /// The only test that reads the global counters (the others run beside it).
    #[test]
    fn a_destroy_is_retired_first_when_gpupool_holds_the_stream() {
        let sim = Arc::new(SimDriver::new(1, 64 << 20));
        let alloc = Allocator::new(sim.clone(), Config { driver: DriverKind::Sim, ..Config::default() });
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let syncs = || sim.counts().stream_synchronize;
        let (r0, w0, f0) = (n(&RETIRES), n(&WAITS), n(&FAILED));
        // A block freed on 0x10: the destroy waits for the stream, then the real status (7).
        let p = alloc.malloc(1 << 20, 0, 0x10).unwrap();
        alloc.free(p).unwrap();
        assert_eq!(destroy(Some(&alloc), 0x10, || 7), 7);
        assert_eq!((syncs(), n(&RETIRES) - r0, n(&WAITS) - w0), (1, 1, 1));
        // A stream gpupool never served: retired, no wait.
        assert_eq!(destroy(Some(&alloc), 0x20, || 0), 0);
        assert_eq!((syncs(), n(&RETIRES) - r0, n(&WAITS) - w0), (1, 2, 1));
        // Default streams, gpupool not started, the runtime's inner driver call: untouched.
        let p = alloc.malloc(1 << 20, 0, 0x30).unwrap();
        alloc.free(p).unwrap();
        for s in [0, 1, 2] {
            assert_eq!(destroy(Some(&alloc), s, || 400), 400);
        }
        assert_eq!(destroy(None, 0x30, || 3), 3);
        let inner = destroy(Some(&alloc), 0x30, || destroy(Some(&alloc), 0x30, || 0) + 1);
        assert_eq!((inner, syncs(), n(&RETIRES) - r0, n(&WAITS) - w0), (1, 2, 3, 2));
        assert!(!DESTROYING.get());
        // A retire that fails, by the driver's error or a panic, never fails the destroy.
        let p = alloc.malloc(1 << 20, 0, 0x40).unwrap();
        alloc.free(p).unwrap();
        sim.inject_fault(
            SimOp::StreamSynchronize,
            0,
            DriverError::Cuda { call: "cuStreamSynchronize", code: 700, name: "CUDA_ERROR_ILLEGAL_ADDRESS".into() },
        );
        assert_eq!(destroy(Some(&alloc), 0x40, || 0), 0);
        sim.inject_panic(SimOp::StreamDevice, 0);
        assert_eq!(destroy(Some(&alloc), 0x40, || 0), 0);
        assert_eq!((n(&RETIRES) - r0, n(&WAITS) - w0, n(&FAILED) - f0), (5, 2, 2));
        let line = crate::lookups::streams_report();
        assert!(line.starts_with("retired ") && line.len() < 100, "{line}");
    }
}
