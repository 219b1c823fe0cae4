//! The C API of the allocation history: `GPUPOOL_RECORD_HISTORY` turning it on from the start,
//! `gpupool_dump_snapshot` writing PyTorch's pickle (read back with serde-pickle here; CPython's
//! reading is tests/history/recording.rs's), `gpupool_record_history` changing and stopping it, and the
//! errors each documents.
//!
//! The process allocator reads `GPUPOOL_*` once, at its first use: the test runs in a process of
//! its own (`common::process::alone`), which sets them before any call.

use crate::common;

use std::ffi::{CStr, CString, c_void};

use common::process::alone;
use gpupool::ffi::history::{GPUPOOL_HISTORY_CONTEXT_NONE, gpupool_dump_snapshot, gpupool_record_history};
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
use gpupool::ffi::status::gpupool_last_error_message;
use gpupool::ffi::status::gpupool_status::{self, *};
use serde_pickle::{DeOptions, HashableValue, Value};

fn message() -> String {
    // SAFETY: gpupool returns a NUL-terminated string that lives until the thread's next call.
    unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy().into_owned()
}

/// `key` of the pickled dict `v`.
fn get<'a>(v: &'a Value, key: &str) -> &'a Value {
    match v {
        Value::Dict(d) => d.get(&HashableValue::String(key.into())).unwrap_or_else(|| panic!("no {key} in {v:?}")),
        _ => panic!("not a dict: {v:?}"),
    }
}

fn list(v: &Value) -> &Vec<Value> {
    match v {
        Value::List(l) => l,
        _ => panic!("not a list: {v:?}"),
    }
}

/// Writes a snapshot to `path` and returns device 0's actions and the snapshot.
fn dump(path: &CString) -> (Vec<String>, Value) {
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { gpupool_dump_snapshot(path.as_ptr()) }, GPUPOOL_SUCCESS, "{}", message());
    let bytes = std::fs::read(path.to_str().unwrap()).unwrap();
    // The file shares each stack's frames between the events that have it (as CPython's memo
    // does); serde-pickle uses up what a shared list holds at its first visit
    // (birkenfeld/serde-pickle#24) and, so told, reads the later visits' frames as None.
    let snap = serde_pickle::value_from_slice(&bytes, DeOptions::new().replace_recursive_structures()).unwrap();
    let actions = list(&list(get(&snap, "device_traces"))[0])
        .iter()
        .map(|e| match get(e, "action") {
            Value::String(s) => s.clone(),
            a => panic!("{a:?}"),
        })
        .collect();
    (actions, snap)
}

