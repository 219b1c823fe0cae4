//! A cache-hit malloc+free loop on the simulated device, for instruction-level profiling:
//! `valgrind --tool=callgrind target/release/examples/hit_loop`.
//!
//! `hit_loop [SIZE] [HISTORY]`: SIZE bytes per allocation (512); HISTORY records the allocation
//! history while it runs, `none`, `state`, `alloc` or `all` (the call stacks kept, as
//! `GPUPOOL_RECORD_HISTORY` names them), 100000 events kept; `off` (the default) records
//! nothing. `hit_loop [SIZE] [HISTORY] [TAG]`: with TAG, the loop runs under that tag
//! (`gpupool_push_tag`). Prints the time per malloc+free pair.
use std::sync::Arc;
use std::time::Instant;

use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;
use gpupool::history::{HistoryContext, HistorySettings, tags};

const PAIRS: u32 = 200_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let size: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(512);
    let history = args.next().unwrap_or_else(|| "off".to_string());
    let a = Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
    if history != "off" {
        let context = [HistoryContext::None, HistoryContext::State, HistoryContext::Alloc, HistoryContext::All]
            .into_iter()
            .find(|c| c.name() == history)
            .expect("HISTORY: off, none, state, alloc or all");
        a.record_history(Some(HistorySettings { max_entries: 100_000, context, stacks: Default::default() })).unwrap();
    }
    let tag = args.next();
    if let Some(tag) = &tag {
        tags::push(tag).expect("TAG: 1 to 255 bytes");
    }
    let t = Instant::now();
    for _ in 0..PAIRS {
        let p = a.malloc(std::hint::black_box(size), 0, 0x10).unwrap();
        a.free(std::hint::black_box(p)).unwrap();
    }
    let ns = t.elapsed().as_nanos() as f64 / f64::from(PAIRS);
    let tag = tag.map_or(String::new(), |t| format!(", tag {t}"));
    println!("{size} bytes, history {history}{tag}: {ns:.1} ns per malloc+free pair");
}
