//! Annotated snapshots (issue 43): a thread's metadata on the events it records (PyTorch
//! `_set_memory_metadata`, `user_metadata`), `annotate` events of live blocks (PyTorch
//! `_annotate_memory`), and snapshots without traces (PyTorch `include_traces=False`), each
//! read back by CPython's pickle; the C calls' checks; threads annotating while others free.
use crate::common;

use std::ffi::{CStr, CString, c_char};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::history::{python_reads, record_all, snapshot_agrees};
use common::{MIB, sim, xorshift};
use gpupool::error::Error;
use gpupool::ffi::history::{
    GPUPOOL_MEMORY_METADATA_MAX, gpupool_annotate_memory, gpupool_get_memory_metadata, gpupool_set_memory_metadata,
};
use gpupool::ffi::status::gpupool_last_error_message;
use gpupool::ffi::status::gpupool_status::{self, GPUPOOL_ERROR_INVALID_VALUE, GPUPOOL_SUCCESS};
use gpupool::history::{Action, HistoryContext, Snapshot, TraceEntry, metadata};

const S: usize = 0x10;

fn meta(e: &TraceEntry) -> Option<&str> {
    e.user_metadata.as_deref()
}

fn trace(snap: &Snapshot) -> &[TraceEntry] {
    &snap.device_traces[0]
}

/// CPython's view of the events: each one's action, address and `user_metadata` (None when
/// the key is absent), and the metadata parsed as JSON where it is an object.
const EVENTS: &str = r#"
import json, pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
got = [[e["action"], e["addr"], e.get("user_metadata")] for e in s["device_traces"][0]]
want = json.loads(sys.argv[2])
assert got == want, (got, want)
for e in s["device_traces"][0]:
    m = e.get("user_metadata")
    if m and m.startswith("{"):
        json.loads(m)
print("ok")
"#;

fn python_events(snap: &Snapshot) {
    let want: Vec<serde_json::Value> = trace(snap)
        .iter()
        .map(|e| {
            let addr = if e.action == Action::Oom { serde_json::Value::Null } else { e.addr.into() };
            serde_json::json!([e.action.name(), addr, meta(e)])
        })
        .collect();
    python_reads(&snap.to_pickle(), EVENTS, &[&serde_json::Value::from(want).to_string()]);
}

#[test]
fn a_threads_metadata_rides_on_the_events_it_records() {
    let (a, _drv) = sim(1, 256 * MIB);
    record_all(&a, HistoryContext::State);
    let step = r#"{"step":1,"phase":"forward"}"#;
    metadata::set(step).unwrap();
    let p = a.malloc(MIB, 0, S).unwrap();
    // Another thread's events carry its own metadata, not this one's.
    std::thread::scope(|t| {
        t.spawn(|| {
            assert_eq!(metadata::get(), "");
            metadata::set("worker").unwrap();
            let q = a.malloc(4096, 0, S).unwrap();
            a.free(q).unwrap();
        });
    });
    metadata::set("").unwrap();
    a.free(p).unwrap();
    let snap = snapshot_agrees(&a, true);
    let got: Vec<(&str, Option<&str>)> = trace(&snap).iter().map(|e| (e.action.name(), meta(e))).collect();
    assert_eq!(
        got,
        [
            ("segment_alloc", Some(step)),
            ("alloc", Some(step)),
            ("alloc", Some("worker")),
            ("free_requested", Some("worker")),
            ("free_completed", Some("worker")),
            ("free_requested", None),
            ("free_completed", None),
            ("snapshot", None),
        ]
    );
    // One string shared by the events of one setting, written once in the pickle.
    let a0 = trace(&snap)[0].user_metadata.as_ref().unwrap();
    assert!(Arc::ptr_eq(a0, trace(&snap)[1].user_metadata.as_ref().unwrap()));
    let pickle = snap.to_pickle();
    assert_eq!(pickle.windows(step.len()).filter(|w| *w == step.as_bytes()).count(), 1);
    python_events(&snap);
}

