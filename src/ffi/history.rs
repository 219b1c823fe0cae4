//! The allocation history and snapshots that PyTorch's memory viewer reads (PyTorch
//! `torch.cuda.memory._record_memory_history` and `_dump_snapshot`).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;

use super::runtime;
use super::status::{boundary, gpupool_status, write_text};
use crate::error::Error;
use crate::history::{HistoryContext, HistorySettings, HistoryStacks, metadata};

/// `context` for `gpupool_record_history`: no call stacks (PyTorch `context=None`).
pub const GPUPOOL_HISTORY_CONTEXT_NONE: u32 = 0;
/// `context` for `gpupool_record_history`: the call stack of each allocation, kept with its
/// block while it is live, so that the snapshot's blocks and segments say who allocated them
/// (PyTorch `context="state"`).
pub const GPUPOOL_HISTORY_CONTEXT_STATE: u32 = 1;
/// `context` for `gpupool_record_history`: also a stack on each `alloc`, `segment_alloc`,
/// `segment_map` and `oom` event of the trace; a block's `free_requested` and `free_completed`
/// carry its allocation's stack (PyTorch `context="alloc"`).
pub const GPUPOOL_HISTORY_CONTEXT_ALLOC: u32 = 2;
/// `context` for `gpupool_record_history`: also a stack captured at each free, on its
/// `free_requested` event (PyTorch `context="all"`, its default).
pub const GPUPOOL_HISTORY_CONTEXT_ALL: u32 = 3;
/// Added to `context` for `gpupool_record_history` (`GPUPOOL_HISTORY_CONTEXT_ALL |
/// GPUPOOL_HISTORY_STACKS_PYTHON`): stacks hold the Python frames only, no native frames
/// (PyTorch `stacks="python"`); nothing is unwound, and a thread without Python frames records
/// an empty stack. Without either `GPUPOOL_HISTORY_STACKS_` value, stacks hold the native frames
/// and, under CPython, the Python frames in place of the interpreter's (PyTorch
/// `stacks="all"`, its default).
pub const GPUPOOL_HISTORY_STACKS_PYTHON: u32 = 0x10;
/// Added to `context` for `gpupool_record_history`: stacks hold the native frames only, and
/// Python is never called (gpupool before 2026-11-25).
pub const GPUPOOL_HISTORY_STACKS_NATIVE: u32 = 0x20;
/// The longest metadata `gpupool_set_memory_metadata` and `gpupool_annotate_memory` accept, in
/// bytes (64 KiB, the NUL not counted).
pub const GPUPOOL_MEMORY_METADATA_MAX: usize = 65536;
const _: () = assert!(GPUPOOL_MEMORY_METADATA_MAX == metadata::MAX_METADATA_BYTES);

