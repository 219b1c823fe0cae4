//! Counts of the lookups of driver functions, for the exit report (`GPUPOOL_PRELOAD_STATS`):
//! `dlsym` in libcuda's handle (`dlsym.rs`), `cuGetProcAddress` and
//! `cudaGetDriverEntryPoint` (all variants); and the `cuMemCreate` calls passed through
//! (`vmm.rs`). Statics, not fields of the shim: `dlsym` must
//! never start gpupool (which itself looks symbols up). Its own module, imported by the others
//! and importing none, so that no two modules import each other.

use std::sync::atomic::AtomicU64;

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
