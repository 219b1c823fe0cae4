//! The allocation history and snapshots on the simulated device: each of PyTorch's actions
//! recorded in the order the events happened (allocations from the cache and from new
//! segments, frees that complete at once or after `record_stream` events or a device
//! synchronisation, segments given back, pages of expandable segments mapped and unmapped, an
//! out-of-memory failure, a snapshot), the ring keeping the newest events, nothing recorded
//! while off, call stacks at each level of context, snapshots that tile their segments and
//! agree with the statistics and with a replay of their trace, and the pickle as CPython reads
//! it.
use crate::common;

use common::history::{VIEWER_OPCODES, python_reads, record_all, snapshot_agrees};
use common::{MIB, check, sim, sim_with};
use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SIM_GRANULARITY;
use gpupool::history::{Action, BlockState, Frame, HistoryContext, HistorySettings, Snapshot};

const S: usize = 0x10;
const T: usize = 0x20;
const PAGE: usize = SIM_GRANULARITY;

fn record(a: &Allocator, max_entries: usize, context: HistoryContext) {
    a.record_history(Some(HistorySettings { max_entries, context, stacks: Default::default() })).unwrap();
}

/// Device 0's events as (action, address, size).
fn events(snap: &Snapshot) -> Vec<(Action, u64, usize)> {
    snap.device_traces[0].iter().map(|e| (e.action, e.addr, e.size)).collect()
}

