//! The allocation history on the simulated device: PyTorch's actions and snapshots, tags, and
//! the snapshot's size as CPython reads it. One test binary, a module per file.

#[path = "../common/mod.rs"]
mod common;

mod hostile;
mod metadata;
mod recording;
mod snapshot_size;
mod tags;
