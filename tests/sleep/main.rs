//! Sleep and wake (docs/sleep.md) on the simulated device: the rules, the staging ring, the
//! pinned mode, faults, the statistics of sleeping pools, frees and releases racing a sleep
//! (`race`), and what observers and `largest_allocatable` are told (`observed`). One test binary, a module per
//! file.

#[path = "../common/mod.rs"]
mod common;

mod faults;
mod observed;
mod observer_race;
mod page;
mod page_extremes;
mod pinned;
mod pinned_hostile;
mod prepare;
mod race;
mod race_faults;
mod rules;
mod staging;
mod stats;