#[test]
fn the_c_api_records_from_the_start_dumps_and_stops() {
    if !alone() {
        return;
    }
    // SAFETY: this process's only test sets the environment before the process allocator
    // starts, and before any other thread reads it.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", "256MiB");
        std::env::set_var("GPUPOOL_RECORD_HISTORY", "1000:alloc");
    }
    let dir = std::env::temp_dir().join(format!("gpupool-history-ffi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = CString::new(dir.join("snapshot.pickle").to_str().unwrap()).unwrap();

    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is storage for one pointer; the block is freed once, below.
    unsafe {
        assert_eq!(gpupool_malloc(&mut p, 1000, 0, std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
    }
    let (actions, snap) = dump(&path);
    assert_eq!(actions, ["segment_map", "alloc", "free_requested", "free_completed", "snapshot"]);
    let alloc = &list(&list(get(&snap, "device_traces"))[0])[1];
    assert_eq!(get(alloc, "addr"), &Value::I64(p as i64));
    assert_eq!(get(alloc, "size"), &Value::I64(1000));
    assert!(!list(get(alloc, "frames")).is_empty(), "GPUPOOL_RECORD_HISTORY's context, alloc, keeps stacks");
    let segments = list(get(&snap, "segments"));
    assert_eq!(segments.len(), 1);
    assert_eq!(get(&segments[0], "segment_pool_id"), &Value::Tuple(vec![Value::I64(0), Value::I64(0)]));

    // Bad arguments change nothing.
    assert_eq!(gpupool_record_history(1, 10, 4), GPUPOOL_ERROR_INVALID_VALUE);
    assert!(message().contains("context 4"), "{}", message());
    // Both STACKS_ values, or an unknown bit: refused too.
    for bad in [0x33, 0x43, 0x13 | 0x100] {
        assert_eq!(gpupool_record_history(1, 10, bad), GPUPOOL_ERROR_INVALID_VALUE, "{bad:#x}");
        assert!(message().contains("GPUPOOL_HISTORY_STACKS_PYTHON"), "{}", message());
    }
    // SAFETY: NULL is refused; the other path is NUL-terminated.
    unsafe {
        assert_eq!(gpupool_dump_snapshot(std::ptr::null()), GPUPOOL_ERROR_INVALID_VALUE);
        let nowhere = CString::new(dir.join("no/such/dir/x.pickle").to_str().unwrap()).unwrap();
        assert_eq!(gpupool_dump_snapshot(nowhere.as_ptr()), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(message().contains("no/such/dir") && message().starts_with("gpupool_dump_snapshot"), "{}", message());
    }
    assert_eq!(dump(&path).0.len(), 6, "still recording: one more snapshot event");

    // Fewer events kept, no stacks.
    let status: gpupool_status = gpupool_record_history(1, 2, GPUPOOL_HISTORY_CONTEXT_NONE);
    assert_eq!(status, GPUPOOL_SUCCESS);
    assert_eq!(dump(&path).0, ["snapshot", "snapshot"]);
    // Stopped: nothing recorded, the trace forgotten; the segments are still there.
    assert_eq!(gpupool_record_history(0, 0, 99), GPUPOOL_SUCCESS, "max_entries and context are not read");
    let (actions, snap) = dump(&path);
    assert!(actions.is_empty());
    assert_eq!(list(get(&snap, "segments")).len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Set in the child process of `the_snapshot_at_exit_is_written_when_the_process_exits`: its
/// body runs only there. Not a `GPUPOOL_*` name: the library warns about unknown ones.
const AT_EXIT_CHILD: &str = "TEST_SNAPSHOT_AT_EXIT_CHILD";

/// The child's body: a block of 3000 bytes left allocated, one of 1000 freed, then the process
/// exits, and `GPUPOOL_SNAPSHOT_AT_EXIT` writes the snapshot.
#[test]
fn snapshot_at_exit_child() {
    if std::env::var_os(AT_EXIT_CHILD).is_none() {
        return;
    }
    let (mut kept, mut freed): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: each is storage for one pointer; `freed` is freed once, `kept` never.
    unsafe {
        assert_eq!(gpupool_malloc(&mut kept, 3000, 0, std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_malloc(&mut freed, 1000, 0, std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_free(freed), GPUPOOL_SUCCESS);
    }
    println!("kept {}", kept as usize);
}

/// Runs `snapshot_at_exit_child` in a process of its own with `GPUPOOL_SNAPSHOT_AT_EXIT=path`;
/// returns its stdout and stderr, after checking that it passed.
fn run_at_exit_child(path: &std::path::Path) -> (String, String) {
    let name = common::process::test_path(module_path!(), "snapshot_at_exit_child");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &name, "--test-threads=1", "--nocapture"])
        .env(AT_EXIT_CHILD, "1")
        .env("GPUPOOL_DRIVER", "sim")
        .env("GPUPOOL_SIM_CAPACITY", "256MiB")
        .env("GPUPOOL_RECORD_HISTORY", "1000:alloc")
        .env("GPUPOOL_SNAPSHOT_AT_EXIT", path)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("1 passed"), "the child failed: {stdout}\n{stderr}");
    (stdout.into_owned(), stderr.into_owned())
}

#[test]
fn the_snapshot_at_exit_is_written_when_the_process_exits() {
    let dir = std::env::temp_dir().join(format!("gpupool-snapshot-at-exit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("at exit.pickle");
    let (stdout, _) = run_at_exit_child(&path);
    // libtest prints the test's name on the same line, before what the test prints.
    let kept = stdout.lines().find_map(|l| l.split_once("kept ")).expect("the child's block").1;
    let kept: i64 = kept.split_whitespace().next().unwrap().parse().unwrap();
    let bytes = std::fs::read(&path).expect("the child wrote the snapshot at exit");
    let snap = serde_pickle::value_from_slice(&bytes, DeOptions::new().replace_recursive_structures()).unwrap();
    let trace = list(&list(get(&snap, "device_traces"))[0]).clone();
    let actions: Vec<_> = trace.iter().map(|e| get(e, "action").clone()).collect();
    let s = |a: &str| Value::String(a.into());
    assert_eq!(
        actions,
        [s("segment_map"), s("alloc"), s("alloc"), s("free_requested"), s("free_completed"), s("snapshot")]
    );
    assert_eq!(get(&trace[1], "addr"), &Value::I64(kept));
    // The block left allocated is in the snapshot's segment, active.
    let segments = list(get(&snap, "segments"));
    assert_eq!(segments.len(), 1);
    let active: Vec<_> = list(get(&segments[0], "blocks"))
        .iter()
        .filter(|b| get(b, "state") == &s("active_allocated"))
        .map(|b| get(b, "address").clone())
        .collect();
    assert_eq!(active, [Value::I64(kept)]);

    // A file that cannot be written: the child still exits 0, and says why on stderr.
    let nowhere = dir.join("no/such/dir/x.pickle");
    let (_, stderr) = run_at_exit_child(&nowhere);
    assert!(
        stderr.contains("gpupool: GPUPOOL_SNAPSHOT_AT_EXIT: the snapshot cannot be written to")
            && stderr.contains("no/such/dir"),
        "{stderr}"
    );
    assert!(!nowhere.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
