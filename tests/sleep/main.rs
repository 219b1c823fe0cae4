//! Sleep and wake (docs/sleep.md) on the simulated device: the rules, the staging ring, the
//! pinned mode, faults, and the statistics of sleeping pools. One test binary, a module per
//! file.

#[path = "../common/mod.rs"]
mod common;

mod faults;
mod pinned;
mod pinned_hostile;
mod rules;
mod staging;
mod stats;
