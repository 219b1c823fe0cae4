//! What a snapshot costs with and without its traces (PyTorch PR #172672's comparison:
//! `memory_snapshot(include_traces=False)`, 711.8 ms to 0.2 ms with 100,000 trace entries):
//! on the simulated device, (1) a history of 100,000 events over a few live blocks, and (2)
//! 100,000 live blocks, each taken as `Allocator::snapshot_with` and written as the pickle
//! (`gpupool_dump_snapshot_with` without the file). The median of 7 runs each, after a first
//! run that symbolises the stacks. `cargo run --profile quick --example snapshot_speed`
//! (docs/history.md has the figures).
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool::history::{HistoryContext, HistorySettings};
use gpupool::{Allocator, config::Config, driver::sim::SimDriver};

const S: usize = 0x10;
const EVENTS: usize = 100_000;

/// The median time of `f` over 7 runs (after one not counted), and the last run's pickle size.
fn median(mut f: impl FnMut() -> usize) -> (Duration, usize) {
    f();
    let mut bytes = 0;
    let mut t: Vec<Duration> = (0..7)
        .map(|_| {
            let start = Instant::now();
            bytes = f();
            start.elapsed()
        })
        .collect();
    t.sort();
    (t[3], bytes)
}

fn report(what: &str, a: &Allocator) {
    for traces in [true, false] {
        let (take, _) = median(|| a.snapshot_with(traces).unwrap().segments.len());
        let (all, bytes) = median(|| a.snapshot_with(traces).unwrap().to_pickle().len());
        println!(
            "{what}, {:14}: snapshot {:9.3} ms, with the pickle {:9.3} ms, {:>10} bytes",
            if traces { "with traces" } else { "without traces" },
            take.as_secs_f64() * 1e3,
            all.as_secs_f64() * 1e3,
            bytes
        );
    }
}

fn main() {
    let settings = HistorySettings { max_entries: EVENTS, context: HistoryContext::Alloc, stacks: Default::default() };

    // (1) A full history over 16 live blocks: PyTorch's case.
    let a = Allocator::new(Arc::new(SimDriver::new(1, 64 << 30)), Config::default());
    a.record_history(Some(settings)).unwrap();
    let mut live: Vec<u64> = (0..16).map(|i| a.malloc(4096 * (i + 1), 0, S).unwrap()).collect();
    for i in 0..EVENTS {
        let p = a.malloc(512 + (i % 7) * 4096, 0, S).unwrap();
        a.free(std::mem::replace(&mut live[i % 16], p)).unwrap();
    }
    report(&format!("{EVENTS} events, 16 live blocks"), &a);
    for p in live {
        a.free(p).unwrap();
    }

    // (2) 100,000 live blocks, history on with no events kept (stacks of live blocks only).
    let a = Allocator::new(Arc::new(SimDriver::new(1, 64 << 30)), Config::default());
    a.record_history(Some(HistorySettings { max_entries: 0, context: HistoryContext::State, ..settings })).unwrap();
    let live: Vec<u64> = (0..EVENTS).map(|i| a.malloc(512 * (1 + i % 4), 0, S).unwrap()).collect();
    report(&format!("{EVENTS} live blocks, no events"), &a);
    for p in live {
        a.free(p).unwrap();
    }
}
