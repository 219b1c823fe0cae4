//! The statistics (PyTorch `DeviceStats`, `getStats`, `resetPeakStats`): what each stream
//! counts under its own lock, and the device peaks kept exact from credit with no shared write
//! on the hit path. Every part of the mechanism is here, from the counting cells up to the
//! allocator's calls, in reading order:
//!
//! - `cell_layout.rs`: which statistics have a peak, where each of a metric's three cells
//!   lives (all pools, small pool, large pool), and the device's totals per cell (a leaf).
//! - `counters/`: one shard's counting cells and the device's slow-path event counts, and
//!   [`counters::collect`], the cells turned into [`crate::stats::DeviceStats`];
//!   `counters/pending_sums.rs`: the hit path's ten cells counted as three pending sums.
//! - `peaks/`: exact device peaks by credit (the invariant, borrows, give-backs, resets);
//!   `peaks/settle_steps.rs`: a settle's arithmetic as steps, one shard at a time or all at
//!   once, taking no lock.
//! - `device.rs`: the device's part: the end of every call on a shard (credit kept, borrowed
//!   or given back), the settles of reads with every visited shard locked at once, `stats`,
//!   `reset_peak_stats`, gpupool's diagnostics.
//! - `device_call_settle.rs`: the settle a call that ran past its credit makes before it
//!   returns, the steps run locking one shard at a time.
//! - `allocator.rs`: `Allocator::stats`, `reset_peak_stats`, `memory_summary` and the
//!   diagnostics (settles, streams, size bins), over every device.
//!
//! The layout, the counters and the peaks import nothing of the allocator but the size rules'
//! `PoolKind`; `crate::stats` (what is reported) imports nothing from here.

mod allocator;
mod cell_layout;
pub(crate) mod counters;
mod device;
mod device_call_settle;
pub(crate) mod peaks;
