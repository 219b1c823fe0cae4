//! The consistency check of the whole allocator, for tests: no two segments overlap, each
//! device's own check (`device::check_totals`), each device's segments against the index, and each
//! tag's current figures against its live blocks, and each exported block against its shard.

use super::Allocator;

impl Allocator {
    /// Checks every invariant of every device, for tests: each segment's blocks cover it
    /// exactly and in order, free neighbours are coalesced, each free block is in its pool
    /// once, the live map holds exactly the allocated blocks, pending events match the blocks
    /// awaiting them, each statistic equals a recount, the peak credit adds up, no two
    /// segments overlap, each tag's current figures are its live blocks', and the private
    /// pools agree with their routes (counted routes, none to a released pool, each pool
    /// shard's release state, segments kept for a graph only in live pools, never expandable,
    /// blocks deferred until no capture listed as such), and every block exported to another
    /// process, live or in limbo, is allocated in its shard and marked there (never in a free
    /// pool while an importer may hold it). Takes every
    /// lock; O(blocks). Call it while no other thread allocates or frees.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut end = 0;
        let mut per_device = vec![0i64; self.devices.len()];
        for (base, size, device) in self.index.segments() {
            if base < end {
                return Err(format!("segment {base:#x} overlaps the one before it"));
            }
            end = base + size as u64;
            per_device[device as usize] += 1;
        }
        for (i, dev) in self.devices.iter().enumerate() {
            if let Some(dev) = dev.get() {
                dev.check()?;
                let segments = dev.stats().segment.all.current;
                if segments != per_device[i] {
                    return Err(format!("device {i}: {segments} segments counted, {} indexed", per_device[i]));
                }
            } else if per_device[i] != 0 {
                return Err(format!("device {i} was never used but has segments"));
            }
        }
        self.check_tags()?;
        self.check_exports()
    }

    /// Every export of this allocator names an allocated block marked exported.
    fn check_exports(&self) -> Result<(), String> {
        for (ptr, _, stage, _) in crate::caching::ipc::export::list(self.id) {
            let shard = self.index.with_segment(ptr, |seg| seg.map(|e| e.owner.clone()));
            let Some(shard) = shard else {
                return Err(format!("exported block {ptr:#x} ({stage:?}) lies in no segment"));
            };
            if !shard.lock_hot().ipc_marked(ptr) {
                return Err(format!("exported block {ptr:#x} ({stage:?}) is not an allocated block marked exported"));
            }
        }
        Ok(())
    }

    /// Each tag's current bytes and blocks equal those of the allocated blocks that carry it.
    fn check_tags(&self) -> Result<(), String> {
        let mut live: std::collections::BTreeMap<u32, (i64, i64)> = Default::default();
        for dev in self.devices.iter().filter_map(|d| d.get()) {
            for (ctx, size) in dev.live_blocks() {
                let e = live.entry(self.recorder.contexts.tag_of(ctx)).or_default();
                e.0 += size as i64;
                e.1 += 1;
            }
        }
        for (i, (name, s)) in self.all_tag_stats().into_iter().enumerate() {
            let (bytes, blocks) = live.get(&(i as u32 + 1)).copied().unwrap_or_default();
            if (s.bytes.current, s.blocks.current) != (bytes, blocks) {
                return Err(format!(
                    "tag {name:?} counts {} bytes in {} blocks; its live blocks hold {bytes} in {blocks}",
                    s.bytes.current, s.blocks.current
                ));
            }
        }
        Ok(())
    }
}
