//! The outside red team of snapshot metadata (issue 43): hostile text in metadata and
//! annotations (quotes, control characters, NUL, multibyte text across the pickle's
//! short-string bound, the 64 KiB limit in 4-byte characters), read back exactly by CPython's
//! pickle; deep and odd JSON; invalid UTF-8 through C; threads setting metadata while another
//! takes snapshots; the C calls' buffers and the snapshot file's errors.

use crate::common;

use std::ffi::{CStr, CString, c_char};
use std::sync::atomic::{AtomicBool, Ordering};

use common::history::{python_reads, record_all, snapshot_agrees};
use common::{MIB, last_error, sim, xorshift};
use gpupool::error::Error;
use gpupool::ffi::history::{GPUPOOL_MEMORY_METADATA_MAX, gpupool_get_memory_metadata, gpupool_set_memory_metadata};
use gpupool::ffi::status::gpupool_status::{GPUPOOL_ERROR_INVALID_VALUE, GPUPOOL_SUCCESS};
use gpupool::history::{Action, HistoryContext, Snapshot, metadata};

const S: usize = 0x10;

/// CPython reads the pickle and compares every event's `user_metadata` with the JSON list in
/// the file argv[2] (None where absent), exactly, character for character.
const SAME_TEXT: &str = r#"
import json, pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
got = [e.get("user_metadata") for e in s["device_traces"][0]]
want = json.load(open(sys.argv[2], encoding="utf-8"))
assert len(got) == len(want), (len(got), len(want))
for i, (g, w) in enumerate(zip(got, want)):
    assert g == w, (i, repr(g)[:200], repr(w)[:200])
print("ok")
"#;

