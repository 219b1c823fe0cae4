//! Tags: which part of the engine holds the memory. A thread pushes a name, and every block it
//! allocates until the matching pop carries it: in the per-tag statistics, the snapshot of
//! `gpupool_dump_snapshot`, the live report and the out-of-memory message. Not in PyTorch,
//! whose users group by Python stack; gpupool's are for engines whose native stacks say less
//! than a stage's name.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::Write;

use super::runtime;
use super::stats::{gpupool_stat_t, stat};
use super::status::{boundary, gpupool_status, out_ptr};
use crate::error::Error;
use crate::history::{TagStats, tags};

/// What the blocks allocated under one tag hold, over every device, as PyTorch's `Stat`s:
/// `current` (held now), `peak` (the most held at once since the process started),
/// `allocated` and `freed` (the sums of every allocation and free).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct gpupool_tag_stats_t {
    /// Bytes, rounded as `allocated_bytes` counts them (not the sizes asked for), so that the
    /// tags' `current` add up to `allocated_bytes.all.current` when every block is tagged.
    pub bytes: gpupool_stat_t,
    /// Blocks.
    pub blocks: gpupool_stat_t,
}

fn c_stats(s: &TagStats) -> gpupool_tag_stats_t {
    let TagStats { bytes, blocks } = s;
    gpupool_tag_stats_t { bytes: stat(bytes), blocks: stat(blocks) }
}

/// A tag's name from C: non-NULL, UTF-8.
///
/// # Safety
/// `name` must be NULL or point to a NUL-terminated string.
unsafe fn name_arg<'a>(name: *const c_char) -> Result<&'a str, Error> {
    if name.is_null() {
        return Err(Error::InvalidValue("name is NULL; pass the tag's name".into()));
    }
    // SAFETY: non-NULL and NUL-terminated, per the caller's contract.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    std::str::from_utf8(bytes).map_err(|e| Error::InvalidValue(format!("the tag's name is not valid UTF-8 ({e})")))
}

/// Pushes the tag `name` on the calling thread's stack of tags: every block this thread
/// allocates until the matching `gpupool_pop_tag` carries it (the innermost tag, when several
/// are pushed), whichever device and stream. Pair each push with a pop on the same thread (the
/// C++ wrapper's `gpupool::tag_scope` does).
///
/// A tagged block counts in its tag's statistics (`gpupool_tag_stats`) until it is freed, by
/// whichever thread and under whichever tag; the snapshot of `gpupool_dump_snapshot` gives it
/// an outermost frame `{"filename": "<tag>", "line": 0, "name": "tag NAME"}` (its trace events
/// too), so that PyTorch's viewer groups a tag's blocks; `gpupool_live_report` groups by tag;
/// the out-of-memory message names the three tags holding the most of the device's memory.
///
/// - `name`: 1 to 255 bytes of UTF-8, NUL-terminated, read during the call only, without
///   control characters (C0 such as newline or tab, DEL, C1) or U+2028/U+2029, which would break
///   the lines of the live report. Names are interned for the life of the process (at most
///   65535 distinct names).
///
/// Cost: no allocation pays anything for tags until the first push of the process but one
/// relaxed atomic load; after it, each allocation and free reads the thread's tag and updates
/// its counters (a few atomic operations). The push itself takes a process-wide lock.
///
/// Errors, each changing nothing: `GPUPOOL_ERROR_INVALID_VALUE` for a NULL name, one that is
/// not UTF-8, empty or over 255 bytes, one holding a control character or line separator
/// (`gpupool_last_error_message()` names it and its byte offset), a 65536th distinct name, or
/// 1024 tags pushed on this thread already (a missing pop).
///
/// Thread-safe: each thread has its own stack. Needs no device and starts nothing.
///
/// # Safety
/// `name` must be NULL or point to a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_push_tag(name: *const c_char) -> gpupool_status {
    boundary("gpupool_push_tag", || {
        // SAFETY: as this function's contract.
        tags::push(unsafe { name_arg(name) }?).map(|_| ())
    })
}

/// Pops the calling thread's innermost tag (pushed by `gpupool_push_tag`); the blocks it
/// allocates from now on carry the tag pushed before it, or none. Blocks allocated under the
/// popped tag keep it.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` when this thread has no tag pushed; nothing changes.
///
/// Thread-safe: it changes the calling thread's stack only.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_pop_tag() -> gpupool_status {
    boundary("gpupool_pop_tag", tags::pop)
}

/// Writes the statistics of the blocks allocated under tag `name` on every device to `*out`:
/// bytes and blocks, each current, peak, allocated and freed (see `gpupool_tag_stats_t`).
///
/// Errors, `*out` untouched: `GPUPOOL_ERROR_INVALID_VALUE` for a NULL or non-UTF-8 `name`, a
/// name no thread of the process ever pushed, or a NULL `out`;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` when the allocator cannot start.
///
/// Thread-safe, and waits for no allocation: a block allocated or freed during the call may
/// show in some figures and not yet in others.
///
/// # Safety
/// `name` must be NULL or point to a NUL-terminated string; `out` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_tag_stats(
    name: *const c_char,
    out: *mut gpupool_tag_stats_t,
) -> gpupool_status {
    boundary("gpupool_tag_stats", || {
        // SAFETY: as this function's contract.
        let name = unsafe { name_arg(name) }?;
        let out = out_ptr(out, "out")?;
        let s = runtime()?.allocator.tag_stats(name)?;
        // SAFETY: `out` is non-NULL and valid for a write, per this function's contract.
        unsafe { out.write(c_stats(&s)) };
        Ok(())
    })
}

