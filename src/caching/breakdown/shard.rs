//! A shard's part of the device's [`Breakdown`]: where its reserved bytes go (see
//! `stats::breakdown`), read without changing anything.

use crate::caching::block::{BlockState, NIL};
use crate::caching::rules::PoolKind;
use crate::caching::shard::ShardState;
use crate::stats::breakdown::Breakdown;

impl ShardState {
    /// Adds this shard's blocks to `out`, its free mapped bytes under `stream`. Reads the
    /// front cache as it is (a cached block is free), so a report between a program's calls
    /// leaves the allocator exactly as it was.
    pub(crate) fn breakdown_into(&self, stream: usize, out: &mut Breakdown) {
        for seg in self.segments.values() {
            let e = seg.exp.as_deref();
            if let Some(e) = e {
                out.reserved += e.mapped;
            } else {
                out.reserved += seg.size;
            }
            let mut id = seg.head;
            while id != NIL {
                let b = &self.blocks[id];
                match b.state {
                    BlockState::Allocated => {
                        out.requested += b.requested;
                        out.rounding += b.size - b.requested;
                    }
                    BlockState::AwaitingEvents | BlockState::AwaitingSync => out.pending += b.size,
                    BlockState::Unmapped => {}
                    BlockState::Free | BlockState::Cached => match e {
                        None => out.ordinary_free += b.size,
                        Some(e) => {
                            let page = e.page as u64;
                            let (start, end) = (b.addr - e.base, b.addr - e.base + b.size as u64);
                            let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
                            let whole = hi.saturating_sub(lo) as usize;
                            let open = |n| n == NIL || self.blocks[n].state == BlockState::Unmapped;
                            let edge = open(b.prev) || open(b.next);
                            let r = out.row(stream, b.pool == PoolKind::Large, e.page);
                            if edge {
                                r.whole_edge += whole;
                                r.partial_edge += b.size - whole;
                            } else {
                                r.whole_between += whole;
                                r.partial_between += b.size - whole;
                            }
                        }
                    },
                }
                id = b.next;
            }
            if let Some(e) = e {
                let head = self.blocks[seg.head].pool == PoolKind::Large;
                out.row(stream, head, e.page).mapped += e.mapped;
            }
        }
    }
}
