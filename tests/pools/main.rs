//! Private pools on the simulated device: CUDA graphs' capture rules and pools, and pools whose
//! segments come from the program's allocator. One test binary, a module per file.

#[path = "../common/mod.rs"]
mod common;

mod graphs;
mod pool_allocator;
mod routes;
mod support;
