//! Out-of-memory and segment observers on the simulated device. One test binary, a module per
//! file; the C API's tests are in `tests/capi/`.

#[path = "../common/mod.rs"]
mod common;

mod oom;
mod segments;
