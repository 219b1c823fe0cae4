//! Expandable segments on the simulated device: growth, faults, the pool of physical pages, and
//! the page ladder (with an IPC importer, `common/ipc.rs`, for shared large pages). One test
//! binary, a module per file.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/ipc.rs"]
mod ipc;

mod breakdown;
mod cross_sizes;
mod expandable;
mod expandable_rule;
mod expandable_support;
mod held_pages;
mod ladder_hostile;
mod page_by_rounding;
mod page_ladder;
mod page_rounding_hostile;
mod peers;
