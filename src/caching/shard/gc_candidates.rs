//! A shard's side of `garbage_collection_threshold` (see `device::gc_threshold`): its whole free
//! segments with their ages, and releasing one of them.

use super::{ShardCtx, ShardState};
use crate::caching::block::BlockState;
use crate::caching::rules::PoolKind;
use crate::driver::DevicePtr;
use crate::error::Error;

impl ShardState {
    /// The segments of the large pool that are wholly free and not expandable (the blocks
    /// PyTorch's `garbage_collect_cached_blocks` may release), as (segment address, bytes,
    /// age), appended to `out`. A block's age is the number of blocks this shard freed since it
    /// was freed (PyTorch `Block::gc_count`, which counts the pool's `get_free_block` calls).
    pub fn collectable(&self, out: &mut Vec<(DevicePtr, usize, u32)>) {
        for (size, addr, id) in self.large.iter() {
            let b = &self.blocks[id];
            if !b.is_split() && !b.expandable && self.releasable(addr) {
                out.push((addr, size, self.frees.wrapping_sub(b.freed_at)));
            }
        }
    }

    /// Releases the segment at `addr` to the driver (PyTorch `release_block`) if it is still a
    /// wholly free segment of the large pool: another thread may have taken it since
    /// [`ShardState::collectable`] saw it. Returns the bytes released (0: it was not).
    ///
    /// Errors: [`Error::Cuda`] when the driver refuses the memory back; the segment stays
    /// cached.
    pub fn release_if_free(&mut self, ctx: &ShardCtx, addr: DevicePtr) -> Result<usize, Error> {
        let Some(seg) = self.segments.get(&addr) else { return Ok(0) };
        let (id, size) = (seg.head, seg.size);
        let b = &self.blocks[id];
        if b.state != BlockState::Free
            || b.is_split()
            || b.expandable
            || b.pool != PoolKind::Large
            || !self.releasable(addr)
        {
            return Ok(0);
        }
        self.release_segment(ctx, id)?;
        Ok(size)
    }
}