#[test]
fn each_action_is_recorded_in_the_order_it_happened() {
    let (a, drv) = sim(1, 64 * MIB);
    record(&a, 1000, HistoryContext::None);
    use Action::*;
    // A miss makes a segment, a hit is carved from its rest.
    let p1 = a.malloc(1000, 0, S).unwrap();
    let p2 = a.malloc(3000, 0, S).unwrap();
    assert_eq!(p2, p1 + 1024);
    // Used on another stream whose work is not done: the free waits for its event.
    a.record_stream(p1, T).unwrap();
    drv.hold_stream(T);
    a.free(p1).unwrap();
    a.free(p2).unwrap();
    drv.release_stream(T);
    // The next call on the stream returns the first block before it serves.
    let p3 = a.malloc(1000, 0, S).unwrap();
    assert_eq!(p3, p1, "the block went back and was merged");
    a.free(p3).unwrap();
    a.empty_cache(0).unwrap();
    // Out of memory, after every retry.
    assert!(a.malloc(1 << 30, 0, S).is_err());
    // A free that waits for a device synchronisation.
    let p4 = a.malloc(1000, 0, S).unwrap();
    a.free_after_device_sync(p4).unwrap();
    assert_eq!(a.release_deferred(0).unwrap(), 1);
    let snap = a.snapshot().unwrap();
    let seg = 2 * MIB;
    let want = vec![
        (SegmentAlloc, p1, seg),
        (Alloc, p1, 1000),
        (Alloc, p2, 3000),
        (FreeRequested, p1, 1000),
        (FreeRequested, p2, 3000),
        (FreeCompleted, p2, 3000),
        (FreeCompleted, p1, 1000),
        (Alloc, p1, 1000),
        (FreeRequested, p1, 1000),
        (FreeCompleted, p1, 1000),
        (SegmentFree, p1, seg),
        // PyTorch writes the device's free bytes as the event's address, and the rounded
        // size asked for.
        (Oom, (64 * MIB) as u64, 1 << 30),
        (SegmentAlloc, p4, seg),
        (Alloc, p4, 1000),
        (FreeRequested, p4, 1000),
        (FreeCompleted, p4, 1000),
        (Snapshot, 0, 0),
    ];
    assert_eq!(events(&snap), want);
    let t = &snap.device_traces[0];
    assert!(t.iter().all(|e| e.stream == S || e.action == Snapshot) && t.iter().all(|e| e.frames.is_empty()));
    assert_eq!((t[1].block_size, t[2].block_size), (1024, 3072), "the rounded sizes are kept too");
    assert!(t.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as i64;
    assert!((now - t[0].time_us).abs() < 60_000_000, "microseconds since the Unix epoch");
    check(&a);
    snapshot_agrees(&a, true);
}

#[test]
fn expandable_segments_record_their_pages() {
    let (a, _drv) = sim_with(1, 1 << 30, Config { expandable_segments: true, ..Config::pytorch() });
    record(&a, 1000, HistoryContext::None);
    use Action::*;
    let p = a.malloc(PAGE + PAGE / 2, 0, S).unwrap();
    let q = a.malloc(PAGE, 0, S).unwrap();
    assert_eq!(q, p + (PAGE + PAGE / 2) as u64);
    a.free(q).unwrap();
    a.free(p).unwrap();
    let mid = snapshot_agrees(&a, true);
    assert_eq!(mid.segments.len(), 1, "the mapped pages, as one segment");
    assert!(mid.segments[0].is_expandable && mid.segments[0].total_size == 3 * PAGE);
    a.empty_cache(0).unwrap();
    let snap = snapshot_agrees(&a, true);
    assert!(snap.segments.is_empty(), "nothing mapped: no segment shown");
    let want = vec![
        (SegmentMap, p, 2 * PAGE),
        (Alloc, p, PAGE + PAGE / 2),
        (SegmentMap, p + 2 * PAGE as u64, PAGE),
        (Alloc, q, PAGE),
        (FreeRequested, q, PAGE),
        (FreeCompleted, q, PAGE),
        (FreeRequested, p, PAGE + PAGE / 2),
        (FreeCompleted, p, PAGE + PAGE / 2),
        (Snapshot, 0, 0),
        (SegmentUnmap, p, 3 * PAGE),
        (Snapshot, 0, 0),
    ];
    assert_eq!(events(&snap), want);
}

#[test]
fn an_expandable_segment_shows_each_mapped_run() {
    let (a, _drv) = sim_with(1, 1 << 30, Config { expandable_segments: true, ..Config::pytorch() });
    record_all(&a, HistoryContext::State);
    // Three pages, the middle one freed and unmapped: two mapped runs with a hole.
    let x = a.malloc(PAGE, 0, S).unwrap();
    let y = a.malloc(PAGE, 0, S).unwrap();
    let z = a.malloc(PAGE, 0, S).unwrap();
    a.free(y).unwrap();
    a.empty_cache(0).unwrap();
    let snap = snapshot_agrees(&a, true);
    let runs: Vec<(u64, usize)> = snap.segments.iter().map(|g| (g.address, g.total_size)).collect();
    assert_eq!(runs, [(x, PAGE), (z, PAGE)]);
    assert!(snap.segments.iter().all(|g| g.is_expandable && g.is_large));
    assert_eq!(snap.segments[1].blocks[0].state, BlockState::ActiveAllocated);
}

#[test]
fn off_records_nothing_and_stopping_forgets() {
    let (a, drv) = sim(1, 1 << 30);
    assert_eq!(a.history(), None);
    let p = a.malloc(1000, 0, S).unwrap();
    a.record_stream(p, T).unwrap();
    drv.hold_stream(T);
    a.free(p).unwrap();
    let q = a.malloc(5 * MIB, 0, S).unwrap();
    let snap = snapshot_agrees(&a, false);
    assert!(snap.device_traces.iter().all(Vec::is_empty), "no event while off");
    assert!(snap.segments.iter().all(|g| g.frames.is_empty() && g.blocks.iter().all(|b| b.frames.is_empty())));
    let states: Vec<BlockState> = snap.segments.iter().flat_map(|g| g.blocks.iter().map(|b| b.state)).collect();
    assert!(states.contains(&BlockState::ActivePendingFree), "{states:?}");
    // Recording, then stopping: the trace and the blocks' stacks are forgotten.
    record(&a, 100, HistoryContext::All);
    let r = a.malloc(1000, 0, S).unwrap();
    assert_eq!(
        a.history(),
        Some(HistorySettings { max_entries: 100, context: HistoryContext::All, stacks: Default::default() })
    );
    assert!(!snapshot_agrees(&a, false).device_traces[0].is_empty());
    a.record_history(None).unwrap();
    assert_eq!(a.history(), None);
    let snap = snapshot_agrees(&a, false);
    assert!(snap.device_traces[0].is_empty());
    assert!(snap.segments.iter().flat_map(|g| &g.blocks).all(|b| b.frames.is_empty()));
    drv.release_stream(T);
    a.free(q).unwrap();
    a.free(r).unwrap();
    check(&a);
}

#[test]
fn the_ring_keeps_the_newest_events() {
    let (a, _drv) = sim(1, 1 << 30);
    record(&a, 5, HistoryContext::None);
    use Action::*;
    let mut p = 0;
    for _ in 0..10 {
        p = a.malloc(4096, 0, S).unwrap();
        a.free(p).unwrap();
    }
    // 31 events and the snapshot's: the newest 5.
    let snap = a.snapshot().unwrap();
    let want = [(FreeCompleted, p, 4096), (Alloc, p, 4096), (FreeRequested, p, 4096), (FreeCompleted, p, 4096)];
    assert_eq!(events(&snap)[..4], want);
    assert_eq!(events(&snap).len(), 5);
    // A lower limit keeps the newest of what is there.
    record(&a, 3, HistoryContext::None);
    let snap = a.snapshot().unwrap();
    assert_eq!(events(&snap), [(FreeCompleted, p, 4096), (Snapshot, 0, 0), (Snapshot, 0, 0)]);
    // 0 keeps no event.
    record(&a, 0, HistoryContext::State);
    a.malloc(4096, 0, S).unwrap();
    let snap = a.snapshot().unwrap();
    assert!(snap.device_traces[0].is_empty());
}

#[inline(never)]
fn allocate_here(a: &Allocator, size: usize) -> u64 {
    std::hint::black_box(a.malloc(size, 0, S).unwrap())
}

#[inline(never)]
fn free_here(a: &Allocator, p: u64) {
    a.free(std::hint::black_box(p)).unwrap();
}

/// Whether `frames` start with the test function `f` (innermost first, gpupool's own frames
/// left out); `None` when the binary has no symbols (the GPU machine's copies are stripped).
fn starts_in(frames: &[Frame], f: &str) -> Option<bool> {
    // Stripped, the innermost frames (the unwinder's, gpupool's, this test's) have no name,
    // and cannot be told apart.
    if frames.first().is_none_or(|x| x.name.starts_with("0x")) {
        return None;
    }
    Some(frames[0].name.ends_with(f))
}

#[test]
fn stacks_follow_the_context_level() {
    for context in [HistoryContext::None, HistoryContext::State, HistoryContext::Alloc, HistoryContext::All] {
        let (a, _drv) = sim(1, 1 << 30);
        record(&a, 1000, context);
        let kept = allocate_here(&a, 1000);
        let freed = allocate_here(&a, 1000);
        free_here(&a, freed);
        let snap = snapshot_agrees(&a, true);
        let t = &snap.device_traces[0];
        let block = snap.segments[0].blocks.iter().find(|b| b.address == kept).unwrap();
        let on = |c: HistoryContext| context >= c;
        // The block and its segment carry their allocation's stack from "state" on.
        assert_eq!(!block.frames.is_empty(), on(HistoryContext::State), "{context:?}");
        assert_eq!(!snap.segments[0].frames.is_empty(), on(HistoryContext::State), "{context:?}");
        let alloc = t.iter().find(|e| e.action == Action::Alloc).unwrap();
        let seg = t.iter().find(|e| e.action == Action::SegmentAlloc).unwrap();
        let requested = t.iter().find(|e| e.action == Action::FreeRequested).unwrap();
        let completed = t.iter().find(|e| e.action == Action::FreeCompleted).unwrap();
        // Events carry one from "alloc" on.
        for e in [alloc, seg, requested, completed] {
            assert_eq!(!e.frames.is_empty(), on(HistoryContext::Alloc), "{context:?} {:?}", e.action);
        }
        if on(HistoryContext::State) {
            if let Some(starts) = starts_in(&block.frames, "allocate_here") {
                assert!(starts, "{:?}", block.frames);
                let own = block.frames.iter().find(|f| f.name.ends_with("allocate_here")).unwrap();
                assert!(own.filename.ends_with(file!()) && own.line > 0, "{own:?}");
                assert!(block.frames.iter().all(|f| !f.name.contains("gpupool::")), "{:?}", block.frames);
            }
            assert_eq!(block.frames, snap.segments[0].frames, "the segment was made by the same call");
        }
        if on(HistoryContext::Alloc) {
            assert_eq!(alloc.frames, block.frames);
            // A free's events carry the free's stack with "all", else the block's.
            let free_at = if on(HistoryContext::All) { "free_here" } else { "allocate_here" };
            for e in [requested, completed] {
                if let Some(starts) = starts_in(&e.frames, free_at) {
                    assert!(starts, "{context:?} {:?}: {:?}", e.action, e.frames);
                }
            }
        }
    }
}

#[test]
fn stacks_stop_with_the_level_that_keeps_them() {
    let (a, _drv) = sim(1, 1 << 30);
    record(&a, 1000, HistoryContext::State);
    let p = allocate_here(&a, 1000);
    let with = |snap: &Snapshot| snap.segments[0].blocks.iter().find(|b| b.address == p).unwrap().frames.len();
    assert!(with(&a.snapshot().unwrap()) > 0);
    // Still recording, without stacks: the block forgets its own, and a later allocation
    // (of the same block) has none.
    record(&a, 1000, HistoryContext::None);
    assert_eq!(with(&a.snapshot().unwrap()), 0);
    free_here(&a, p);
    assert_eq!(allocate_here(&a, 1000), p);
    assert_eq!(with(&a.snapshot().unwrap()), 0);
}

/// A deterministic mix of sizes, streams, `record_stream`, frees that wait and frees that do
/// not, and cache releases, with the snapshot checked after each step.
fn workload(a: &Allocator, drv: &gpupool::driver::sim::SimDriver) {
    let streams = [0usize, 0x1000, 0x2000];
    let mut live: Vec<u64> = Vec::new();
    let mut x = 12345u64;
    let mut next = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as usize
    };
    for step in 0..400 {
        match next() % 10 {
            0..=4 => {
                let size = match next() % 4 {
                    0 => 1 + next() % 4096,
                    1 => 4096 + next() % MIB,
                    2 => MIB + next() % (10 * MIB),
                    _ => 12 * MIB + next() % (20 * MIB),
                };
                if let Ok(p) = a.malloc(size, 0, streams[next() % 3]) {
                    live.push(p);
                }
            }
            5 | 6 if !live.is_empty() => {
                let p = live.swap_remove(next() % live.len());
                a.free(p).unwrap();
            }
            7 if !live.is_empty() => {
                let p = live.swap_remove(next() % live.len());
                a.free_after_device_sync(p).unwrap();
            }
            8 if !live.is_empty() => {
                let p = live[next() % live.len()];
                let s = streams[next() % 3];
                drv.hold_stream(s);
                a.record_stream(p, s).unwrap();
            }
            9 => {
                for s in streams {
                    drv.release_stream(s);
                }
                if step % 3 == 0 {
                    a.empty_cache(0).unwrap();
                } else {
                    a.release_deferred(0).unwrap();
                }
            }
            _ => {}
        }
        check(a);
        snapshot_agrees(a, true);
    }
}

