//! Per-pool memory budgets (`gpupool_pool_set_limit`, issue 43) on the simulated device: the
//! rules of a pool over its limit, the red team's bad arguments and races, two tenants of one
//! device, one over its budget in a loop while the other allocates at full speed, and
//! `largest_allocatable` under a limit of the default pools (`limit_largest.rs`). One test
//! binary, a module per file.

#[path = "../common/mod.rs"]
mod common;

mod c_api;
mod limit_largest;
mod rules;
mod tenants;
