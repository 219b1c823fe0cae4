//! The allocation history and snapshots that PyTorch's memory viewer reads (PyTorch
//! `torch.cuda.memory._record_memory_history` and `_dump_snapshot`).

use std::ffi::{CStr, c_char, c_int};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;

use super::runtime;
use super::status::{boundary, gpupool_status};
use crate::error::Error;
use crate::history::{HistoryContext, HistorySettings, HistoryStacks};

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
///   microseconds since the Unix epoch. About 48 bytes of host memory each.
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
/// (`action`, `addr` (`device_free` for `oom`), `size`, `stream`, `time_us`, `frames`).
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
    boundary("gpupool_dump_snapshot", || {
        if path.is_null() {
            return Err(Error::InvalidValue("path is NULL; pass the file to write".into()));
        }
        // SAFETY: non-NULL and NUL-terminated, per this function's contract.
        let path = std::path::Path::new(std::ffi::OsStr::from_bytes(unsafe { CStr::from_ptr(path) }.to_bytes()));
        write_snapshot(&runtime()?.allocator, path)
    })
}

/// Writes `allocator`'s snapshot to `path` (created or replaced), as `gpupool_dump_snapshot`
/// does; its errors are that function's.
fn write_snapshot(allocator: &crate::Allocator, path: &std::path::Path) -> Result<(), Error> {
    let cannot =
        |e: std::io::Error| Error::InvalidValue(format!("the snapshot cannot be written to {}: {e}", path.display()));
    // Created first: a path that cannot be written takes no snapshot (and records no
    // `snapshot` event).
    let file = std::fs::File::create(path).map_err(cannot)?;
    let mut out = std::io::BufWriter::new(file);
    allocator.snapshot()?.write_pickle(&mut out).map_err(|e| {
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
        if let Err(e) = write_snapshot(&rt.allocator, std::path::Path::new(path)) {
            let _ = writeln!(std::io::stderr(), "gpupool: GPUPOOL_SNAPSHOT_AT_EXIT: {}", e.message());
        }
    });
}
