//! The round trip: a snapshot that gpupool writes of a program on the simulated device,
//! read back by the replay tool and replayed under the same configuration on a simulated device
//! of the same size, reaches the same peaks as the program did (its statistics' `requested` and
//! `reserved` peaks).
use std::sync::Arc;

use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;
use gpupool::history::{HistoryContext, HistorySettings};

const MIB: usize = 1 << 20;
const CAPACITY: usize = 4096 * MIB;

/// A program with growing and shrinking sizes on one stream (a dynamic-shape workload in
/// small): allocations of 1 KiB to 24 MiB, each freed a few steps later.
fn run_program(a: &Allocator) {
    let mut live: Vec<u64> = Vec::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for step in 0..3000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = 1024 + (x % (24 * MIB as u64)) as usize / (1 + step % 7);
        live.push(a.malloc(size, 0, 0x10).unwrap());
        if live.len() > 12 {
            let victim = live.remove((x as usize / 3) % live.len());
            a.free(victim).unwrap();
        }
    }
    for p in live {
        a.free(p).unwrap();
    }
}

#[test]
fn a_snapshot_written_by_gpupool_replays_to_the_same_peaks() {
    for config in [Config::default(), Config { expandable_segments: true, ..Config::default() }] {
        let a = Allocator::new(Arc::new(SimDriver::new(1, CAPACITY)), config.clone());
        let settings =
            HistorySettings { max_entries: 1_000_000, context: HistoryContext::None, stacks: Default::default() };
        a.record_history(Some(settings)).unwrap();
        run_program(&a);
        let stats = a.stats(0).unwrap();
        let path = std::env::temp_dir().join(format!("gpupool-roundtrip-{}.pickle", std::process::id()));
        let mut file = std::fs::File::create(&path).unwrap();
        a.snapshot().unwrap().write_pickle(&mut file).unwrap();
        drop(file);
        let (trace, outcome) = gpupool_replay::replay_snapshot(&path, 0, &config, CAPACITY).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            trace.peak_live() as i64,
            stats.requested_bytes.all.peak,
            "expandable {}",
            config.expandable_segments
        );
        assert_eq!(
            outcome.peak_reserved as i64, stats.reserved_bytes.all.peak,
            "expandable {}",
            config.expandable_segments
        );
    }
}

/// An annotated snapshot (issue 43): events carrying `user_metadata`, `annotate` events of
/// live blocks, replayed to the same peaks as without them, the annotations counted in the
/// notes; and a snapshot without traces, whose live blocks are replayed as alive from the
/// start.
#[test]
fn annotated_snapshots_and_snapshots_without_traces_are_read() {
    let config = Config::default();
    let a = Allocator::new(Arc::new(SimDriver::new(1, CAPACITY)), config.clone());
    let settings =
        HistorySettings { max_entries: 1_000_000, context: HistoryContext::None, stacks: Default::default() };
    a.record_history(Some(settings)).unwrap();
    gpupool::history::metadata::set(r#"{"phase":"warmup"}"#).unwrap();
    let keep: Vec<u64> = (0..5).map(|i| a.malloc((i + 1) * MIB, 0, 0x10).unwrap()).collect();
    for (i, &p) in keep.iter().enumerate() {
        a.annotate_memory(p, &format!("kept block {i}")).unwrap();
    }
    gpupool::history::metadata::set("steady").unwrap();
    run_program(&a);
    gpupool::history::metadata::set("").unwrap();
    let stats = a.stats(0).unwrap();
    let write = |traces: bool, name: &str| {
        let path = std::env::temp_dir().join(format!("gpupool-{name}-{}.pickle", std::process::id()));
        let mut file = std::fs::File::create(&path).unwrap();
        a.snapshot_with(traces).unwrap().write_pickle(&mut file).unwrap();
        path
    };
    let full = write(true, "annotated");
    let (trace, outcome) = gpupool_replay::replay_snapshot(&full, 0, &config, CAPACITY).unwrap();
    std::fs::remove_file(&full).unwrap();
    assert_eq!(trace.peak_live() as i64, stats.requested_bytes.all.peak);
    assert_eq!(outcome.peak_reserved as i64, stats.reserved_bytes.all.peak);
    assert!(trace.notes.iter().any(|n| n == "5 'annotate' entries are not replayed"), "{:?}", trace.notes);

    let lite = write(false, "lite");
    let traces = gpupool_replay::input::load(&lite, None).unwrap();
    std::fs::remove_file(&lite).unwrap();
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0].initial_blocks, 5, "the live blocks, alive from before the (empty) trace");
    assert_eq!(traces[0].peak_live(), 15 * MIB);
    for p in keep {
        a.free(p).unwrap();
    }
}