#[test]
fn snapshots_tile_agree_with_the_statistics_and_replay_their_trace() {
    for config in [
        Config::pytorch(),
        Config { expandable_segments: true, ..Config::pytorch() },
        Config { max_split_size: 24 * MIB, ..Config::pytorch() },
    ] {
        let (a, drv) = sim_with(1, 512 * MIB, config);
        record_all(&a, HistoryContext::Alloc);
        workload(&a, &drv);
        let snap = snapshot_agrees(&a, true);
        let actions: Vec<Action> = snap.device_traces[0].iter().map(|e| e.action).collect();
        for want in [Action::Alloc, Action::FreeRequested, Action::FreeCompleted, Action::Snapshot] {
            assert!(actions.contains(&want), "{want:?}");
        }
    }
}

/// Checks a snapshot file as PyTorch's viewer reads it: CPython's pickle loads it; its
/// opcodes are ones the memory_viz page decodes, protocol 2 to 4, integers in at most 8 bytes
/// (the page turns a longer `LONG1` into a `BigInt` it cannot add); the keys and types
/// `torch.cuda.memory._snapshot()` has; blocks tile their segments; and the counts Rust
/// passes (segments, events per device, block states, actions) are what it holds.
const CHECK_PICKLE: &str = r#"
import json, pickle, pickletools, sys
path, allowed, want = sys.argv[1], set(sys.argv[2].split()), json.loads(sys.argv[3])
raw = open(path, "rb").read()
ops = list(pickletools.genops(raw))
assert ops[0][0].name == "PROTO" and 2 <= ops[0][1] <= 4, ops[0]
for i, (op, arg, pos) in enumerate(ops):
    assert op.name in allowed, f"opcode {op.name} at {pos}"
    if op.name == "LONG1":
        assert raw[pos + 1] <= 8, f"LONG1 of {raw[pos + 1]} bytes at {pos}"
