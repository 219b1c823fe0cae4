//! Device memory shared between processes (`gpupool_ipc_*`) on the simulated device, the test
//! binary run again as the importer (`common/ipc.rs`). One test binary, a module per file.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/ipc.rs"]
mod ipc;

mod dead_importers;
mod hostile;
mod rules;
mod sharing;
mod sim_memory;
