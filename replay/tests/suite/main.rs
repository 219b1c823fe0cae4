//! gpupool-replay's tests, one test binary (issue 38: each binary linked is gpupool and the
//! replay linked again), a module per file. `hostile.rs` stays a binary of its own: it bounds
//! the peak memory of every child process of its binary (`getrusage(RUSAGE_CHILDREN)`), which
//! the other tests' children would count towards.
mod cli;
mod fixtures;
mod peaks;
mod predict;
mod recorded;
mod recorded_conf;
mod roundtrip;
mod shared;
mod snapshot;
mod suggest;
mod text;
mod traces;