/// --------------------------------------------------------------------------------------------
/// History and tags
/// --------------------------------------------------------------------------------------------
///
/// The allocation history and the snapshots that PyTorch's memory viewer reads
/// (`torch.cuda.memory._record_memory_history` and `_dump_snapshot`; `GPUPOOL_RECORD_HISTORY`
/// records from the first call). Tags say which part of the engine holds the memory: a thread
/// pushes a name, and every block it allocates until the matching pop carries it, in the per-tag
/// statistics, the snapshot, the live report (`GPUPOOL_LIVE_REPORT_AT_EXIT`) and the out-of-memory
/// message.
///
/// --------------------------------------------------------------------------------------------
///
/// Starts, changes or stops recording the allocation history of every device of the
/// process-wide allocator (PyTorch `torch.cuda.memory._record_memory_history`), for
/// `gpupool_dump_snapshot`.
///
/// - `enabled`: non-zero to record, 0 to stop and forget every trace recorded (`max_entries`
///   and `context` are then not read).
/// - `max_entries`: events kept per device, the newest ones (PyTorch `max_entries`); 0 keeps
///   no event, only the stacks of live blocks (PyTorch `enabled="state"`). The events, with
///   PyTorch's names: `alloc`, `free_requested` (the caller freed the block), `free_completed`
///   (it went back to its pool: at once, or after the events of `gpupool_record_stream` or a
///   device synchronisation), `segment_alloc`, `segment_free` (`cuMemAlloc`, `cuMemFree`),
///   `segment_map`, `segment_unmap` (pages of expandable segments), `oom` (a request failed
///   after every retry) and `snapshot` (`gpupool_dump_snapshot` was called); each with the
///   address, the bytes (those asked for, for a block), the stream, and the time in
///   microseconds since the Unix epoch; `annotate` (`gpupool_annotate_memory`). About 64 bytes
///   of host memory each, and the metadata strings the events refer to
///   (`gpupool_set_memory_metadata`).
/// - `context`: which call stacks are kept, `GPUPOOL_HISTORY_CONTEXT_NONE`, `_STATE`,
///   `_ALLOC` or `_ALL` (PyTorch's `None`, `"state"`, `"alloc"`, `"all"`); each keeps what the
///   one before it keeps. A stack is captured unresolved (the instruction pointers, about a
///   microsecond or two of unwinding) and symbolised only by `gpupool_dump_snapshot`; each
///   distinct stack is kept once, for the life of the process. Frames of gpupool itself are
///   left out. Plus, optionally, which frames a stack holds (PyTorch's `stacks`):
///   `GPUPOOL_HISTORY_STACKS_PYTHON` or `GPUPOOL_HISTORY_STACKS_NATIVE`; by default the native
///   frames and, when the process runs CPython (3.10 or later; found at run time, gpupool does
///   not link it) and the calling thread has a Python thread state, its Python frames (file,
///   line, function; at most 128, the innermost) in place of the interpreter's evaluation
///   loops, as PyTorch's `stacks="all"` shows them. For those, gpupool takes the GIL
///   (`PyGILState_Ensure`) before any lock of its own when the thread released it, as PyTorch
///   does; names are read by `gpupool_dump_snapshot`, which takes the GIL too. A thread Python
///   never saw (a C++ engine's) gets none and Python is not called.
///
/// Calling it again changes the settings: a trace keeps its newest events up to the new
/// `max_entries`. When stacks stop being kept (`enabled` 0, or `context` below
/// `GPUPOOL_HISTORY_CONTEXT_STATE`) the live blocks forget theirs too; with `enabled` 0, the
/// references to Python code objects that stacks hold are given back (under the GIL; left when
/// Python is finalised), the frames keeping their names. The environment variable
/// `GPUPOOL_RECORD_HISTORY=<max_entries>[:<context>[:<stacks>]]` (`none`, `state`, `alloc`,
/// `all`, default `all`; `all`, `python`, `native`, default `all`) turns recording on from the
/// start, when the process-wide allocator starts.
///
/// Cost: off, one relaxed atomic load on each allocation and free. On, see docs/history.md (the
/// table of what it costs): an event without a stack costs tens of nanoseconds, a stack
/// microseconds.
///
/// Errors, each changing nothing: `GPUPOOL_ERROR_INVALID_VALUE` for a `context` other than a
/// level (0 to 3) plus at most one `GPUPOOL_HISTORY_STACKS_` value (the message names it); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` when the allocator cannot start (or in
/// a process forked from one that used gpupool).
///
/// Thread-safe; allocations made on other threads during the call are recorded with the old
/// settings or the new ones. Starts the process-wide allocator if no call did yet, but no
/// device.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_record_history(enabled: c_int, max_entries: usize, context: u32) -> gpupool_status {
    boundary("gpupool_record_history", || {
        let settings = if enabled == 0 {
            None
        } else {
            let stacks = match context & !0xf {
                0 => Some(HistoryStacks::All),
                GPUPOOL_HISTORY_STACKS_PYTHON => Some(HistoryStacks::Python),
                GPUPOOL_HISTORY_STACKS_NATIVE => Some(HistoryStacks::Native),
                _ => None,
            };
            let (Some(level), Some(stacks)) = (HistoryContext::from_u32(context & 0xf), stacks) else {
                return Err(Error::InvalidValue(format!(
                    "context {context} ({context:#x}) is not valid: expected GPUPOOL_HISTORY_CONTEXT_NONE (0), _STATE (1), \
                     _ALLOC (2) or _ALL (3), plus at most one of GPUPOOL_HISTORY_STACKS_PYTHON (0x10) and \
                     GPUPOOL_HISTORY_STACKS_NATIVE (0x20)"
                )));
            };
            Some(HistorySettings { max_entries, context: level, stacks })
        };
        runtime()?.allocator.record_history(settings)
    })
}