#[test]
fn annotations_are_events_of_live_blocks() {
    let (a, _drv) = sim(1, 256 * MIB);
    record_all(&a, HistoryContext::All);
    metadata::set("thread's").unwrap();
    let p = a.malloc(3000, 0, S).unwrap();
    a.annotate_memory(p, "retained by autograd").unwrap();
    a.annotate_memory(p, r#"{"owner": "kv-cache", "layer": 3}"#).unwrap();
    // Refused, recording nothing: inside the block, never gpupool's, bad metadata.
    assert!(matches!(a.annotate_memory(p + 512, "x"), Err(Error::InvalidPointer(m)) if m.contains("inside a block")));
    assert!(matches!(a.annotate_memory(0xdead_0000, "x"), Err(Error::InvalidPointer(_))));
    assert!(matches!(a.annotate_memory(p, "{oops"), Err(Error::InvalidValue(m)) if m.contains("JSON")));
    let big = "a".repeat(GPUPOOL_MEMORY_METADATA_MAX + 1);
    assert!(matches!(a.annotate_memory(p, &big), Err(Error::InvalidValue(m)) if m.contains("bytes")));
    a.free(p).unwrap();
    assert!(matches!(a.annotate_memory(p, "late"), Err(Error::InvalidPointer(m)) if m.contains("freed")));
    metadata::set("").unwrap();
    let snap = snapshot_agrees(&a, true);
    let notes: Vec<&TraceEntry> = trace(&snap).iter().filter(|e| e.action == Action::Annotate).collect();
    assert_eq!(notes.len(), 2);
    for n in &notes {
        assert_eq!((n.addr, n.size, n.stream), (p, 3000, S), "the block's address, requested size, stream");
        assert!(!n.frames.is_empty(), "the annotation site's stack, at context all");
    }
    assert_eq!(meta(notes[0]), Some("retained by autograd"));
    assert_eq!(meta(notes[1]), Some(r#"{"owner": "kv-cache", "layer": 3}"#));
    let alloc = trace(&snap).iter().find(|e| e.action == Action::Alloc).unwrap();
    assert_eq!(meta(alloc), Some("thread's"), "the allocation's own metadata is untouched");
    python_events(&snap);
}

#[test]
fn annotations_take_stacks_only_from_context_alloc() {
    let (a, _drv) = sim(1, 256 * MIB);
    record_all(&a, HistoryContext::State);
    let p = a.malloc(4096, 0, S).unwrap();
    a.annotate_memory(p, "n").unwrap();
    let snap = a.snapshot().unwrap();
    let n = trace(&snap).iter().find(|e| e.action == Action::Annotate).unwrap();
    assert!(n.frames.is_empty(), "PyTorch's events carry stacks from context alloc on");
    a.free(p).unwrap();
}

#[test]
fn with_history_off_annotations_are_checked_and_not_recorded() {
    let (a, _drv) = sim(1, 256 * MIB);
    let p = a.malloc(4096, 0, S).unwrap();
    a.annotate_memory(p, "n").unwrap();
    assert!(matches!(a.annotate_memory(p + 8, "n"), Err(Error::InvalidPointer(_))));
    metadata::set("m").unwrap();
    let q = a.malloc(4096, 0, S).unwrap();
    metadata::set("").unwrap();
    a.free(p).unwrap();
    assert!(matches!(a.annotate_memory(p, "n"), Err(Error::InvalidPointer(_))));
    let snap = a.snapshot().unwrap();
    assert!(snap.device_traces.iter().all(Vec::is_empty));
    a.free(q).unwrap();
}

#[test]
fn threads_annotate_while_others_free() {
    // Two threads allocate and free at random, two annotate the blocks handed out lately, freed
    // or not: every
    // annotation is either refused (freed meanwhile) or recorded before its block's free, which
    // the replay of the trace checks (an annotation of a block not live fails it).
    let (a, _drv) = sim(1, 256 * MIB);
    record_all(&a, HistoryContext::None);
    let live: parking_lot::Mutex<Vec<u64>> = parking_lot::Mutex::new(Vec::new());
    // The last 64 addresses handed out, freed or not: what the annotating threads aim at.
    let recent: parking_lot::Mutex<std::collections::VecDeque<u64>> = Default::default();
    let done = AtomicBool::new(false);
    let (mut ok, mut refused) = (0, 0);
    std::thread::scope(|t| {
        let allocating: Vec<_> = (1..=2u64)
            .map(|seed| {
                let (a, live, recent) = (&a, &live, &recent);
                t.spawn(move || {
                    let mut r = seed;
                    for _ in 0..4000 {
                        if xorshift(&mut r) % 2 == 0 || live.lock().len() < 4 {
                            let p = a.malloc(512 + (xorshift(&mut r) % 8192) as usize, 0, S).unwrap();
                            live.lock().push(p);
                            let mut r = recent.lock();
                            r.push_back(p);
                            if r.len() > 64 {
                                r.pop_front();
                            }
                        } else {
                            let p = {
                                let mut l = live.lock();
                                let i = (xorshift(&mut r) as usize) % l.len();
                                l.swap_remove(i)
                            };
                            a.free(p).unwrap();
                        }
                    }
                })
            })
            .collect();
        let workers: Vec<_> = (0..2u64)
            .map(|seed| {
                let (a, recent, done) = (&a, &recent, &done);
                t.spawn(move || {
                    let (mut ok, mut refused, mut r) = (0, 0, seed + 7);
                    // Bounded, so that the trace keeps every event for the replay.
                    for _ in 0..50_000 {
                        if done.load(Ordering::Relaxed) {
                            break;
                        }
                        let p = {
                            let l = recent.lock();
                            if l.is_empty() { continue } else { l[(xorshift(&mut r) as usize) % l.len()] }
                        };
                        match a.annotate_memory(p, "seen") {
                            Ok(()) => ok += 1,
                            Err(Error::InvalidPointer(_)) => refused += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    (ok, refused)
                })
            })
            .collect();
        // The allocating threads finish, then the annotating ones stop.
        for h in allocating {
            h.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        for w in workers {
            let (o, f) = w.join().unwrap();
            ok += o;
            refused += f;
        }
    });
    let snap = snapshot_agrees(&a, true);
    let recorded = trace(&snap).iter().filter(|e| e.action == Action::Annotate).count();
    assert_eq!(recorded, ok, "every accepted annotation recorded, no refused one");
    eprintln!("annotations: {ok} recorded, {refused} refused (freed meanwhile)");
    for p in live.into_inner() {
        a.free(p).unwrap();
    }
}

#[test]
fn a_snapshot_without_traces_has_the_segments_and_no_events() {
    let (a, _drv) = sim(2, 256 * MIB);
    record_all(&a, HistoryContext::All);
    let ps: Vec<u64> = (0..50).map(|i| a.malloc(1000 * (i + 1), 0, S).unwrap()).collect();
    let q = a.malloc(MIB, 1, S).unwrap();
    for p in ps.iter().step_by(3) {
        a.free(*p).unwrap();
    }
    let lite = a.snapshot_with(false).unwrap();
    let full = a.snapshot().unwrap();
    assert_eq!(lite.device_traces.len(), full.device_traces.len(), "one list per device");
    assert!(lite.device_traces.iter().all(Vec::is_empty));
    let shape = |s: &Snapshot| -> Vec<_> {
        s.segments
            .iter()
            .map(|g| {
                let blocks: Vec<_> =
                    g.blocks.iter().map(|b| (b.address, b.size, b.requested_size, b.state, b.frames.len())).collect();
                (g.device, g.address, g.total_size, g.allocated_size, blocks)
            })
            .collect()
    };
    assert_eq!(shape(&lite), shape(&full), "the same segments, blocks and stacks");
    // The history went on: the snapshot without traces recorded its `snapshot` event.
    let snaps = trace(&full).iter().filter(|e| e.action == Action::Snapshot).count();
    assert_eq!(snaps, 2);
    python_reads(
        &lite.to_pickle(),
        "import pickle, sys\ns = pickle.load(open(sys.argv[1], 'rb'))\n\
         assert s['device_traces'] == [[], []], s['device_traces']\n\
         assert sum(len(g['blocks']) for g in s['segments']) == int(sys.argv[2])\nprint('ok')",
        &[&lite.segments.iter().map(|g| g.blocks.len()).sum::<usize>().to_string()],
    );
    for (i, p) in ps.iter().enumerate() {
        if i % 3 != 0 {
            a.free(*p).unwrap();
        }
    }
    a.free(q).unwrap();
}

fn last_error() -> String {
    // SAFETY: the thread's message, NUL-terminated, valid until its next failing call.
    unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy().into_owned()
}

fn get_c() -> String {
    let mut needed = 0usize;
    // SAFETY: NULL buffer, a valid out-pointer.
    assert_eq!(unsafe { gpupool_get_memory_metadata(std::ptr::null_mut(), 0, &mut needed) }, GPUPOOL_SUCCESS);
    let mut buf = vec![0 as c_char; needed];
    // SAFETY: a buffer of `needed` bytes.
    let st = unsafe { gpupool_get_memory_metadata(buf.as_mut_ptr(), buf.len(), &mut needed) };
    assert_eq!(st, GPUPOOL_SUCCESS);
    // SAFETY: NUL-terminated by the call.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

fn set_c(bytes: &[u8]) -> gpupool_status {
    let c = CString::new(bytes).unwrap();
    // SAFETY: NUL-terminated.
    unsafe { gpupool_set_memory_metadata(c.as_ptr()) }
}

#[test]
fn the_c_calls_refuse_bad_metadata_and_keep_the_old() {
    assert_eq!(set_c(br#"{"rank": 0}"#), GPUPOOL_SUCCESS);
    assert_eq!(get_c(), r#"{"rank": 0}"#);
    let refused: [(&[u8], &str); 4] = [
        (b"label \xc3(", "not UTF-8: byte 6"),
        (b"[1, 2", "not valid JSON"),
        (b"  {\"a\": }", "line 1 column"),
        (&[b'x'; GPUPOOL_MEMORY_METADATA_MAX + 1], "more than the 65536 bytes"),
    ];
    for (bytes, why) in refused {
        assert_eq!(set_c(bytes), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(last_error().contains(why), "{why}: {}", last_error());
        assert_eq!(get_c(), r#"{"rank": 0}"#, "a refused setting changes nothing");
    }
    assert_eq!(set_c(&[b'x'; GPUPOOL_MEMORY_METADATA_MAX]), GPUPOOL_SUCCESS, "the limit itself");
    // SAFETY: NULL clears.
    assert_eq!(unsafe { gpupool_set_memory_metadata(std::ptr::null()) }, GPUPOOL_SUCCESS);
    assert_eq!(get_c(), "");
    // The buffer convention: too small is refused, the buffer untouched.
    assert_eq!(set_c(b"abc"), GPUPOOL_SUCCESS);
    let (mut buf, mut needed) = ([7 as c_char; 3], 0usize);
    // SAFETY: a buffer of 3 bytes.
    let st = unsafe { gpupool_get_memory_metadata(buf.as_mut_ptr(), 3, &mut needed) };
    assert_eq!((st, needed, buf), (GPUPOOL_ERROR_INVALID_VALUE, 4, [7; 3]));
    // SAFETY: both NULL, refused.
    let st = unsafe { gpupool_get_memory_metadata(std::ptr::null_mut(), 0, std::ptr::null_mut()) };
    assert_eq!(st, GPUPOOL_ERROR_INVALID_VALUE);
    // An annotation's text is checked before anything else (no allocator is needed for that).
    // SAFETY: NULL metadata, refused; then a non-UTF-8 one.
    assert_eq!(unsafe { gpupool_annotate_memory(8 as _, std::ptr::null()) }, GPUPOOL_ERROR_INVALID_VALUE);
    let bad = CString::new(&b"\xff"[..]).unwrap();
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { gpupool_annotate_memory(8 as _, bad.as_ptr()) }, GPUPOOL_ERROR_INVALID_VALUE);
    assert!(last_error().contains("not UTF-8"), "{}", last_error());
    assert_eq!(set_c(b""), GPUPOOL_SUCCESS);
}
