//! The C API through the process-wide allocator, on the simulated device: the device calls and
//! the pinned host calls fuzzed, the pinned hit path attacked through the exports, the
//! history, segment observers, sleep's pinned mode, and the other frameworks' allocator
//! functions (CuPy's compiled hook: `cupy_hook.rs`). One test binary, a module per file.
//!
//! The process-wide allocator reads `GPUPOOL_*` once, at its first use, and each file sets them
//! its own way: every test here runs in a process of its own, a child of this binary
//! (`common::process::alone`, or proptest's `fork` for a proptest), so that none shares the
//! allocator with another file's tests.

#[path = "../common/mod.rs"]
mod common;

mod cupy_hook;
mod fuzz;
mod fuzz_calls;
mod fuzz_model;
mod history;
mod host_fuzz;
mod host_hit_hostile;
mod plugins;
mod prepare_peers;
mod retire;
mod segment_observers;
mod sleep_pinned;
