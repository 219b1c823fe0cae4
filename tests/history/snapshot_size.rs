//! Snapshots at PyTorch's size (issue 21): 20,000 events from a handful of call sites, recorded
//! with context `all` on the simulated device, dumped, and read back by CPython. The pickle
//! holds what an independent writer (serde-pickle, nothing shared) writes for the same
//! snapshot; frames, frame lists and strings are written once and referred back to, so that
//! CPython loads them as shared objects; every opcode is one the memory_viz page decodes and
//! CPython writes for the same data; and the bytes per event are at most 1.3 times CPython's own
//! for the same structure, both as it loads (`pickle.dumps(pickle.loads(data))`) and as PyTorch
//! shapes it (frame dicts and strings shared, a list of its own per event). Prints the sizes and
//! the time the dump took (not asserted).
use crate::common;

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use common::history::{VIEWER_OPCODES, record_all};
use common::{MIB, sim};
use gpupool::Allocator;
use gpupool::history::{Action, Frame, HistoryContext, Snapshot, TraceEntry};
use serde_pickle::{HashableValue as H, Value as V};

const S: usize = 0x10;

// Call sites a few frames apart, so that each has a stack of its own.
#[inline(never)]
fn alloc_a(a: &Allocator, size: usize) -> u64 {
    black_box(a.malloc(black_box(size), 0, S).unwrap())
}
#[inline(never)]
fn alloc_b(a: &Allocator, size: usize) -> u64 {
    black_box(alloc_a(a, size))
}
#[inline(never)]
fn alloc_c(a: &Allocator, size: usize) -> u64 {
    black_box(alloc_b(a, size))
}
#[inline(never)]
fn free_x(a: &Allocator, p: u64) {
    a.free(black_box(p)).unwrap();
    black_box(());
}
#[inline(never)]
fn free_y(a: &Allocator, p: u64) {
    free_x(a, p);
    black_box(());
}

/// `pairs` allocations and frees (3 events each: `alloc`, `free_requested`, `free_completed`)
/// from three allocating and two freeing call sites, then the snapshot.
fn program(pairs: usize) -> Snapshot {
    let (a, _drv) = sim(1, 256 * MIB);
    record_all(&a, HistoryContext::All);
    let sizes = [512, 4096, 100_000];
    for i in 0..black_box(pairs) {
        let size = sizes[i % 3];
        let p = match i % 3 {
            0 => alloc_a(&a, size),
            1 => alloc_b(&a, size),
            _ => alloc_c(&a, size),
        };
        if i % 2 == 0 { free_x(&a, p) } else { free_y(&a, p) }
    }
    a.snapshot().unwrap()
}

fn s(v: &str) -> V {
    V::String(v.to_string())
}

fn dict(items: Vec<(&str, V)>) -> V {
    V::Dict(items.into_iter().map(|(k, v)| (H::String(k.to_string()), v)).collect::<BTreeMap<_, _>>())
}

fn frames(f: &[Frame]) -> V {
    V::List(
        f.iter()
            .map(|f| dict(vec![("filename", s(&f.filename)), ("line", V::I64(f.line.into())), ("name", s(&f.name))]))
            .collect(),
    )
}

/// The snapshot as serde-pickle writes it, every value in full: an independent writer of the
/// structure `to_pickle` must hold (PyTorch's keys, as tests/history/recording.rs checks them).
fn expected(snap: &Snapshot) -> Vec<u8> {
    let int = |v: u64| V::I64(v as i64);
    let segments = snap.segments.iter().map(|g| {
        let blocks = g.blocks.iter().map(|b| {
            dict(vec![
                ("address", int(b.address)),
                ("size", int(b.size as u64)),
                ("requested_size", int(b.requested_size as u64)),
                ("state", s(b.state.name())),
                ("frames", frames(&b.frames)),
            ])
        });
        dict(vec![
            ("device", V::I64(g.device.into())),
            ("address", int(g.address)),
            ("total_size", int(g.total_size as u64)),
            ("allocated_size", int(g.allocated_size as u64)),
            ("active_size", int(g.active_size as u64)),
            ("requested_size", int(g.requested_size as u64)),
            ("stream", int(g.stream as u64)),
            ("segment_type", s(if g.is_large { "large" } else { "small" })),
            ("segment_pool_id", V::Tuple(vec![V::I64(0), int(g.pool)])),
            ("is_expandable", V::Bool(g.is_expandable)),
            ("frames", frames(&g.frames)),
            ("blocks", V::List(blocks.collect())),
        ])
    });
    let traces = snap.device_traces.iter().map(|t| {
        V::List(
            t.iter()
                .map(|e| {
                    dict(vec![
                        ("action", s(e.action.name())),
                        (if e.action == Action::Oom { "device_free" } else { "addr" }, int(e.addr)),
                        ("size", int(e.size as u64)),
                        ("stream", int(e.stream as u64)),
                        ("time_us", V::I64(e.time_us)),
                        ("frames", frames(&e.frames)),
                    ])
                })
                .collect(),
        )
    });
    let a = &snap.allocator_settings;
    let divisions = a.roundup_power2_divisions.iter().enumerate();
    let settings = dict(vec![
        ("PYTORCH_CUDA_ALLOC_CONF", s(&a.conf)),
        ("max_split_size", V::I64(a.max_split_size as i64)),
        ("garbage_collection_threshold", V::F64(a.garbage_collection_threshold)),
        ("expandable_segments", V::Bool(a.expandable_segments)),
        ("pinned_num_register_threads", int(a.pinned_num_register_threads as u64)),
        ("release_lock_on_cudamalloc", V::Bool(a.release_lock_on_cudamalloc)),
        ("pinned_use_cuda_host_register", V::Bool(a.pinned_use_cuda_host_register)),
        (
            "roundup_power2_divisions",
            V::Dict(divisions.map(|(i, &d)| (H::String((1u64 << i).to_string()), int(d as u64))).collect()),
        ),
    ]);
    let root = dict(vec![
        ("segments", V::List(segments.collect())),
        ("device_traces", V::List(traces.collect())),
        ("allocator_settings", settings),
        ("gpupool_unmapped_held_bytes", V::List(snap.unmapped_held_bytes.iter().map(|&b| int(b as u64)).collect())),
    ]);
    serde_pickle::value_to_vec(&root, serde_pickle::SerOptions::new()).unwrap()
}

