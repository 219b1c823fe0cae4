//! A snapshot in PyTorch's layout, written by CPython's own `pickle` (python3 must be
//! installed: the test fails without it), read and replayed.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpupool::config::Config;
use gpupool_replay::Event::{Alloc, Free};
use gpupool_replay::Recorded;
use gpupool_replay::input::load;
use gpupool_replay::run::replay_sim;

const MIB: usize = 1 << 20;

/// Writes the snapshot of `_dump_snapshot` in the layout of PyTorch's
/// `torch/csrc/cuda/Module.cpp` (`_cuda_memorySnapshot`), as `pickle.dump` writes it, with the
/// protocol of argv[2]; gzipped when argv[3] is `gz`. Prints the names of the opcodes used.
///
/// Device 0 (segment A at 0x7f0000000000, 20 MiB, on the default stream; S2 a second stream):
/// the history wrapped, so it begins with the free of a 1 MiB block it never saw allocated and
/// a `free_completed` of another; a segment C is allocated and freed inside the window; at the
/// end, segment A holds a 4,000,000-byte block allocated before the window, the 6 MiB block of
/// the trace, a 2 MiB block awaiting its free (`active_pending_free`) and an inactive rest.
/// Device 1 has one block of 1,000 bytes, allocated in its trace.
const WRITER: &str = r#"
import gzip, pickle, pickletools, sys
MiB = 1 << 20
A, C, B = 0x7f0000000000, 0x7f0040000000, 0x7f0080000000
S2 = 140000000000000
# Shared as PyTorch shares them: frame dicts in several traceback lists, each list in several
# entries and blocks.
frames = [{'filename': 'model.py', 'line': 10, 'name': 'forward'},
          {'filename': 'train.py', 'line': 3, 'name': 'main'}]
other = [frames[1], {'filename': 'eval.py', 'line': 7, 'name': 'step'}]
t = 0
def e(action, addr, size, stream=0):
    global t
    t += 1
    return {'action': action, 'addr': addr, 'size': size, 'stream': stream, 'time_us': t,
            'frames': frames if t % 2 else other, 'compile_context': None}
dev0 = [
    e('free_requested', A + 12 * MiB, 1 * MiB, S2),
    e('free_completed', A + 12 * MiB, 1 * MiB, S2),
    e('free_completed', A + 30 * MiB, 512),
    e('alloc', A + 4 * MiB, 6 * MiB),
    e('segment_alloc', C, 20 * MiB, S2),
    e('alloc', C, 7 * MiB, S2),
    e('alloc', A + 10 * MiB, 2 * MiB),
    {'action': 'oom', 'device_free': 123, 'size': 100 * MiB, 'stream': 0, 'time_us': 99, 'frames': []},
    e('free_requested', C, 7 * MiB, S2),
    e('free_completed', C, 7 * MiB, S2),
    e('free_requested', A + 10 * MiB, 2 * MiB),
    e('segment_free', C, 20 * MiB, S2),
    e('snapshot', 0, 0),
]
dev1 = [e('alloc', B, 1000)]
def block(addr, size, requested, state):
    return {'address': addr, 'size': size, 'requested_size': requested, 'state': state, 'frames': other}
def segment(device, addr, total, blocks):
    return {'device': device, 'address': addr, 'total_size': total, 'stream': 0, 'segment_type': 'large',
            'segment_pool_id': (0, 0), 'allocated_size': 0, 'active_size': 0, 'requested_size': 0,
            'is_expandable': False, 'frames': [], 'blocks': blocks}
snapshot = {
    'segments': [
        segment(0, A, 20 * MiB, [block(A, 4 * MiB, 4000000, 'active_allocated'),
                                 block(A + 4 * MiB, 6 * MiB, 6 * MiB, 'active_allocated'),
                                 block(A + 10 * MiB, 2 * MiB, 2 * MiB, 'active_pending_free'),
                                 block(A + 12 * MiB, 8 * MiB, 0, 'inactive')]),
        segment(1, B, 2 * MiB, [block(B, 1024, 1000, 'active_allocated'),
                                block(B + 1024, 2 * MiB - 1024, 0, 'inactive')]),
    ],
    'device_traces': [dev0, dev1],
    'allocator_settings': {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:False',
                           'max_split_size': -1, 'garbage_collection_threshold': 0.8,
                           'expandable_segments': False, 'release_lock_on_cudamalloc': True,
                           'roundup_power2_divisions': {'1': 0, '2': 0}},
}
data = pickle.dumps(snapshot, protocol=int(sys.argv[2]))
with (gzip.open if sys.argv[3] == 'gz' else open)(sys.argv[1], 'wb') as f:
    f.write(data)
print(' '.join(sorted({op.name for op, _, _ in pickletools.genops(data)})))
"#;

/// Runs the writer; returns the file and the opcodes the pickle holds.
fn write_snapshot(name: &str, protocol: u8, gz: bool) -> (PathBuf, Vec<String>) {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let out = Command::new("python3")
        .args(["-c", WRITER, path.to_str().unwrap(), &protocol.to_string(), if gz { "gz" } else { "raw" }])
        .output()
        .expect("python3 is needed to write the snapshot (CPython's pickle): install it");
    assert!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    (path, String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect())
}

