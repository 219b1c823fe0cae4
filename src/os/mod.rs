//! What gpupool asks of the operating system for sharing memory between processes, apart from
//! the driver: a leaf, importing nothing of the crate, so that the simulated driver and the
//! IPC protocol both use it and neither imports the other.
//!
//! - `process.rs`: who a process is (pid and start time), whether it runs, taking one of its
//!   descriptors (`pidfd_open`, `pidfd_getfd`).
//! - `memfd.rs`: anonymous shared-memory files (`memfd_create`), a file's size.

pub(crate) mod memfd;
pub(crate) mod process;