/// Reads gpupool's pickle (argv[1]) with CPython and checks it (see the module docs); argv[2]
/// is the serde-pickle file, argv[3] the page's opcodes, argv[4] the size bound.
const CHECK: &str = r#"
import pickle, pickletools, sys
raw, want = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read()
viewer, bound = set(sys.argv[3].split()), float(sys.argv[4])
snap = pickle.loads(raw)
assert snap == pickle.loads(want), "not the structure serde-pickle writes for the same snapshot"
events = [e for t in snap["device_traces"] for e in t]
lists = [e["frames"] for e in events] + [g["frames"] for g in snap["segments"]]
lists += [b["frames"] for g in snap["segments"] for b in g["blocks"]]
# As PyTorch shapes it: its C++ pickler writes each string once and shares each frame dict;
# each event and block has a list of its own.
strings, by_key = {}, {}
def st(x): return strings.setdefault(x, x)
def frame(f):
    k = (f["filename"], f["line"], f["name"])
    return by_key.setdefault(k, {st("filename"): st(k[0]), st("line"): k[1], st("name"): st(k[2])})
def shape(v, key=None):
    if key == "frames": return [frame(f) for f in v]
    if isinstance(v, dict): return {st(k): shape(x, k) for k, x in v.items()}
    if isinstance(v, list): return [shape(x) for x in v]
    if isinstance(v, tuple): return tuple(shape(x) for x in v)
    return st(v) if isinstance(v, str) else v
torch = pickle.dumps(shape(snap), protocol=4)
# CPython's own pickle of the objects as loaded (protocol 4, as torch's _dump_snapshot writes).
cpython = pickle.dumps(snap, protocol=4)
stacks = {tuple((f["filename"], f["line"], f["name"]) for f in l) for l in lists if l}
frames = [f for l in lists for f in l]
keys = {(f["filename"], f["line"], f["name"]) for f in frames}
n = len(events)
print(f"{n} events, {len(stacks)} stacks, {len(keys)} frames, {len(frames) / len(lists):.1f} frames a stack;"
      f" gpupool {len(raw)} bytes ({len(raw) / n:.1f} an event), CPython's pickle of the objects as loaded"
      f" {len(cpython)} ({len(cpython) / n:.1f}), as PyTorch shares them {len(torch)} ({len(torch) / n:.1f})")
# Shared as loaded: one list per distinct stack, one dict per distinct frame, one string per
# distinct file or function name.
got = len({id(l) for l in lists if l})
assert got == len(stacks), f"{got} frame lists for {len(stacks)} stacks"
got = len({id(f) for f in frames})
assert got == len(keys), f"{got} frame dicts for {len(keys)} frames"
names = [f["name"] for f in frames] + [f["filename"] for f in frames]
assert len({id(x) for x in names}) == len(set(names)), "strings written again"
ours, theirs = ({op.name for op, _, _ in pickletools.genops(b)} for b in (raw, cpython))
assert ours <= viewer, ours - viewer
assert ours <= theirs, ("opcodes CPython does not write for this data", ours - theirs)
assert len(raw) <= bound * len(cpython), "larger than CPython's"
assert len(raw) <= bound * len(torch), "larger than PyTorch's"
print("ok")
"#;