/// Writes a snapshot of the process-wide allocator to the file at `path`, in the format of
/// PyTorch's `torch.cuda.memory._dump_snapshot` (the pickle of `torch.cuda.memory._snapshot()`),
/// which PyTorch's viewer renders: `python3 -m torch.cuda._memory_viz trace_plot FILE -o
/// trace.html` (memory over time, from the trace) or `segment_plot` (segments and blocks at each
/// event), or the file dropped on the memory_viz page.
///
/// The file holds a dict: `segments`, every segment of every device in use (`device`,
/// `address`, `total_size`, `stream`, `segment_type` `"large"`/`"small"`, `segment_pool_id`
/// (0, 0), `allocated_size`, `active_size`, `requested_size`, `is_expandable`, `frames`, and
/// `blocks`, which tile it in address order: `address`, `size`, `requested_size`, `state`
/// (`active_allocated`, `active_pending_free` for a freed block awaiting events or a device
/// synchronisation, `inactive`) and `frames`); an expandable segment shows as one segment per
/// run of mapped pages, as PyTorch shows it; a segment of a sleeping pool (`gpupool_sleep`) shows
/// as when it was awake, its blocks in their states, with gpupool's key `is_sleeping: True`
/// (only there: PyTorch's viewer passes over it). `device_traces`, per device ordinal, the events
/// `gpupool_record_history` recorded, oldest first, `time_us` never decreasing along a trace
/// (`action`, `addr` (`device_free` for `oom`), `size`, `stream`, `time_us`, `frames`, and
/// `user_metadata` on an event that has some: `gpupool_set_memory_metadata`,
/// `gpupool_annotate_memory`).
/// `allocator_settings`, the configuration (PyTorch's
/// keys). A frame is `{filename, line, name}`, innermost first. Sizes in bytes.
///
/// With history on, each device's trace ends with the `snapshot` event this call records.
/// Each device is read with all its streams locked, as one consistent state (allocations on
/// it wait meanwhile); stacks are symbolised afterwards, reading the debug information of the
/// libraries they pass through (seconds, the first time). Works with history off too: the
/// segments, no events, no stacks. Pickle protocol 4, as `_dump_snapshot`'s `pickle.dump`
/// writes it, with the opcodes CPython's pickler uses; each distinct string, frame and stack's
/// list of frames is written once and referred back to through the pickle's memo, so that the
/// events and blocks of one stack share one list (as objects, once CPython's `pickle` loads it),
/// and the file is about 40 bytes an event whatever the stacks' depth. Written 64 KiB at a time
/// (a pickle frame).
///
/// - `path`: a NUL-terminated path, read during the call only; the file is created or
///   replaced.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` for a NULL `path`, or when the file cannot be
/// created (no snapshot is taken then) or written (what was written stays); the message has
/// the path and the system's error. `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` when the allocator
/// cannot start.
///
/// Thread-safe.
///
/// # Safety
/// `path` must be NULL or point to a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_dump_snapshot(path: *const c_char) -> gpupool_status {
    // SAFETY: this function's contract.
    boundary("gpupool_dump_snapshot", || unsafe { dump(path, true) })
}

/// `gpupool_dump_snapshot`, with the traces only when `include_traces` is non-zero (PyTorch
/// `torch.cuda.memory_snapshot(include_traces=False)` and `MemPool.snapshot(include_traces=)`,
/// PR #172672). With 0, the file's `device_traces` holds one empty list per device and
/// nothing of the recorded history is copied, symbolised or written: the snapshot costs what
/// the segments and blocks cost, however many events the history keeps (docs/history.md: the
/// figures, 100,000 events, the 2-core development machine). The history goes on recording;
/// its `snapshot` event is recorded all the same. The rest as `gpupool_dump_snapshot`:
/// arguments, errors (`GPUPOOL_ERROR_INVALID_VALUE` for a NULL or unwritable `path`), thread
/// safety.
///
/// # Safety
/// `path` must be NULL or point to a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_dump_snapshot_with(
    path: *const c_char,
    include_traces: c_int,
) -> gpupool_status {
    // SAFETY: this function's contract.
    boundary("gpupool_dump_snapshot_with", || unsafe { dump(path, include_traces != 0) })
}

