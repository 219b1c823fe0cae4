//! Pinned host memory (`gpupool::host`, PyTorch's caching host allocator) on the simulated
//! device: its rules, its size classes, and its hit path attacked. One test binary, a module
//! per file; the C API's tests are in `tests/capi/`.

mod caching;
mod caching_faults;
mod caching_threads;
mod hostile;
mod sizes;
mod support;