/// CPython's pickle reads `snap` and finds each event's metadata exactly as recorded.
fn python_same_text(snap: &Snapshot) {
    let want: Vec<Option<&str>> = snap.device_traces[0].iter().map(|e| e.user_metadata.as_deref()).collect();
    let path = std::env::temp_dir().join(format!(
        "gpupool-hostile-{}-{:?}.json",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, serde_json::to_string(&want).unwrap()).unwrap();
    python_reads(&snap.to_pickle(), SAME_TEXT, &[path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
}

/// Text that breaks naive writers: quotes, backslashes, control characters, NUL, line and
/// paragraph separators, a pickle opcode's bytes, a key of the snapshot's own, multibyte text
/// whose character count is under the short string's 256 and its bytes over, and the limit
/// itself in 4-byte characters.
fn hostile_texts() -> Vec<String> {
    vec![
        r#"he said "stop" \ then \" and '"#.to_string(),
        "tab\tnewline\ncr\rbell\x07esc\x1b[31mred del\x7f".to_string(),
        "nul\0inside".to_string(),
        "\u{2028}\u{2029}\u{feff}bom".to_string(),
        "\u{80}\u{94}\u{95}.".to_string(),
        "action".to_string(),
        "é".repeat(128),
        "€".repeat(85) + "x",
        "😀".repeat(64),
        "😀".repeat(GPUPOOL_MEMORY_METADATA_MAX / 4),
        r#"{"k":"}\"]","n":null,"a":[1,2.5e300,-0,true],"u":"\u0000\ud83d\ude00"}"#.to_string(),
        "[\"\\u2028\"]".to_string(),
        "}{ not json, not checked".to_string(),
    ]
}

#[test]
fn hostile_text_reaches_cpython_exactly() {
    let (a, _drv) = sim(1, 256 * MIB);
    record_all(&a, HistoryContext::None);
    let texts = hostile_texts();
    let mut live = Vec::new();
    for t in &texts {
        metadata::set(t).unwrap_or_else(|e| panic!("{:?}: {e}", &t[..t.len().min(40)]));
        let p = a.malloc(4096, 0, S).unwrap();
        a.annotate_memory(p, t).unwrap();
        live.push(p);
    }
    metadata::set("").unwrap();
    let snap = snapshot_agrees(&a, true);
    let notes: Vec<&str> = snap.device_traces[0]
        .iter()
        .filter(|e| e.action == Action::Annotate)
        .map(|e| e.user_metadata.as_deref().unwrap())
        .collect();
    assert_eq!(notes, texts.iter().map(String::as_str).collect::<Vec<_>>());
    python_same_text(&snap);
    for p in live {
        a.free(p).unwrap();
    }
}

#[test]
fn the_limit_counts_bytes_of_utf8_and_json_must_parse() {
    let max = GPUPOOL_MEMORY_METADATA_MAX;
    // At the limit in 2-, 3- and 4-byte characters; one byte over, a character cut in none.
    assert!(metadata::check("é".repeat(max / 2).as_bytes()).is_ok());
    assert!(metadata::check(("a".repeat(max - 3) + "€").as_bytes()).is_ok());
    let over = "a".repeat(max - 1) + "é";
    assert!(matches!(metadata::check(over.as_bytes()), Err(Error::InvalidValue(m)) if m.contains("65537")));
    // What is not JSON fails, whatever the reason.
    for bad in ["{\"a\":1}}", "[1,]", "{'a':1}", "[NaN]", "{\"a\":1} trailing", "[\"\\ud800\"]x"] {
        assert!(matches!(metadata::check(bad.as_bytes()), Err(Error::InvalidValue(m)) if m.contains("JSON")), "{bad}");
    }
    // A lone surrogate escape is valid JSON text (RFC 8259's grammar; Python's json reads it,
    // and json.dumps writes it for a lone surrogate); serde_json's `Value` refused it.
    assert!(metadata::check(br#"["\ud800"]"#).is_ok());
}

/// Valid JSON nested deeper than serde_json's `Value` reads (128 levels) is JSON all the same
/// (it was refused, "recursion limit exceeded", though the contract takes any valid JSON);
/// nesting to the 64 KiB limit is checked without a deep stack, and refused when unclosed.
#[test]
fn deep_but_valid_json_is_accepted() {
    let deep = |n: usize| "[".repeat(n) + &"]".repeat(n);
    for n in [129, 200, GPUPOOL_MEMORY_METADATA_MAX / 2] {
        assert!(metadata::check(deep(n).as_bytes()).is_ok(), "{n}: {:?}", metadata::check(deep(n).as_bytes()));
    }
    let unclosed = "[{\"a\":".repeat(GPUPOOL_MEMORY_METADATA_MAX / 6);
    assert!(matches!(metadata::check(unclosed.as_bytes()), Err(Error::InvalidValue(m)) if m.contains("JSON")));
    // Run on a small stack: the check must not recurse a level at a time.
    std::thread::Builder::new()
        .stack_size(64 * 1024)
        .spawn(move || assert!(metadata::check(deep(GPUPOOL_MEMORY_METADATA_MAX / 2).as_bytes()).is_ok()))
        .unwrap()
        .join()
        .unwrap();
}

/// Text that starts with a `{` or `[` only after Unicode white space that JSON does not count
/// as white space (NBSP, the ideographic space) is a label, not JSON.
#[test]
fn only_json_white_space_makes_a_label_json() {
    for label in ["\u{a0}[draft] step 3", "\u{3000}{not json}", "\u{2003}["] {
        assert!(metadata::check(label.as_bytes()).is_ok(), "{label:?}: {:?}", metadata::check(label.as_bytes()));
    }
    for json_ws in [" \t\r\n{\"a\":1}", "\n[1]"] {
        assert!(metadata::check(json_ws.as_bytes()).is_ok());
    }
    assert!(metadata::check(b" \n{oops").is_err());
}

fn set_c(bytes: &[u8]) -> gpupool::ffi::status::gpupool_status {
    let c = CString::new(bytes).unwrap();
    // SAFETY: NUL-terminated.
    unsafe { gpupool_set_memory_metadata(c.as_ptr()) }
}

#[test]
fn invalid_utf8_through_c_is_refused_at_its_offset_and_buffers_are_exact() {
    assert_eq!(set_c(b"kept"), GPUPOOL_SUCCESS);
    let bad: [(&[u8], usize); 6] = [
        (b"\xc0\x80", 0),
        (b"ab\xed\xa0\x80", 2),
        (b"abc\xe2\x82", 3),
        (b"\xf5\x80\x80\x80", 0),
        (b"ok\xff", 2),
        (b"\xef\xbf", 0),
    ];
    for (bytes, at) in bad {
        assert_eq!(set_c(bytes), GPUPOOL_ERROR_INVALID_VALUE, "{bytes:?}");
        assert!(last_error().contains(&format!("byte {at} ")), "{bytes:?}: {}", last_error());
    }
    // The buffer convention at its edges: exactly `needed`, one short, zero, `needed` NULL.
    let text = "é".repeat(GPUPOOL_MEMORY_METADATA_MAX / 2);
    assert_eq!(set_c(text.as_bytes()), GPUPOOL_SUCCESS);
    let mut needed = 0usize;
    // SAFETY: NULL buffer, a writable `needed`.
    assert_eq!(unsafe { gpupool_get_memory_metadata(std::ptr::null_mut(), 0, &mut needed) }, GPUPOOL_SUCCESS);
    assert_eq!(needed, GPUPOOL_MEMORY_METADATA_MAX + 1);
    let mut buf = vec![1 as c_char; needed];
    // SAFETY: `needed - 1` writable bytes of the buffer.
    let st = unsafe { gpupool_get_memory_metadata(buf.as_mut_ptr(), needed - 1, &mut needed) };
    assert_eq!(st, GPUPOOL_ERROR_INVALID_VALUE);
    assert!(buf.iter().all(|&b| b == 1), "a buffer too small is left untouched");
    // SAFETY: 0 bytes of a real buffer: too small, untouched.
    assert_eq!(unsafe { gpupool_get_memory_metadata(buf.as_mut_ptr(), 0, &mut needed) }, GPUPOOL_ERROR_INVALID_VALUE);
    // SAFETY: a buffer of `needed` bytes, `needed` itself NULL.
    let st = unsafe { gpupool_get_memory_metadata(buf.as_mut_ptr(), buf.len(), std::ptr::null_mut()) };
    assert_eq!(st, GPUPOOL_SUCCESS);
    // SAFETY: NUL-terminated by the call.
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), text);
    assert_eq!(set_c(b""), GPUPOOL_SUCCESS);
}

/// Eight threads set metadata (clearing it, the 64 KiB limit, JSON) and allocate while the
/// test's thread takes snapshots: every event carries one of the strings its thread set, the
/// traces replay, and CPython reads the last snapshot.
#[test]
fn threads_set_metadata_while_snapshots_are_taken() {
    let (a, _drv) = sim(1, 512 * MIB);
    record_all(&a, HistoryContext::None);
    let texts: Vec<String> = vec![
        String::new(),
        "x".repeat(GPUPOOL_MEMORY_METADATA_MAX),
        r#"{"phase":"fwd","q":"\""}"#.into(),
        "😀\"\n".into(),
    ];
    let done = AtomicBool::new(false);
    std::thread::scope(|t| {
        let workers: Vec<_> = (0..8u64)
            .map(|seed| {
                let (a, texts) = (&a, &texts);
                t.spawn(move || {
                    let mut r = seed + 1;
                    for _ in 0..1500 {
                        metadata::set(&texts[(xorshift(&mut r) % 4) as usize]).unwrap();
                        let p =
                            a.malloc(512 + (xorshift(&mut r) % 65536) as usize, 0, S + (seed as usize % 3)).unwrap();
                        if xorshift(&mut r) % 3 == 0 {
                            a.annotate_memory(p, &texts[(xorshift(&mut r) % 3 + 1) as usize]).unwrap();
                        }
                        a.free(p).unwrap();
                    }
                    metadata::set("").unwrap();
                })
            })
            .collect();
        let mut n = 0;
        while !done.load(Ordering::Relaxed) {
            let snap = a.snapshot().unwrap();
            for e in &snap.device_traces[0] {
                if let Some(m) = e.user_metadata.as_deref() {
                    assert!(texts[1..].iter().any(|t| t == m), "a string no thread set: {:?}", &m[..m.len().min(40)]);
                }
            }
            n += 1;
            if workers.iter().all(|w| w.is_finished()) {
                done.store(true, Ordering::Relaxed);
            }
        }
        eprintln!("{n} snapshots taken meanwhile");
    });
    let snap = snapshot_agrees(&a, true);
    python_same_text(&snap);
}

/// Through C, in a process of its own (the process-wide allocator on the simulated device):
/// `gpupool_dump_snapshot_with` refuses a NULL and an unwritable path, naming it, and takes
/// any nonzero `include_traces`; annotations at the limit and of freed or foreign pointers;
/// CPython reads the file, the hostile annotation exactly.
#[test]
fn the_snapshot_file_through_c() {
    use gpupool::ffi::history::{gpupool_annotate_memory, gpupool_dump_snapshot_with, gpupool_record_history};
    use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
    use gpupool::ffi::status::gpupool_status::GPUPOOL_ERROR_INVALID_POINTER;
    if !common::process::alone() {
        return;
    }
    // SAFETY: before any other thread of this process reads the environment.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "256MiB");
        std::env::set_var("GPUPOOL_SIM_DEVICES", "2");
    }
    // SAFETY: NULL path, refused before anything starts.
    assert_eq!(unsafe { gpupool_dump_snapshot_with(std::ptr::null(), 1) }, GPUPOOL_ERROR_INVALID_VALUE);
    assert_eq!(gpupool_record_history(1, 1 << 16, 0), GPUPOOL_SUCCESS, "{}", last_error());
    let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: writable storage for one pointer.
    assert_eq!(unsafe { gpupool_malloc(&mut p, 5000, 1, 0x20 as _) }, GPUPOOL_SUCCESS, "{}", last_error());
    let note = "\"}]\u{1}\n'ab".to_string() + &"😀".repeat(GPUPOOL_MEMORY_METADATA_MAX / 4 - 2);
    assert_eq!(note.len(), GPUPOOL_MEMORY_METADATA_MAX);
    let c = CString::new(note.clone()).unwrap();
    // SAFETY: NUL-terminated; a live block, then foreign and NULL pointers.
    unsafe {
        assert_eq!(gpupool_annotate_memory(p, c.as_ptr()), GPUPOOL_SUCCESS, "{}", last_error());
        assert_eq!(gpupool_annotate_memory(std::ptr::null_mut(), c"x".as_ptr()), GPUPOOL_ERROR_INVALID_POINTER);
        assert_eq!(gpupool_annotate_memory(p.cast::<u8>().add(1).cast(), c"x".as_ptr()), GPUPOOL_ERROR_INVALID_POINTER);
    }
    let dir = std::env::temp_dir().join(format!("gpupool-hostile-{}", std::process::id()));
    let bad = CString::new(dir.join("missing/snap.pickle").to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated paths.
    unsafe {
        assert_eq!(gpupool_dump_snapshot_with(bad.as_ptr(), -1), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(last_error().contains("missing/snap.pickle"), "{}", last_error());
        std::fs::create_dir_all(&dir).unwrap();
        let good = CString::new(dir.join("snap.pickle").to_str().unwrap()).unwrap();
        assert_eq!(gpupool_dump_snapshot_with(good.as_ptr(), -1), GPUPOOL_SUCCESS, "{}", last_error());
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_annotate_memory(p, c"late".as_ptr()), GPUPOOL_ERROR_INVALID_POINTER);
    }
    let want = dir.join("want.json");
    std::fs::write(&want, serde_json::to_string(&note).unwrap()).unwrap();
    let out = std::process::Command::new("python3")
        .args(["-c", "import json, pickle, sys\ns = pickle.load(open(sys.argv[1], 'rb'))\n\
               notes = [e['user_metadata'] for e in s['device_traces'][1] if e['action'] == 'annotate']\n\
               assert notes == [json.load(open(sys.argv[2], encoding='utf-8'))], len(notes)\n\
               assert s['device_traces'][0] == [] or all(e['action'] == 'snapshot' for e in s['device_traces'][0])\nprint('ok')"])
        .arg(dir.join("snap.pickle"))
        .arg(&want)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