snap = pickle.loads(raw)
assert set(snap) == {"segments", "device_traces", "allocator_settings", "gpupool_unmapped_held_bytes"}, set(snap)
held = snap["gpupool_unmapped_held_bytes"]
assert len(held) == len(snap["device_traces"]) and all(isinstance(b, int) and b >= 0 for b in held), held
def frames(fs):
    assert isinstance(fs, list)
    for f in fs:
        assert set(f) == {"filename", "line", "name"}, f
        assert isinstance(f["filename"], str) and isinstance(f["line"], int) and isinstance(f["name"], str)
    return fs
states, named = set(), 0
for g in snap["segments"]:
    keys = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
            "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
    assert set(g) == keys, set(g) ^ keys
    assert g["segment_type"] in ("large", "small") and g["segment_pool_id"] == (0, 0)
    assert isinstance(g["segment_pool_id"], tuple) and isinstance(g["is_expandable"], bool)
    frames(g["frames"])
    at, allocated, active = g["address"], 0, 0
    for b in g["blocks"]:
        assert set(b) == {"address", "size", "requested_size", "state", "frames"}, set(b)
        assert b["address"] == at and b["size"] > 0
        at += b["size"]
        states.add(b["state"])
        named += bool(frames(b["frames"]))
        allocated += b["size"] if b["state"] == "active_allocated" else 0
        active += b["size"] if b["state"] != "inactive" else 0
    assert at == g["address"] + g["total_size"] and allocated == g["allocated_size"] and active == g["active_size"]
