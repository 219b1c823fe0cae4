//! Checks of the allocation history and snapshots, shared by tests/history/recording.rs,
//! tests/invariants/sequences.rs and tests/history/snapshot_size.rs.

use std::collections::HashMap;

use gpupool::Allocator;
use gpupool::history::{Action, BlockState, HistoryContext, HistorySettings, Snapshot};

/// The memory_viz page's own unpickler knows these opcodes (`torch/utils/viz/MemoryViz.js`,
/// `unpickle`); Python's pickler writes dicts, lists and tuples of strings, integers, floats
/// and booleans with them, and refers back to what it wrote with the memo's.
pub const VIEWER_OPCODES: &str = "PROTO FRAME STOP MARK EMPTY_DICT EMPTY_LIST EMPTY_TUPLE DICT LIST TUPLE TUPLE1 \
                              TUPLE2 TUPLE3 SETITEM SETITEMS APPEND APPENDS BININT BININT1 BININT2 LONG1 \
                              SHORT_BINUNICODE BINUNICODE BINFLOAT NEWTRUE NEWFALSE NONE MEMOIZE BINPUT \
                              LONG_BINPUT BINGET LONG_BINGET";

/// Records everything, with the stacks of `context`, keeping a million events per device.
pub fn record_all(a: &Allocator, context: HistoryContext) {
    a.record_history(Some(HistorySettings { max_entries: 1 << 20, context, stacks: Default::default() })).unwrap();
}

/// Address ranges, merged where they touch.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Takes a snapshot and checks it: segments in order and apart, each tiled exactly by its
/// blocks in address order, its totals the sums of its blocks, and, per device in use, the
/// sums equal to the statistics. With `full_trace` (the history recorded everything since the
/// allocator was made, and kept it all), also replays each device's trace from nothing and
/// checks that every event is possible where it happens (no block allocated twice, no free of
/// a block not allocated, no segment or page given back that was not held) and that it ends
/// in the snapshot's state: the same allocated and pending blocks, the same memory reserved.
pub fn snapshot_agrees(a: &Allocator, full_trace: bool) -> Snapshot {
    let snap = a.snapshot().unwrap();
    let mut end = (i32::MIN, 0u64);
    for g in &snap.segments {
        assert!((g.device, g.address) >= end, "segment {:#x} is out of order or overlaps", g.address);
        end = (g.device, g.address + g.total_size as u64);
        let mut at = g.address;
        let (mut allocated, mut active, mut requested) = (0, 0, 0);
        assert!(!g.blocks.is_empty(), "segment {:#x} has no block", g.address);
        for b in &g.blocks {
            assert_eq!(b.address, at, "the blocks of segment {:#x} do not tile it", g.address);
            assert!(b.size > 0);
            at += b.size as u64;
            match b.state {
                BlockState::ActiveAllocated => allocated += b.size,
                BlockState::ActivePendingFree => {}
                BlockState::Inactive => {
                    assert_eq!((b.requested_size, b.frames.len()), (0, 0), "inactive block {:#x}", b.address)
                }
            }
            if b.state != BlockState::Inactive {
                active += b.size;
                requested += b.requested_size;
            }
        }
        assert_eq!(at, g.address + g.total_size as u64, "segment {:#x}: blocks and size differ", g.address);
        assert_eq!((g.allocated_size, g.active_size, g.requested_size), (allocated, active, requested));
    }
    for d in 0..a.device_count() {
        let segs: Vec<_> = snap.segments.iter().filter(|g| g.device == d).collect();
        if segs.is_empty() && snap.device_traces[d as usize].is_empty() {
            continue;
        }
        let s = a.stats(d).unwrap();
        let sum =
            |f: &dyn Fn(&gpupool::history::SnapshotSegment) -> usize| segs.iter().map(|g| f(g) as i64).sum::<i64>();
        let blocks =
            |state: BlockState| segs.iter().flat_map(|g| &g.blocks).filter(|b| b.state == state).count() as i64;
        assert_eq!(sum(&|g| g.total_size), s.reserved_bytes.all.current, "device {d}: reserved");
        let held = snap.unmapped_held_bytes[d as usize] as i64;
        assert_eq!(held, s.unmapped_held_bytes.current, "device {d}: pages held unmapped");
        assert_eq!(sum(&|g| if g.is_large { g.total_size } else { 0 }), s.reserved_bytes.large_pool.current);
        assert_eq!(sum(&|g| g.allocated_size), s.allocated_bytes.all.current, "device {d}: allocated");
        assert_eq!(sum(&|g| g.active_size), s.active_bytes.all.current, "device {d}: active");
        assert_eq!(sum(&|g| g.requested_size), s.requested_bytes.all.current, "device {d}: requested");
        assert_eq!(blocks(BlockState::ActiveAllocated), s.allocation.all.current, "device {d}: allocations");
        let pending = blocks(BlockState::ActivePendingFree);
        assert_eq!(blocks(BlockState::ActiveAllocated) + pending, s.active.all.current, "device {d}: active blocks");
        if full_trace {
            replay_matches(&snap, d);
        }
    }
    snap
}

