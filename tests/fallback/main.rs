//! Fallback and unsplit pools (`gpupool_pool_create_ex`, `GPUPOOL_POOL_USE_ON_OOM`,
//! `GPUPOOL_POOL_NO_SPLIT`; PyTorch `torch.cuda.MemPool(use_on_oom=, no_split=)`, issue 43) on
//! the simulated device: the fallback's rules, unsplit pools, and the red team's bad flags,
//! faults, released pools, threads and re-entrant observers. One test binary, a module per file.

#[path = "../common/mod.rs"]
mod common;

mod c_api;
mod hostile;
mod hostile_limits;
mod no_split;
mod red_team;
mod rules;
