//! Native frames of a call stack: unwound as bare instruction pointers (the `backtrace`
//! crate), symbolised at snapshot time, gpupool's own innermost frames left out, and the
//! Python frames of a stack put in place of CPython's evaluation loops.

use std::ffi::c_void;
use std::sync::Arc;

use super::frame::Frame;

/// `native` (innermost first) with the frames of `python` (innermost first) in place of the
/// interpreter's evaluation loops (frames of `_PyEval_EvalFrameDefault`), one Python frame for
/// each but the outermost loop, which takes the rest. PyTorch's `symbolize` of a
/// `CapturedTraceback` gives one to each loop and puts the rest after the outermost native
/// frame (`_start`): right for CPython 3.10, where each Python call has a loop of its own, but
/// from 3.11 on one loop runs a Python function and the Python functions it calls, and the
/// outer ones landed outside the interpreter. PyTorch also matches `PyEval_EvalFrame`, which
/// names the inlined `_PyEval_EvalFrame` too when the interpreter has debug information: two
/// loops for one. Without a loop (Python frames only, or a binary without symbols), the Python
/// frames go after the native ones.
pub(super) fn interleave(native: Vec<Frame>, python: Vec<Frame>) -> Vec<Frame> {
    let is_loop = |f: &Frame| f.name.starts_with("_PyEval_EvalFrameDefault");
    if python.is_empty() {
        return native;
    }
    let mut loops = native.iter().filter(|f| is_loop(f)).count();
    let mut py = python.into_iter();
    let mut out = Vec::with_capacity(native.len() + py.len());
    for f in native {
        if !is_loop(&f) {
            out.push(f);
            continue;
        }
        loops -= 1;
        if loops == 0 {
            out.extend(py.by_ref());
        } else {
            out.extend(py.next());
        }
    }
    out.extend(py);
    out
}

/// Calls `f` with each instruction pointer of the calling thread's stack, innermost first,
/// until it returns false.
pub(super) fn walk(mut f: impl FnMut(usize) -> bool) {
    #[cfg(unix)]
    // SAFETY: `trace_unsynchronized` is unsafe because some of the crate's backends (dbghelp, on
    // Windows) are not thread-safe; on Unix it is the unwinder of libgcc or libunwind
    // (`_Unwind_Backtrace`), which is, and it touches none of the crate's global state. The
    // crate's `trace` would serialise every thread recording a stack behind one global lock.
    // The callback does not panic.
    unsafe {
        backtrace::trace_unsynchronized(|frame| f(frame.ip() as usize))
    };
    #[cfg(not(unix))]
    backtrace::trace(|frame| f(frame.ip() as usize));
}

/// The frames of one instruction pointer, innermost (inlined) first; one frame naming the
/// address when no symbol is found.
pub(super) fn symbolise(ip: usize) -> Arc<[Frame]> {
    let mut frames = Vec::new();
    backtrace::resolve(ip as *mut c_void, |sym| {
        let name = match sym.name() {
            Some(n) => format!("{n:#}"),
            None => format!("{ip:#x}"),
        };
        let filename = sym.filename().map_or_else(|| "??".to_string(), |p| p.display().to_string());
        frames.push(Frame { name, filename, line: sym.lineno().unwrap_or(0) });
    });
    if frames.is_empty() {
        frames.push(Frame { name: format!("{ip:#x}"), filename: "??".to_string(), line: 0 });
    }
    frames.into()
}

/// `frames` (innermost first) without the innermost ones that are gpupool's own: the unwinder,
/// the recorder, the allocator and the C boundary, with the standard library's and the
/// dependencies' frames between them (the boundary's `catch_unwind`, a lock). What stays
/// starts at the caller of gpupool.
pub(super) fn callers_only(mut frames: Vec<Frame>) -> Vec<Frame> {
    let mut cut = 0;
    for (i, f) in frames.iter().enumerate() {
        if is_gpupool(f) {
            cut = i + 1;
        } else if !is_glue(f) {
            break;
        }
    }
    frames.drain(..cut);
    frames
}

/// gpupool's own sources, as the debug information names them.
const OWN_SOURCES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/");