/// Replays device `d`'s trace from nothing (see [`snapshot_agrees`]).
fn replay_matches(snap: &Snapshot, d: i32) {
    // Blocks by address: (bytes asked for, free requested).
    let mut live: HashMap<u64, (usize, bool)> = HashMap::new();
    let mut segments: HashMap<u64, usize> = HashMap::new();
    let mut mapped: Vec<(u64, u64)> = Vec::new();
    let mut time = 0;
    for (i, e) in snap.device_traces[d as usize].iter().enumerate() {
        let what = format!("device {d}, event {i} ({} at {:#x}, {} bytes)", e.action.name(), e.addr, e.size);
        assert!(e.time_us >= time, "{what}: time goes back");
        time = e.time_us;
        assert_eq!(e.device, d);
        let range = (e.addr, e.addr + e.size as u64);
        match e.action {
            Action::Alloc => {
                assert!(live.insert(e.addr, (e.size, false)).is_none(), "{what}: allocated twice");
                assert!(e.block_size >= e.size);
            }
            Action::FreeRequested => {
                let b = live.get_mut(&e.addr).unwrap_or_else(|| panic!("{what}: not allocated"));
                assert!(!b.1 && b.0 == e.size, "{what}: freed twice, or with another size");
                b.1 = true;
            }
            Action::FreeCompleted => {
                let b = live.remove(&e.addr).unwrap_or_else(|| panic!("{what}: not allocated"));
                assert!(b.1, "{what}: completed before it was requested");
            }
            Action::SegmentAlloc => {
                assert!(segments.insert(e.addr, e.size).is_none(), "{what}: allocated twice");
            }
            Action::SegmentFree => {
                assert_eq!(segments.remove(&e.addr), Some(e.size), "{what}: not a segment held");
            }
            Action::SegmentMap => {
                assert!(mapped.iter().all(|m| m.1 <= range.0 || range.1 <= m.0), "{what}: mapped twice");
                // Merged with the stretches it touches, as the viewer merges them: an unmap
                // may span pages mapped by several calls.
                mapped.push(range);
                mapped = merged(mapped);
            }
            Action::SegmentUnmap => {
                let i = mapped
                    .iter()
                    .position(|m| m.0 <= range.0 && range.1 <= m.1)
                    .unwrap_or_else(|| panic!("{what}: not mapped"));
                let m = mapped.swap_remove(i);
                mapped.extend([(m.0, range.0), (range.1, m.1)].into_iter().filter(|r| r.0 < r.1));
            }
            Action::Annotate => {
                // An annotation is of a block allocated and not yet freed, with its size.
                let b = live.get(&e.addr).unwrap_or_else(|| panic!("{what}: not allocated"));
                assert!(!b.1 && b.0 == e.size, "{what}: of a freed block, or with another size");
                assert!(e.user_metadata.is_some(), "{what}: without its annotation");
            }
            Action::Oom | Action::Snapshot => {}
        }
    }
    let segs: Vec<_> = snap.segments.iter().filter(|g| g.device == d).collect();
    let shown = |state: BlockState| -> HashMap<u64, usize> {
        segs.iter()
            .flat_map(|g| &g.blocks)
            .filter(|b| b.state == state)
            .map(|b| (b.address, b.requested_size))
            .collect()
    };
    let replayed = |pending: bool| -> HashMap<u64, usize> {
        live.iter().filter(|(_, b)| b.1 == pending).map(|(&a, b)| (a, b.0)).collect()
    };
    assert_eq!(replayed(false), shown(BlockState::ActiveAllocated), "device {d}: allocated blocks");
    assert_eq!(replayed(true), shown(BlockState::ActivePendingFree), "device {d}: blocks pending free");
    let held: Vec<(u64, u64)> = segments.iter().map(|(&a, &s)| (a, a + s as u64)).chain(mapped).collect();
    let shown: Vec<(u64, u64)> = segs.iter().map(|g| (g.address, g.address + g.total_size as u64)).collect();
    assert_eq!(merged(held), merged(shown), "device {d}: the memory the trace holds is not the snapshot's");
}

/// Writes `pickle` to a temporary file and runs CPython's `script` (`python3 -c`) on it with
/// `args` after the path; the script must print a line starting with "ok". Fails the test with
/// what it printed otherwise, or when python3 is missing (CI has it: the pickle is checked
/// against CPython's own reader).
pub fn python_reads(pickle: &[u8], script: &str, args: &[&str]) {
    let path = std::env::temp_dir().join(format!(
        "gpupool-pickle-{}-{:?}.pickle",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, pickle).unwrap();
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("python3 is needed to read the pickle with CPython's: {e}"));
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.starts_with("ok"), "{text}");
}
