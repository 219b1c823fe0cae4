//! gpupool: PyTorch's CUDA caching allocator for C and C++ programs, as a library with a C ABI.
//!
//! Layout:
//! - [`ffi`]: the C boundary (`include/gpupool.h` is generated from it by cbindgen).
//! - `caching`: the allocator core, PyTorch's rules over a driver trait; no GPU needed.
//! - [`driver`]: the CUDA driver (through cudarc) and the simulated device.
//! - [`stats`]: statistics in PyTorch's terms, and the memory summary.
//! - [`history`]: the allocation history and snapshots, in PyTorch's formats.
//! - [`config`]: the `GPUPOOL_*` options.
//! - [`error`]: the Rust API's error type; the C boundary maps each kind to a `gpupool_status`.
//! - [`host`]: pinned host memory, PyTorch's caching host allocator.
//! - `os`: the operating system's part of that sharing (processes, pidfds, memfds); a leaf.
//! - `callout`: calls into a program's callbacks and CPython, which may end the calling thread.
//!
//! From Rust, build an [`Allocator`] over a driver:
//!
//! ```
//! use std::sync::Arc;
//! use gpupool::{Allocator, config::Config, driver::sim::SimDriver};
//!
//! let alloc = Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
//! let p = alloc.malloc(1000, 0, 0).unwrap();
//! alloc.free(p).unwrap();
//! assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 2 << 20);
//! ```

mod caching;
mod callout;
pub mod config;
pub mod driver;
pub mod error;
pub mod ffi;
pub mod history;
pub mod host;
mod os;
pub mod stats;

pub use caching::allocator::{Allocator, BlockInfo, ConfigRef};
pub use caching::deferred::DeferredStats;
pub use caching::ipc::IPC_HANDLE_SIZE;
pub use caching::observers::out_of_memory::{OomEvent, OomObserverId};
pub use caching::observers::segments::{SegmentEvent, SegmentEventKind, SegmentObserverId};
pub use caching::pools::flags::{POOL_NO_SPLIT, POOL_USE_ON_OOM};
pub use caching::registration::MappedRange;
pub use caching::sleep::SleepMode;
pub use error::Error;
pub use stats::PoolStats;