#[test]
fn a_pickle_of_protocol_4_in_pytorchs_layout_is_read() {
    let (path, opcodes) = write_snapshot("snapshot-4.pickle", 4, false);
    // What Python 3.8 to 3.13 write by default for the snapshot's dicts, lists, strings, ints
    // (small, 4-byte and 8-byte), tuples, None, bools and floats.
    for op in [
        "PROTO",
        "FRAME",
        "MEMOIZE",
        "BINGET",
        "EMPTY_DICT",
        "SETITEMS",
        "EMPTY_LIST",
        "APPENDS",
        "SHORT_BINUNICODE",
        "BININT",
        "BININT1",
        "LONG1",
        "TUPLE2",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BINFLOAT",
    ] {
        assert!(opcodes.iter().any(|o| o == op), "the pickle has no {op}: {opcodes:?}");
    }
    let traces = load(&path, None).unwrap();
    assert_eq!(traces.len(), 2);
    let t = &traces[0];
    assert_eq!(t.name, "snapshot-4.pickle:device 0");
    // Streams in the order first seen; the blocks alive before the trace first, in address
    // order: segment A's first block (ids follow the entries: 0 the block freed first, 1 to 3
    // the allocs, 4 the block found in the segments).
    assert_eq!(t.streams, vec![140000000000000, 0]);
    assert_eq!(t.initial_blocks, 2);
    assert_eq!(
        t.events,
        vec![
            Alloc { id: 4, size: 4_000_000, stream: 1 },
            Alloc { id: 0, size: MIB, stream: 0 },
            Free { id: 0 },
            Alloc { id: 1, size: 6 * MIB, stream: 1 },
            Alloc { id: 2, size: 7 * MIB, stream: 0 },
            Alloc { id: 3, size: 2 * MIB, stream: 1 },
            Free { id: 2 },
            Free { id: 3 },
        ]
    );
    assert_eq!(t.peak_live(), 4_000_000 + 15 * MIB);
    // PyTorch reserved 20 MiB at the end and at the start, 40 MiB while segment C lived.
    assert_eq!(
        t.recorded,
        Some(Recorded {
            peak_reserved: 40 * MIB,
            device_allocs: 1,
            ooms: 1,
            conf: Some("expandable_segments:False".into())
        })
    );
    assert_eq!(
        t.notes,
        vec![
            "1 blocks freed by the trace were allocated before it began: allocated first",
            "1 blocks alive in the snapshot's segments were allocated before the trace began: allocated first",
            "1 'snapshot' entries are not replayed",
        ]
    );

    let d1 = &traces[1];
    assert_eq!(d1.name, "snapshot-4.pickle:device 1");
    assert_eq!(d1.events, vec![Alloc { id: 0, size: 1000, stream: 0 }]);
    assert_eq!(d1.recorded.as_ref().map(|r| r.peak_reserved), Some(2 * MIB));
    assert_eq!(
        d1.notes,
        vec!["the trace has no segment events: the recorded peak is what the segments hold at its end"]
    );

    // Replayed by PyTorch's rules: 4,000,000 bytes take a 20 MiB segment on the default stream,
    // 1 MiB a 2 MiB small segment on S2; the 6 MiB and 2 MiB blocks fit in the first segment,
    // the 7 MiB block on S2 needs a 20 MiB segment of its own (pools are per stream).
    let o = replay_sim(t, &Config::pytorch(), 1 << 30).unwrap();
    assert_eq!((o.peak_reserved, o.device_allocs, o.peak_segments), (42 * MIB, 3, 3));
    let o = replay_sim(d1, &Config::pytorch(), 1 << 30).unwrap();
    assert_eq!(o.peak_reserved, 2 * MIB);

    // The same in one call, as a round trip of a snapshot uses it.
    let (trace, o) = gpupool_replay::replay_snapshot(&path, 0, &Config::pytorch(), 1 << 30).unwrap();
    assert_eq!((&trace, o.peak_reserved), (t, 42 * MIB));
}

#[test]
fn protocol_5_gzipped_and_one_device() {
    let (path, opcodes) = write_snapshot("snapshot-5.pickle.gz", 5, true);
    assert!(opcodes.iter().any(|o| o == "FRAME"), "{opcodes:?}");
    let all = load(&path, None).unwrap();
    let one = load(&path, Some(1)).unwrap();
    assert_eq!(one.len(), 1);
    // Only one device chosen: the name still says which.
    assert_eq!(one[0].name, "snapshot-5.pickle.gz:device 1");
    assert_eq!(one[0].events, all[1].events);
    let e = load(&path, Some(3)).unwrap_err();
    assert!(e.contains("device 3 has no trace entries") && e.contains("devices with some: 0, 1"), "{e}");
}

#[test]
fn a_pickle_that_is_not_a_snapshot_is_refused() {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("not-a-snapshot.pickle");
    let out = Command::new("python3")
        .args(["-c", "import pickle,sys; pickle.dump([1, 2], open(sys.argv[1], 'wb'), protocol=4)"])
        .arg(&path)
        .status()
        .expect("python3 is needed: install it");
    assert!(out.success());
    let e = load(&path, None).unwrap_err();
    assert!(e.starts_with("not-a-snapshot.pickle: not a PyTorch memory snapshot"), "{e}");
}
