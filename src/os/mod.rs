//! What gpupool asks of the operating system apart from the driver (memory mappings, and what
//! sharing memory between processes needs): a leaf, importing nothing of the crate, so that the simulated driver and the
//! IPC protocol both use it and neither imports the other.
//!
//! - `process.rs`: who a process is (pid and start time), whether it runs, taking one of its
//!   descriptors (`pidfd_open`, `pidfd_getfd`).
//! - `memfd.rs`: anonymous shared-memory files (`memfd_create`), a file's size.
//! - `mapping.rs`: anonymous memory mappings (`mmap`, `munmap`), address space reserved aligned.

pub(crate) mod mapping;
pub(crate) mod memfd;
pub(crate) mod process;