/// Runs `script` with CPython on `pickle` and `want` (argv[1] and argv[2]), and `args`: what
/// it printed, which must end with "ok", or the test fails with it.
fn cpython(script: &str, pickle: &[u8], want: &[u8], args: &[&str]) -> String {
    let dir = std::env::temp_dir();
    let path = |what: &str| dir.join(format!("gpupool-size-{}-{what}.pickle", std::process::id()));
    let (ours, theirs) = (path("ours"), path("want"));
    std::fs::write(&ours, pickle).unwrap();
    std::fs::write(&theirs, want).unwrap();
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .args([&ours, &theirs])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("python3 is needed to read the pickle with CPython's: {e}"));
    let _ = (std::fs::remove_file(&ours), std::fs::remove_file(&theirs));
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.ends_with("ok\n"), "{text}");
    text
}

#[test]
fn snapshots_are_at_most_1_3_times_pytorchs_size() {
    let snap = program(6_667);
    let events: usize = snap.device_traces.iter().map(Vec::len).sum();
    assert!(events >= 20_000, "{events}");
    // The dump alone (the stacks are symbolised by `snapshot`), the fastest of three.
    let mut best = f64::MAX;
    let mut pickle = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        pickle = black_box(&snap).to_pickle();
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "dump of {events} events: {} bytes, {:.1} an event, in {:.2} ms",
        pickle.len(),
        pickle.len() as f64 / events as f64,
        best * 1e3
    );
    println!("{}", cpython(CHECK, &pickle, &expected(&snap), &[VIEWER_OPCODES, "1.3"]));
}

/// Checks the sharing of [`stacks_equal_by_value_share_one_list`]'s snapshot.
const SHARED: &str = r#"
import pickle, sys
snap = pickle.loads(open(sys.argv[1], "rb").read())
assert snap == pickle.loads(open(sys.argv[2], "rb").read())
t = snap["device_traces"][0]
assert t[0]["frames"] is t[1]["frames"] is t[3]["frames"], "one list for one stack"
assert t[2]["frames"] is not t[0]["frames"] and t[2]["frames"][1] is t[0]["frames"][1], "one dict for one frame"
assert t[2]["frames"][0]["filename"] is t[0]["frames"][0]["filename"], "one string"
assert t[4]["frames"] == [] and t[4]["frames"] is not t[5]["frames"], "empty lists of their own"
assert t[1]["device_free"] == 1 << 40 and "addr" not in t[1]
print("ok")
"#;

/// Stacks equal by value share one list even when they are distinct lists in the snapshot (two
/// stacks that symbolise alike), and frames and strings one object each; an empty list is an
/// object of its own, as CPython writes it; a function named as an action does not make a
/// reader that counts references (serde-pickle) lose the action.
#[test]
fn stacks_equal_by_value_share_one_list() {
    let (a, _drv) = sim(1, 64 * MIB);
    let mut snap = a.snapshot().unwrap();
    let frame = |name: &str| Frame { name: name.into(), filename: "engine.cc".into(), line: 7 };
    // A function named as an action, in two stacks.
    let one: Arc<[Frame]> = vec![frame("step"), frame("alloc")].into();
    let same: Arc<[Frame]> = vec![frame("step"), frame("alloc")].into();
    let other: Arc<[Frame]> = vec![frame("load"), frame("alloc")].into();
    let none: Arc<[Frame]> = Arc::from([]);
    let event = |action, frames: &Arc<[Frame]>| TraceEntry {
        action,
        addr: 1 << 40,
        size: 512,
        block_size: 512,
        stream: S,
        device: 0,
        time_us: 1,
        frames: frames.clone(),
        user_metadata: None,
    };
    use Action::*;
    snap.device_traces = vec![vec![
        event(Alloc, &one),
        event(Oom, &same),
        event(Alloc, &other),
        event(FreeRequested, &one),
        event(Snapshot, &none),
        event(Snapshot, &none),
        event(Alloc, &other),
    ]];
    let pickle = snap.to_pickle();
    cpython(SHARED, &pickle, &expected(&snap), &[]);
    // A reader that counts references (serde-pickle, replay's) still reads every action: the
    // frames' strings are objects of their own.
    let options = serde_pickle::DeOptions::new().replace_recursive_structures();
    let read = serde_pickle::value_from_slice(&pickle, options).unwrap();
    let V::Dict(root) = read else { panic!("{read:?}") };
    let V::List(traces) = &root[&H::String("device_traces".into())] else { panic!() };
    let V::List(events) = &traces[0] else { panic!() };
    let actions: Vec<&V> = events
        .iter()
        .map(|e| match e {
            V::Dict(e) => &e[&H::String("action".into())],
            _ => panic!("{e:?}"),
        })
        .collect();
    let want = snap.device_traces[0].iter().map(|e| s(e.action.name())).collect::<Vec<_>>();
    assert_eq!(actions, want.iter().collect::<Vec<_>>());
}
