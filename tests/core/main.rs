//! The caching allocator's core on the simulated device: PyTorch's rules, `GPUPOOL_CONF`'s
//! settings, the front cache, the largest allocatable request, the garbage collection
//! threshold, what streams leave behind and cost, and threads at once. One test binary, a
//! module per file; the invariant checker under random calls is `tests/invariants/`.

#[path = "../common/mod.rs"]
mod common;

mod config;
mod front;
mod gc;
mod largest;
mod oom_retry;
mod oom_retry_hostile;
mod retire;
mod rules;
mod rules_errors;
mod scale;
mod settle_race;
mod stream_per_step;
mod streams;
mod stress;