/// Sets the calling thread's metadata for the allocation history (PyTorch
/// `torch.cuda.memory._set_memory_metadata`): every event this thread records from now on
/// (`alloc`, `free_requested`, `segment_alloc`, ... on any device) carries it as its
/// `user_metadata` in `gpupool_dump_snapshot`'s file, which PyTorch's viewer shows with the
/// event; an event recorded by another thread (a `free_completed` completed by the thread that
/// synchronised) carries that thread's. Only what is recorded while history is on
/// (`gpupool_record_history`) shows it; the segments and blocks of the snapshot do not.
///
/// - `metadata`: NUL-terminated UTF-8, copied; `""` or NULL clears it. Any text, as PyTorch
///   takes any string (a label: `"forward"`), at most `GPUPOOL_MEMORY_METADATA_MAX` bytes; text
///   that starts with `{` or `[` (after JSON's white space: space, tab, line feed, carriage
///   return) must be valid JSON (RFC 8259, nested to any depth), the structured metadata
///   PyTorch writes for a dict (`json.dumps` with `separators=(",", ":")`) and its viewer shows
///   as key-value pairs. Stored as given, a string, as PyTorch stores it.
///
/// Errors, each leaving the thread's metadata as it was: `GPUPOOL_ERROR_INVALID_VALUE` for
/// metadata longer than the limit (the message has its length), not UTF-8 (the byte offset),
/// or JSON that does not parse (serde_json's message, with line and column).
///
/// Per thread; needs no allocator and starts none. Cost: a copy of the string here; while
/// history is on, a reference count on each event the thread records.
///
/// # Safety
/// `metadata` must be NULL or point to a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_set_memory_metadata(metadata: *const c_char) -> gpupool_status {
    boundary("gpupool_set_memory_metadata", || {
        if metadata.is_null() {
            return metadata::set("");
        }
        // SAFETY: non-NULL and NUL-terminated, per this function's contract.
        let bytes = unsafe { CStr::from_ptr(metadata) }.to_bytes();
        metadata::set(metadata::check(bytes)?)
    })
}

/// Writes the calling thread's metadata (`gpupool_set_memory_metadata`; `""` when none; PyTorch
/// `torch.cuda.memory._get_memory_metadata`).
///
/// - `buf`, `len`: a caller-owned buffer of `len` bytes, or NULL to ask for the size only.
/// - `needed`: if not NULL, receives the bytes the text needs, NUL included.
///
/// The buffer convention of `gpupool_memory_summary`: with a buffer of at least `*needed`
/// bytes, writes the NUL-terminated text and `*needed`, and succeeds; with a buffer too small,
/// writes `*needed`, leaves the buffer untouched and returns `GPUPOOL_ERROR_INVALID_VALUE`.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (both `buf` and `needed` NULL; `len` too small, the
/// message gives the size needed). Per thread; needs no allocator.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes; `needed` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_get_memory_metadata(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> gpupool_status {
    boundary("gpupool_get_memory_metadata", || {
        if buf.is_null() && needed.is_null() {
            return Err(Error::InvalidValue("buf and needed are both NULL".into()));
        }
        // SAFETY: the caller's buffer and out-pointer, per this function's contract.
        unsafe { write_text(&metadata::get(), "metadata", buf, len, needed) }
    })
}

