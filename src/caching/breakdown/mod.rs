//! Where a device's reserved bytes go (`Allocator::breakdown`, gpupool's diagnostic: PyTorch's
//! snapshot shows the blocks, not the pages), every part: the report's type is plain data in
//! `stats::breakdown`; here the calls that fill it.
//!
//! - this file: [`Allocator::breakdown`], by device;
//! - [`device`]: every shard of a device read at once, and the pages the device holds
//!   unmapped;
//! - [`shard`]: a shard's blocks, and the free mapped bytes of its expandable segments by pool
//!   and page size.

mod device;
mod shard;

use crate::caching::allocator::Allocator;
use crate::error::Error;
use crate::stats::breakdown::Breakdown;

impl Allocator {
    /// Where the reserved bytes of `device` (-1: current) go beyond what live blocks asked
    /// for: rounding, blocks awaiting events, free bytes of ordinary segments, and the free
    /// mapped bytes of each stream's expandable segments by pool and page size, whole pages
    /// or sharing a page with a block in use (see [`Breakdown`]); and the pages held unmapped.
    /// gpupool's diagnostic (PyTorch's snapshot shows the blocks, not the pages). Changes
    /// nothing: every shard of the device is locked at once, briefly, and the front caches
    /// are read, not merged.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn breakdown(&self, device: i32) -> Result<Breakdown, Error> {
        Ok(self.device_or_init(device)?.breakdown())
    }
}
