//! Sleep and wake (`gpupool_sleep`, `gpupool_wake`): a pool gives its device memory back to the
//! driver and gets it back later at the same addresses, its live blocks' contents kept in host
//! memory meanwhile or dropped. Not in PyTorch; the rules are in docs/sleep.md. Every part of
//! the mechanism is here, from the allocator's calls down to one stream's pages and the copies,
//! in reading order:
//!
//! - `sleepers.rs`: the modes ([`SleepMode`]), which pools may sleep, and each device's record
//!   of its sleeping pools ([`Sleepers`]).
//! - `allocator.rs`: `Allocator::sleep`, `wake` and the pinned memory they hold, over every
//!   device.
//! - `device.rs`: a pool's sleep and wake on one device: its streams, all or nothing, the
//!   memory limit, the rules a sleeping pool follows, the check.
//! - `device_copy.rs`: the copying half on one device: each stream's host copy, where it comes
//!   from and goes back to, the kept copies' check.
//! - `shard.rs`: one stream's share: its work waited for, its live blocks copied, its pages
//!   unmapped and mapped again, the check.
//! - `copy.rs`: the copy engine's copies through the staging ring (`Copies`, the ring's
//!   copier, pageable host copies).
//! - `copy_direct.rs`: the copies straight to and from a pinned host copy.
//! - `staging.rs`: each device's staging ring of pinned buffers.
//! - `copy_threads.rs`: the CPU threads that copy between the ring and the host copies.
//! - `pinned_copies.rs`: the pinned host copies a pool keeps between its sleeps
//!   (`GPUPOOL_SLEEP_OFFLOAD_PINNED`).
//! - `prepare.rs`: a pool's host copy pinned before its first sleep (`gpupool_sleep_prepare`).
//!
//! The copy engine (`copy`, `copy_direct`, `staging`, `copy_threads`, `pinned_copies`) imports
//! nothing of the allocator: only the driver and the configuration.

mod allocator;
mod copy;
mod copy_direct;
mod copy_threads;
mod device;
mod device_copy;
mod pinned_copies;
mod prepare;
mod shard;
mod sleepers;
mod staging;

pub(crate) use pinned_copies::Kept;
pub(crate) use shard::ShardSleep;
pub use sleepers::SleepMode;
pub(crate) use sleepers::{SLEEPABLE_BIT, Sleepers, sleepable};
pub(crate) use staging::{Staging, StagingSettings};
