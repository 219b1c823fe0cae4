//! `gpupool-replay`: tune gpupool's configuration for a workload offline, from a trace of its
//! allocations, on a machine without a GPU.
//!
//! A trace (the text format of the traces in `replay/traces`, or the `device_traces` of a
//! PyTorch memory snapshot that any PyTorch user can dump with
//! `torch.cuda.memory._dump_snapshot`) is replayed on gpupool under each configuration asked
//! for (`GPUPOOL_CONF`'s syntax, which is PyTorch's `PYTORCH_CUDA_ALLOC_CONF`), on the
//! simulated device or on the GPU, and each replay reports peak reserved against peak live
//! bytes, driver allocations, out-of-memory errors and the time per event.
//!
//! - [`input::load`] reads a file of either kind, gzipped or not, streamed, into [`Trace`]s,
//!   within [`limits`] (a file may be hostile); [`snapshot`] says how a snapshot becomes a
//!   trace (frees of blocks allocated before a wrapped history, blocks alive in its segments),
//!   read by the tool's own [`pickle`] reader (PyTorch's pickles share objects).
//! - [`run::replay_sim`] replays a trace on a fresh simulated device, [`run::replay`] on any
//!   [`gpupool::Allocator`], [`cuda::Gpu`] on the GPU; each returns an [`run::Outcome`].
//! - The modules of that path: [`input`] opens a file of either kind; [`text`] is the text
//!   format of the traces in `replay/traces`; [`trace`] is a trace as the replay sees it
//!   (allocations and frees of numbered blocks on numbered streams); [`run`] replays it;
//!   [`cuda`] replays on the GPU; [`breakdown`] says where the bytes between live and reserved
//!   go, at a pass's peaks.
//! - [`setting`] is a configuration to replay under (`--conf`, `--row`, the `--suggest` grid),
//!   [`report`] turns outcomes into rows, printed as a [`table`], JSON or CSV, [`suggest`]
//!   picks one configuration; [`cli`] is the command line.
//!
//! A snapshot written by gpupool can be checked against the replay: read it with
//! [`input::load`], and [`Trace::peak_live`] and the peak reserved of [`run::replay_sim`] under
//! the configuration that wrote it are the figures gpupool's own statistics gave.

#![warn(missing_docs)]

pub mod breakdown;
pub mod cli;
pub mod cuda;
pub mod input;
pub mod limits;
pub mod pickle;
pub mod report;
pub mod run;
pub mod setting;
pub mod snapshot;
pub mod suggest;
pub mod table;
pub mod text;
pub mod trace;

pub use trace::{Event, Recorded, Trace};

use std::path::Path;

use gpupool::config::Config;

/// Reads the snapshot at `path` and replays device `device`'s trace on a fresh simulated device
/// of `capacity` bytes under `config`: the round trip of a snapshot. Returns the trace (its
/// [`Trace::peak_live`] is the most bytes the program held at once) and the replay's
/// [`run::Outcome`] (`peak_reserved`, `device_allocs`...). For a snapshot that gpupool wrote
/// of a program that ran on one thread with the history on from its first allocation (no
/// block alive before the trace) under `config` on a simulated device of the same capacity,
/// these are the `requested_bytes` and `reserved_bytes` peaks of gpupool's own statistics.
///
/// Errors: the file cannot be read or is not a trace ([`input::load`]), device `device` has
/// nothing in it, or the replay failed otherwise than out of memory.
pub fn replay_snapshot(
    path: &Path,
    device: usize,
    config: &Config,
    capacity: usize,
) -> Result<(Trace, run::Outcome), String> {
    let trace = input::load(path, Some(device))?
        .into_iter()
        .next()
        .ok_or_else(|| format!("{}: no trace in it", path.display()))?;
    let outcome = run::replay_sim(&trace, config, capacity).map_err(|e| format!("{}: {e}", trace.name))?;
    Ok((trace, outcome))
}
