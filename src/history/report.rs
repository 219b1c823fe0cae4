//! The live report ([`crate::Allocator::live_report`]): a device's allocated blocks grouped by
//! tag, then by the call stack that allocated them where history kept it, largest first, as a
//! leak hunt reads it. Printed as mimalloc prints its statistics: plain text, one line a row,
//! to an output callback or stderr.

use rustc_hash::FxHashMap;

use super::stacks::ContextTable;
use super::tags;
use crate::stats::summary::format_size;

/// Frames printed per stack, innermost first; the rest are counted.
const FRAMES_SHOWN: usize = 12;

/// Bytes and blocks.
#[derive(Clone, Copy, Default)]
struct Sum {
    bytes: usize,
    blocks: usize,
}

impl Sum {
    fn add(&mut self, bytes: usize) {
        self.bytes += bytes;
        self.blocks += 1;
    }

    fn text(self) -> String {
        format!(
            "{} in {} block{}",
            format_size(self.bytes as u64),
            self.blocks,
            if self.blocks == 1 { "" } else { "s" }
        )
    }
}

/// Largest first: bytes, then blocks, then `key` (so that the order is the same each time).
fn largest_first<K: Ord + Copy, V>(v: &mut [(K, Sum, V)]) {
    v.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(b.1.blocks.cmp(&a.1.blocks)).then(a.0.cmp(&b.0)));
}

/// The report of device `device`, whose allocated blocks are `blocks` (context, rounded size),
/// their contexts read from `contexts`.
pub(crate) fn live_report(device: i32, contexts: &ContextTable, blocks: &[(u32, usize)]) -> String {
    let mut total = Sum::default();
    // tag -> stack id -> sum
    let mut by_tag: FxHashMap<u32, (Sum, FxHashMap<u32, Sum>)> = FxHashMap::default();
    for &(ctx, size) in blocks {
        let (tag, stack) = contexts.split(ctx);
        total.add(size);
        let t = by_tag.entry(tag).or_default();
        t.0.add(size);
        t.1.entry(stack).or_default().add(size);
    }
    let mut out = format!("gpupool live report, device {device}: {}\n", total.text());
    let mut tags: Vec<(u32, Sum, FxHashMap<u32, Sum>)> = by_tag.into_iter().map(|(t, (s, m))| (t, s, m)).collect();
    largest_first(&mut tags);
    let mut sym = contexts.symbolizer();
    for (tag, sum, stacks) in tags {
        let name = match tags::name_of(tag) {
            Some(n) if tag != 0 => format!("tag {n}"),
            _ => "no tag".to_string(),
        };
        out += &format!("  {}: {name}\n", sum.text());
        let mut stacks: Vec<(u32, Sum, ())> = stacks.into_iter().map(|(s, m)| (s, m, ())).collect();
        largest_first(&mut stacks);
        for (stack, sum, ()) in stacks {
            if stack == 0 {
                out += &format!("    {}, no call stack recorded\n", sum.text());
                continue;
            }
            let frames = sym.stack_frames(stack);
            out += &format!("    {}, allocated at:\n", sum.text());
            for f in frames.iter().take(FRAMES_SHOWN) {
                out += &format!("      {} ({}:{})\n", f.name, f.filename, f.line);
            }
            if frames.len() > FRAMES_SHOWN {
                out += &format!("      ... {} more frames\n", frames.len() - FRAMES_SHOWN);
            }
        }
    }
    out
}