/// A function `gpupool_for_each_tag` calls once per tag: its `name` (NUL-terminated, valid
/// during the call only), its statistics (as `gpupool_tag_stats` writes them, valid during the
/// call only) and the `user` pointer given. It runs on the calling thread with no lock of
/// gpupool's held, and may call gpupool.
#[allow(non_camel_case_types)]
pub type gpupool_tag_fn =
    Option<unsafe extern "C" fn(name: *const c_char, stats: *const gpupool_tag_stats_t, user: *mut c_void)>;

/// Calls `fn` for every tag pushed in the process, in the order first pushed, with its
/// statistics (zero for a tag under which nothing was allocated).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` for a NULL `fn`; `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`
/// when the allocator cannot start. `fn` is not called on error.
///
/// Thread-safe: the list is taken when the call starts; a tag pushed meanwhile may be left out.
///
/// # Safety
/// `fn` must be NULL or a function of the signature of `gpupool_tag_fn`, safe to call with
/// `user`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_for_each_tag(r#fn: gpupool_tag_fn, user: *mut c_void) -> gpupool_status {
    boundary("gpupool_for_each_tag", || {
        let f = r#fn.ok_or_else(|| Error::InvalidValue("fn is NULL; pass the function to call per tag".into()))?;
        // SAFETY: one calling convention; "C-unwind" only lets the thread's end leave it (it is
        // called as a callout, `crate::callout`).
        let f = unsafe { std::mem::transmute::<TagC, TagPtr>(f) };
        for (name, s) in runtime()?.allocator.all_tag_stats() {
            let Ok(name) = CString::new(name.as_bytes()) else { continue };
            let s = c_stats(&s);
            // A callout (see `crate::callout`): a thread that ends in it is called no more.
            // SAFETY: per this function's contract; both pointers live across the call.
            crate::callout::callout(|| unsafe { f(name.as_ptr(), &s, user) });
            if crate::callout::exiting() {
                break;
            }
        }
        Ok(())
    })
}

/// The callbacks as gpupool calls them: "C-unwind", since they may end the thread (see
/// `crate::callout`); the public types stay "C", as in `oom`.
type TagPtr = unsafe extern "C-unwind" fn(*const c_char, *const gpupool_tag_stats_t, *mut c_void);
type TagC = unsafe extern "C" fn(*const c_char, *const gpupool_tag_stats_t, *mut c_void);
type OutputPtr = unsafe extern "C-unwind" fn(*const c_char, *mut c_void);
type OutputC = unsafe extern "C" fn(*const c_char, *mut c_void);

/// Where `gpupool_live_report` writes: called once per line of the report, `text` the line
/// with its `'\n'`, NUL-terminated, valid during the call only; `user` the pointer given
/// (mimalloc's `mi_output_fun`). It runs on the calling thread with no lock of gpupool's held.
#[allow(non_camel_case_types)]
pub type gpupool_output_fn = Option<unsafe extern "C" fn(text: *const c_char, user: *mut c_void)>;

/// Writes the live report of `device` (-1: the current device) through `out` (stderr when
/// NULL): its allocated blocks grouped by tag, then by the call stack that allocated them
/// where the history kept stacks (`gpupool_record_history` with
/// `GPUPOOL_HISTORY_CONTEXT_STATE` or more when they were allocated), each group's bytes
/// (rounded) and blocks, largest first: what a leak hunt needs. For example:
///
/// ```text
/// gpupool live report, device 0: 12.00 MiB in 5 blocks
///   8.00 MiB in 2 blocks: tag encoder
///     8.00 MiB in 2 blocks, no call stack recorded
///   4.00 MiB in 3 blocks: no tag
///     4.00 MiB in 3 blocks, allocated at:
///       engine::step (engine.cpp:42)
///       main (engine.cpp:90)
/// ```
///
/// `GPUPOOL_LIVE_REPORT_AT_EXIT=1` prints it to stderr for every device used when the process
/// exits.
///
/// Each stream's blocks are read under its lock in turn (allocations on other streams go on);
/// stacks are symbolised during the call (the first time, reading debug information can take
/// seconds).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` for a device out of range;
/// `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`; `GPUPOOL_ERROR_CUDA` when the device cannot start.
/// Nothing is written on error.
///
/// Thread-safe.
///
/// # Safety
/// `out` must be NULL or a function of the signature of `gpupool_output_fn`, safe to call with
/// `user`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_live_report(
    device: c_int,
    out: gpupool_output_fn,
    user: *mut c_void,
) -> gpupool_status {
    boundary("gpupool_live_report", || {
        let text = runtime()?.allocator.live_report(device)?;
        match out {
            None => {
                let _ = std::io::stderr().lock().write_all(text.as_bytes());
            }
            Some(f) => {
                // SAFETY: as in `gpupool_for_each_tag`.
                let f = unsafe { std::mem::transmute::<OutputC, OutputPtr>(f) };
                for line in text.split_inclusive('\n') {
                    let Ok(line) = CString::new(line) else { continue };
                    // A callout, as in `gpupool_for_each_tag`.
                    // SAFETY: per this function's contract; the line lives across the call.
                    crate::callout::callout(|| unsafe { f(line.as_ptr(), user) });
                    if crate::callout::exiting() {
                        break;
                    }
                }
            }
        }
        Ok(())
    })
}

/// `GPUPOOL_LIVE_REPORT_AT_EXIT`: registered with `atexit` when the process-wide allocator
/// starts with it on; prints the live report of every device used to stderr. A panic stops
/// here (no unwinding into libc).
pub(crate) extern "C" fn live_report_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let Ok(rt) = runtime() else { return };
        let mut err = std::io::stderr().lock();
        for d in rt.allocator.devices_in_use() {
            if let Ok(text) = rt.allocator.live_report(d) {
                let _ = err.write_all(text.as_bytes());
            }
        }
    });
}