actions = set()
for trace in snap["device_traces"]:
    for e in trace:
        key = "device_free" if e["action"] == "oom" else "addr"
        assert set(e) == {"action", key, "size", "stream", "time_us", "frames"}, e
        assert all(isinstance(e[k], int) for k in (key, "size", "stream", "time_us"))
        actions.add(e["action"])
        frames(e["frames"])
s = snap["allocator_settings"]
assert s["max_split_size"] == -1 and s["expandable_segments"] is True and s["roundup_power2_divisions"]["1"] == 0
assert "expandable_segments:True" in s["PYTORCH_CUDA_ALLOC_CONF"]
got = {"segments": len(snap["segments"]), "events": [len(t) for t in snap["device_traces"]],
       "states": sorted(states), "actions": sorted(actions), "named": named > 0}
assert got == want, (got, want)
print("ok", len(raw), "bytes")
"#;

#[test]
fn the_pickle_is_what_pythons_pickle_and_the_viewer_read() {
    let (a, drv) = sim_with(2, 256 * MIB, Config { expandable_segments: true, ..Config::pytorch() });
    record_all(&a, HistoryContext::All);
    // Every action and block state: pages mapped and unmapped, a block pending free, an
    // out-of-memory failure; a device never used has an empty trace.
    let keep = allocate_here(&a, 3 * MIB);
    let gone = allocate_here(&a, 5 * MIB);
    free_here(&a, gone);
    a.empty_cache(0).unwrap();
    assert!(a.malloc(1 << 30, 0, S).is_err());
    // (After the cache releases above, which wait for every event.)
    let pending = allocate_here(&a, MIB);
    a.record_stream(pending, T).unwrap();
    drv.hold_stream(T);
    free_here(&a, pending);
    let snap = a.snapshot().unwrap();
    assert_eq!(a.block_info(keep).map(|b| b.device), Some(0));
    let mut states: Vec<&str> = snap.segments.iter().flat_map(|g| g.blocks.iter().map(|b| b.state.name())).collect();
    states.sort_unstable();
    states.dedup();
    let mut actions: Vec<&str> = snap.device_traces.iter().flatten().map(|e| e.action.name()).collect();
    actions.sort_unstable();
    actions.dedup();
    assert_eq!(actions.len(), 7, "every action but the ordinary segments': {actions:?}");
    assert_eq!(states, ["active_allocated", "active_pending_free", "inactive"]);
    let named = snap.segments.iter().flat_map(|g| &g.blocks).any(|b| !b.frames.is_empty());
    let want = format!(
        r#"{{"segments": {}, "events": [{}, {}], "states": {states:?}, "actions": {actions:?}, "named": {named}}}"#,
        snap.segments.len(),
        snap.device_traces[0].len(),
        snap.device_traces[1].len(),
    );
    python_reads(&snap.to_pickle(), CHECK_PICKLE, &[VIEWER_OPCODES, &want]);
    drv.release_stream(T);
}