/// Attaches metadata to a live block after its allocation (PyTorch
/// `torch.cuda.memory._annotate_memory`, PR #190575): records an `annotate` event in its
/// device's trace with the block's address, requested size and stream, `metadata` as its
/// `user_metadata`, and the caller's stack where events keep stacks
/// (`GPUPOOL_HISTORY_CONTEXT_ALLOC` and up). PyTorch's viewer shows it with the block;
/// annotations of one block accumulate, each an event of its own, and change nothing the
/// allocation recorded (not its own `user_metadata`). While history is off nothing is recorded,
/// as in PyTorch, but the arguments are checked all the same.
///
/// - `ptr`: the address `gpupool_malloc` returned, of a block not yet freed (PyTorch annotates
///   the base of a tensor's storage).
/// - `metadata`: NUL-terminated UTF-8, copied; the rules of `gpupool_set_memory_metadata`
///   (at most `GPUPOOL_MEMORY_METADATA_MAX` bytes, valid JSON when it starts with `{` or `[`).
///
/// Errors, each recording nothing: `GPUPOOL_ERROR_INVALID_VALUE` for a NULL `metadata`, or one
/// too long, not UTF-8 or not valid JSON (the message says which); `GPUPOOL_ERROR_INVALID_POINTER`
/// when `ptr` is not an allocated block (never gpupool's, freed, inside a block; PyTorch raises
/// on a dead or unknown pointer too); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` when the allocator
/// cannot start.
///
/// Thread-safe: a block freed on another thread meanwhile is either annotated before the free
/// (its `annotate` event comes before its `free_requested`) or reported freed. Costs a lookup
/// of the block and its stream's lock.
///
/// # Safety
/// `metadata` must be NULL or point to a NUL-terminated string; `ptr` is only compared.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_annotate_memory(ptr: *mut c_void, metadata: *const c_char) -> gpupool_status {
    boundary("gpupool_annotate_memory", || {
        if metadata.is_null() {
            return Err(Error::InvalidValue("metadata is NULL; pass the annotation's text".into()));
        }
        // SAFETY: non-NULL and NUL-terminated, per this function's contract.
        let bytes = unsafe { CStr::from_ptr(metadata) }.to_bytes();
        let text = metadata::check(bytes)?;
        runtime()?.allocator.annotate_memory(ptr as u64, text)
    })
}

/// The body of `gpupool_dump_snapshot` and `gpupool_dump_snapshot_with`.
///
/// # Safety
/// `path` must be NULL or point to a NUL-terminated string.
unsafe fn dump(path: *const c_char, include_traces: bool) -> Result<(), Error> {
    if path.is_null() {
        return Err(Error::InvalidValue("path is NULL; pass the file to write".into()));
    }
    // SAFETY: non-NULL and NUL-terminated, per this function's contract.
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(unsafe { CStr::from_ptr(path) }.to_bytes()));
    write_snapshot(&runtime()?.allocator, path, include_traces)
}

/// Writes `allocator`'s snapshot (with its traces or without) to `path` (created or replaced),
/// as `gpupool_dump_snapshot_with` does; its errors are that function's.
fn write_snapshot(allocator: &crate::Allocator, path: &std::path::Path, include_traces: bool) -> Result<(), Error> {
    let cannot =
        |e: std::io::Error| Error::InvalidValue(format!("the snapshot cannot be written to {}: {e}", path.display()));
    // Created first: a path that cannot be written takes no snapshot (and records no
    // `snapshot` event).
    let file = std::fs::File::create(path).map_err(cannot)?;
    let mut out = std::io::BufWriter::new(file);
    allocator.snapshot_with(include_traces)?.write_pickle(&mut out).map_err(|e| {
        Error::InvalidValue(format!("the snapshot cannot be written to {}: {}", path.display(), e.message()))
    })?;
    out.flush().map_err(cannot)
}

/// `GPUPOOL_SNAPSHOT_AT_EXIT`: registered with `atexit` when the process-wide allocator starts
/// with it set; writes the snapshot of every device used to that file, as
/// `gpupool_dump_snapshot` would (under the LD_PRELOAD shim too, whose allocator this is).
/// Reads gpupool's own state only and calls nothing in CUDA, which may have shut down by then.
/// A file that cannot be written: one line on stderr naming it and why. A panic stops here (no
/// unwinding into libc).
pub(crate) extern "C" fn snapshot_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let Ok(rt) = runtime() else { return };
        let Some(path) = rt.allocator.config().snapshot_at_exit else { return };
        if let Err(e) = write_snapshot(&rt.allocator, std::path::Path::new(path), true) {
            let _ = writeln!(std::io::stderr(), "gpupool: GPUPOOL_SNAPSHOT_AT_EXIT: {}", e.message());
        }
    });
}
