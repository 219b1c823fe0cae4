//! Streams that come and go (issue 20): a program that creates a stream for every step (vLLM
//! saw 2 GiB a step stranded on streams PyTorch's allocator had cached memory for,
//! vllm-project/vllm PR #52951) keeps reserved memory flat with
//! `GPUPOOL_RELEASE_UNUSED_STREAMS`, with ordinary and expandable segments; without it,
//! PyTorch's behaviour: each old stream keeps its cache until the device runs out.
use crate::common;

use common::{check, sim_with};
use gpupool::config::Config;

const STEPS: usize = 1000;
const SIZES: [usize; 5] = [64 << 20, 3 << 20, 700 << 10, 200 << 20, 12 << 20];

/// Runs `STEPS` steps, each on a stream of its own that allocates `SIZES`, frees them and is
/// never used again; some steps also hold one block across into the next step. Returns the
/// bytes reserved after the first step, the peak reserved, and the shards left in the table.
fn steps(conf: &str, release: bool) -> (usize, usize, usize) {
    let config = Config { release_unused_streams: release, ..Config::default().with_conf(conf).unwrap() };
    let (a, _drv) = sim_with(1, 80 << 30, config);
    let (mut first, mut carried) = (0, None);
    for step in 0..STEPS {
        let s = 0x10_0000 + step * 0x10;
        let ptrs: Vec<u64> = SIZES.iter().map(|&b| a.malloc(b, 0, s).unwrap()).collect();
        // Every tenth step keeps a block into the next one: its stream is not unused then,
        // and its cache must stay.
        if let Some(p) = carried.take() {
            a.free(p).unwrap();
        }
        if step % 10 == 0 {
            carried = Some(a.malloc(1 << 20, 0, s).unwrap());
        }
        for p in ptrs {
            a.free(p).unwrap();
        }
        if step == 0 {
            first = a.stats(0).unwrap().reserved_bytes.all.current as usize;
        }
        if step % 97 == 0 {
            check(&a);
        }
    }
    if let Some(p) = carried {
        a.free(p).unwrap();
    }
    check(&a);
    let peak = a.stats(0).unwrap().reserved_bytes.all.peak as usize;
    (first, peak, a.stream_count(0).unwrap())
}

#[test]
fn a_stream_per_step_keeps_reserved_flat_when_unused_streams_are_released() {
    for conf in ["expandable_segments:False", "", "expandable_segments:True,max_split_size_mb:64"] {
        let (first, peak, shards) = steps(conf, true);
        // The step's own bytes, plus the block a step may carry and the segments of the
        // stream that carried it (whose cache stays: it holds a block).
        assert!(peak <= 2 * first + (4 << 20), "{conf:?}: peak {} MiB, first step {} MiB", peak >> 20, first >> 20);
        assert!(shards <= 4, "{conf:?}: {shards} shards left: unused streams' state is retired");
    }
}

#[test]
fn without_it_each_old_stream_keeps_its_cache_as_in_pytorch() {
    let (first, peak, _) = steps("", false);
    assert!(peak > 100 * first, "peak {} MiB, first step {} MiB", peak >> 20, first >> 20);
}

#[test]
fn the_expandable_rule_alone_also_keeps_it_flat() {
    let config =
        Config { expandable_reclaim: true, ..Config::default().with_conf("expandable_segments:True").unwrap() };
    let (a, _drv) = sim_with(1, 80 << 30, config);
    for step in 0..200usize {
        let ptrs: Vec<u64> = SIZES.iter().map(|&b| a.malloc(b, 0, 0x10_0000 + step * 0x10).unwrap()).collect();
        for p in ptrs {
            a.free(p).unwrap();
        }
    }
    let s = a.stats(0).unwrap();
    assert!(s.reserved_bytes.all.peak as usize <= SIZES.iter().sum::<usize>() + (8 << 20));
    check(&a);
}