/// A frame of gpupool: by its symbol (`gpupool::...`, or a `gpupool_` export), or, for a call
/// inlined into another (whose name the debug information gives without its path), by its
/// source file.
pub(super) fn is_gpupool(f: &Frame) -> bool {
    f.name.contains("gpupool::") || f.name.starts_with("gpupool_") || f.filename.starts_with(OWN_SOURCES)
}

/// A frame found between gpupool's own: the unwinder's, the standard library's, a
/// dependency's.
fn is_glue(f: &Frame) -> bool {
    let name = f.name.trim_start_matches('<');
    ["backtrace::", "std::", "core::", "alloc::", "__rust", "_Unwind_", "parking_lot", "scopeguard::"]
        .iter()
        .any(|p| name.starts_with(p))
        || f.filename.starts_with("/rustc/")
        || f.filename.contains("/.cargo/registry/")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str) -> Frame {
        Frame { name: name.to_string(), filename: "f.rs".to_string(), line: 1 }
    }

    fn inlined(name: &str, file: &str) -> Frame {
        Frame { name: name.to_string(), filename: file.to_string(), line: 1 }
    }

    #[test]
    fn gpupool_frames_are_left_out() {
        let names = |fs: Vec<Frame>| fs.into_iter().map(|f| f.name).collect::<Vec<_>>();
        let stack = vec![
            frame("backtrace::backtrace::libunwind::trace"),
            frame("gpupool::history::stacks::ContextTable::capture"),
            frame("gpupool::caching::allocator::Allocator::malloc"),
            frame("gpupool::ffi::memory::gpupool_malloc::{{closure}}"),
            frame("std::panicking::try::do_call"),
            frame("__rust_try"),
            frame("gpupool::ffi::status::boundary"),
            frame("gpupool_malloc"),
            frame("engine::step"),
            frame("std::rt::lang_start"),
            frame("main"),
        ];
        assert_eq!(names(callers_only(stack)), ["engine::step", "std::rt::lang_start", "main"]);
        // Inlined calls carry bare names: known by their files.
        let stack = vec![
            inlined("trace", "/home/u/.cargo/registry/src/index/backtrace-0.3.76/src/backtrace/libunwind.rs"),
            inlined("capture", concat!(env!("CARGO_MANIFEST_DIR"), "/src/history/stacks.rs")),
            inlined("call_once", "/rustc/0123/library/core/src/ops/function.rs"),
            frame("gpupool_malloc"),
            frame("engine::step"),
        ];
        assert_eq!(names(callers_only(stack)), ["engine::step"]);
        // A stack with no gpupool frame (not captured by gpupool) is kept whole.
        assert_eq!(names(callers_only(vec![frame("std::a"), frame("main")])), ["std::a", "main"]);
    }

    #[test]
    fn python_frames_take_the_place_of_evaluation_loops() {
        let names = |fs: Vec<Frame>| fs.into_iter().map(|f| f.name).collect::<Vec<_>>();
        let native = vec![
            frame("THPVariable_empty"),
            frame("_PyEval_EvalFrameDefault"),
            frame("_PyFunction_Vectorcall"),
            frame("_PyEval_EvalFrameDefault"),
            frame("main"),
        ];
        let py = vec![frame("inner"), frame("outer"), frame("<module>")];
        // One Python frame for each loop, the outermost taking the rest (3.11+: one loop runs
        // several Python calls).
        assert_eq!(
            names(interleave(native.clone(), py)),
            ["THPVariable_empty", "inner", "_PyFunction_Vectorcall", "outer", "<module>", "main"]
        );
        // As many loops as Python frames (3.10): one each.
        let two = vec![frame("inner"), frame("outer")];
        assert_eq!(
            names(interleave(native.clone(), two)),
            ["THPVariable_empty", "inner", "_PyFunction_Vectorcall", "outer", "main"]
        );
        // Without Python frames (a C program, a thread Python never saw), the stack as it was.
        assert_eq!(names(interleave(native.clone(), vec![])), names(native.clone()));
        // Python only (`HistoryStacks::Python`): the Python frames.
        assert_eq!(names(interleave(vec![], vec![frame("f")])), ["f"]);
    }
}
