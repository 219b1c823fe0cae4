//! Counts of the lookups of driver functions, for the exit report (`GPUPOOL_PRELOAD_STATS`):
//! `dlsym` in libcuda's handle (`dlsym.rs`), `cuGetProcAddress` and
//! `cudaGetDriverEntryPoint` (all variants); the `cuMemCreate` calls passed through
//! (`vmm.rs`); and the stream destroys retired (`streams.rs`). Statics, not fields of the
//! shim: `dlsym` must never start gpupool (which itself looks symbols up). Its own module,
//! imported by the others and importing none, so that no two modules import each other.

use std::sync::atomic::{AtomicU64, Ordering};

/// Lookups the shim answered with its own function (runtime functions found by `dlsym` in
/// the runtime's handle included). Relaxed counter, any thread.
pub(crate) static SERVED: AtomicU64 = AtomicU64::new(0);
/// Driver lookups the shim passed through unchanged (a symbol it does not serve, one the
/// driver does not have, or a lookup that failed). Relaxed counter, any thread.
pub(crate) static PASSED: AtomicU64 = AtomicU64::new(0);

/// `cuMemCreate` calls passed through to the driver (`vmm.rs`): physical memory a program maps
/// itself (ggml's VMM pool), outside gpupool. Relaxed counter, any thread.
pub(crate) static VMM_CREATES: AtomicU64 = AtomicU64::new(0);
/// Bytes of the `cuMemCreate` calls that succeeded. Relaxed counter, any thread.
pub(crate) static VMM_BYTES: AtomicU64 = AtomicU64::new(0);

/// Stream destroys the shim retired first (`streams.rs`: gpupool started, not a default
/// stream). Here, not in `streams.rs`, because `shim.rs` reports them and `streams.rs` imports
/// `shim.rs`. Relaxed counter, any thread.
pub(crate) static STREAM_RETIRES: AtomicU64 = AtomicU64::new(0);
/// Retires that waited for the stream: gpupool held a block or segment of it.
pub(crate) static STREAM_WAITS: AtomicU64 = AtomicU64::new(0);
/// Retires that failed (the stream's device unknown, the driver's error, a graph capture, a
/// panic caught): the stream was destroyed without the wait.
pub(crate) static STREAM_RETIRE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// The exit report's line for the stream destroys, under 100 characters.
pub(crate) fn streams_report() -> String {
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (r, w, f) = (n(&STREAM_RETIRES), n(&STREAM_WAITS), n(&STREAM_RETIRE_FAILURES));
    format!("retired {r} streams before their destroy: waited for {w}, {f} failed")
}
