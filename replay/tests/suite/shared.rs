//! Snapshots whose objects are shared as PyTorch shares them, written by CPython's `pickle`
//! (python3 must be installed) in every protocol, with and without `FRAME`:
//! each object is written once and referred to after through the pickle's memo.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpupool_replay::Event::{Alloc, Free};
use gpupool_replay::Recorded;
use gpupool_replay::input::load;

const MIB: usize = 1 << 20;

/// Writes the snapshot with the protocol of argv[2] (0 and 1, the text opcodes and the first
/// binary ones, behind a `PROTO 2` as a later pickle may hold them), `FRAME`s kept when argv[3] is `frame`
/// (taken out otherwise: the pickle stays valid, a frame being only a length), gzipped when
/// argv[4] is `gz`. Prints the names of the opcodes used.
///
/// As `torch/csrc/cuda/Module.cpp` builds it: each key and each action or state string is one
/// Python object (`py::str alloc_s = "alloc"`) used by every dict; `py_symbolize` makes one
/// dict per distinct frame and one list per distinct traceback, shared by every block and
/// entry with that traceback; entries without one share one empty list. The segments come
/// first, so the shared lists are first written inside a block and referred to by the
/// entries; a frame is in several tracebacks. A string the replay reads (the action `alloc`)
/// is first written inside a shared frame (a function called alloc: in CPython the name of a
/// function and a string constant of the same text are one interned object). An entry's
/// `user_metadata` holds a list that holds itself.
const WRITER: &str = r#"
import gzip, pickle, pickletools, sys
proto, keep_frames, gz = int(sys.argv[2]), sys.argv[3] == 'frame', sys.argv[4] == 'gz'
MiB = 1 << 20
A = 0x7f0000000000
def s(text):
    return ''.join(list(text))  # a str object of its own, not the code's interned constant
K = {k: s(k) for k in ['action', 'addr', 'size', 'stream', 'time_us', 'frames', 'device', 'address',
     'total_size', 'blocks', 'state', 'requested_size', 'allocated_size', 'active_size',
     'segment_type', 'segment_pool_id', 'is_expandable', 'user_metadata', 'filename', 'line',
     'name', 'PYTORCH_CUDA_ALLOC_CONF', 'segments', 'device_traces', 'allocator_settings']}
alloc, free_requested, free_completed, segment_alloc = (s(a) for a in
    ['alloc', 'free_requested', 'free_completed', 'segment_alloc'])
active_allocated, inactive, large = s('active_allocated'), s('inactive'), s('large')
model = s('model.py')
f1 = {K['filename']: model, K['line']: 10, K['name']: alloc}
f2 = {K['filename']: model, K['line']: 20, K['name']: s('forward')}
tb1, tb2, tb3, empty_frames = [f1, f2], [f1], [f2, f1], []
loop = []
loop.append(loop)
t = 0
def e(action, addr, size, frames):
    global t
    t += 1
    return {K['action']: action, K['addr']: addr, K['size']: size, K['stream']: 0, K['time_us']: t,
            K['frames']: frames, K['user_metadata']: loop if t == 2 else s('')}
def block(addr, size, requested, state, frames):
    return {K['address']: addr, K['size']: size, K['requested_size']: requested, K['state']: state,
            K['frames']: frames}
segment = {K['device']: 0, K['address']: A, K['total_size']: 20 * MiB, K['stream']: 0,
           K['segment_type']: large, K['segment_pool_id']: (0, 0), K['allocated_size']: 3 * MiB,
           K['active_size']: 3 * MiB, K['requested_size']: 3 * MiB, K['is_expandable']: False,
           K['frames']: empty_frames,
           K['blocks']: [block(A, 2 * MiB, 2 * MiB, active_allocated, tb1),
                         block(A + 2 * MiB, 2 * MiB, 0, inactive, tb2),
                         block(A + 4 * MiB, MiB, MiB, active_allocated, tb3),
                         block(A + 5 * MiB, 15 * MiB, 0, inactive, tb2)]}
trace = [e(segment_alloc, A, 20 * MiB, empty_frames),
         e(alloc, A, 3 * MiB, tb1),
         e(alloc, A + 4 * MiB, MiB, tb3),
         e(free_requested, A, 3 * MiB, tb1),
         e(free_completed, A, 3 * MiB, tb1),
         e(alloc, A, 2 * MiB, tb1)]
snapshot = {K['segments']: [segment], K['device_traces']: [trace],
            K['allocator_settings']: {K['PYTORCH_CUDA_ALLOC_CONF']: s('')}}
data = pickle.dumps(snapshot, protocol=proto)
if proto < 2:
    data = b'\x80\x02' + data  # the text and early opcodes, behind the PROTO the reader looks for
if not keep_frames:
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    data = b''.join(data[pos:end] for (op, _, pos), end in zip(ops, ends) if op.name != 'FRAME')
    assert pickle.loads(data)[K['segments']] == snapshot[K['segments']]
with (gzip.open if gz else open)(sys.argv[1], 'wb') as f:
    f.write(data)
print(' '.join(sorted({op.name for op, _, _ in pickletools.genops(data)})))
"#;

fn write(protocol: u8, frames: bool, gz: bool) -> (PathBuf, Vec<String>) {
    let name =
        format!("shared-{protocol}{}.pickle{}", if frames { "-framed" } else { "" }, if gz { ".gz" } else { "" });
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let out = Command::new("python3")
        .args(["-c", WRITER, path.to_str().unwrap(), &protocol.to_string()])
        .args([if frames { "frame" } else { "none" }, if gz { "gz" } else { "raw" }])
        .output()
        .expect("python3 is needed to write the snapshot (CPython's pickle): install it");
    assert!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    (path, String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect())
}

#[test]
fn shared_objects_read_the_same_in_every_protocol() {
    let mut cases = vec![(0, false, false), (1, false, false), (2, false, false), (3, false, true)];
    for p in [4, 5] {
        cases.extend([(p, true, false), (p, false, false), (p, true, true)]);
    }
    for (protocol, frames, gz) in cases {
        let (path, ops) = write(protocol, frames, gz);
        let has = |op: &str| ops.iter().any(|o| o == op);
        // The memo is used: objects put (BINPUT before protocol 4, MEMOIZE from it) and got.
        let (put, get) = match protocol {
            0 => ("PUT", "GET"),
            1..=3 => ("BINPUT", "BINGET"),
            _ => ("MEMOIZE", "BINGET"),
        };
        assert!(has(put) && has(get), "{protocol}: {ops:?}");
        assert_eq!(has("FRAME"), frames, "{protocol}: {ops:?}");
        let traces = load(&path, None).unwrap_or_else(|e| panic!("protocol {protocol}, frames {frames}: {e}"));
        assert_eq!(traces.len(), 1);
        let t = &traces[0];
        assert_eq!(
            t.events,
            vec![
                Alloc { id: 0, size: 3 * MIB, stream: 0 },
                Alloc { id: 1, size: MIB, stream: 0 },
                Free { id: 0 },
                Alloc { id: 2, size: 2 * MIB, stream: 0 },
            ],
            "protocol {protocol}"
        );
        assert_eq!(t.streams, vec![0]);
        // Both blocks alive at the end are the trace's own: nothing to repair.
        assert!(t.notes.is_empty(), "protocol {protocol}: {:?}", t.notes);
        assert_eq!(
            t.recorded,
            Some(Recorded { peak_reserved: 20 * MIB, device_allocs: 1, ooms: 0, conf: Some(String::new()) }),
            "protocol {protocol}"
        );
    }
}
