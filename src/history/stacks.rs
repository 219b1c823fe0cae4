//! Native call stacks (PyTorch `CapturedTraceback` with its `symbolize`): captured at an event
//! as bare instruction pointers with the `backtrace` crate's unwinder, interned so that each
//! distinct stack is stored once and named by a `u32` (a block's `ctx`, an event's), and
//! symbolised only when a snapshot is taken, each instruction pointer once (the symbols found
//! are kept for later snapshots).
//!
//! The table keeps every distinct stack for the allocator's life: an allocator's memory for
//! stacks follows the number of distinct call paths that allocate and free, not the number of
//! events.
//!
//! A context (a block's `ctx`, an event's) names a tag (`super::tags`) and a stack at once, so
//! that a block of 64 bytes has room for both in one `u32`: 0 is neither; with the top bit
//! ([`TAG_ONLY`]) set, the rest is a tag id and there is no stack (what a tagged allocation
//! records while history keeps no stacks, with no lock taken); otherwise it is an interned
//! (tag, stack) pair, the tag 0 when none was pushed.

use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::frame::Frame;

/// Frames kept of a stack, innermost first; deeper callers are cut.
const MAX_FRAMES: usize = 128;

/// The bit of a context that holds a tag and no stack.
pub(crate) const TAG_ONLY: u32 = 1 << 31;

/// The context of `tag` with no stack (0 for no tag).
pub(crate) fn tag_only(tag: u32) -> u32 {
    if tag == 0 { 0 } else { TAG_ONLY | tag }
}

/// Interned stacks, and the symbols found for their instruction pointers.
#[derive(Default)]
pub(crate) struct ContextTable {
    interned: Mutex<Interned>,
    /// The frames of each instruction pointer symbolised so far (several when calls were
    /// inlined there), gpupool's own included; taken for the whole of a snapshot.
    symbols: Mutex<FxHashMap<usize, Arc<[Frame]>>>,
}

#[derive(Default)]
struct Interned {
    ids: FxHashMap<Arc<[usize]>, u32>,
    /// Stack `id` at `id - 1`.
    stacks: Vec<Arc<[usize]>>,
    pair_ids: FxHashMap<(u32, u32), u32>,
    /// Context `id` (a (tag, stack id) pair) at `id - 1`.
    pairs: Vec<(u32, u32)>,
}

impl ContextTable {
    /// The context of `tag` (0: none) and the calling thread's stack, interned: its id (1 or
    /// more), or [`tag_only`] when 2 billion distinct contexts are stored already. Unwinds the
    /// stack (some microseconds) and resolves nothing.
    #[inline(never)]
    pub fn capture(&self, tag: u32) -> u32 {
        let mut ips = [0usize; MAX_FRAMES];
        let mut n = 0;
        walk(|ip| {
            ips[n] = ip;
            n += 1;
            n < MAX_FRAMES
        });
        let stack = &ips[..n];
        let mut t = self.interned.lock();
        let sid = match t.ids.get(stack) {
            Some(&id) => id,
            None => {
                let Ok(id) = u32::try_from(t.stacks.len() + 1) else { return tag_only(tag) };
                let stack: Arc<[usize]> = stack.into();
                t.stacks.push(stack.clone());
                t.ids.insert(stack, id);
                id
            }
        };
        if let Some(&id) = t.pair_ids.get(&(tag, sid)) {
            return id;
        }
        let id = t.pairs.len() as u32 + 1;
        if id >= TAG_ONLY {
            return tag_only(tag);
        }
        t.pairs.push((tag, sid));
        t.pair_ids.insert((tag, sid), id);
        id
    }

    /// The tag and the stack id of context `ctx` (0 for none of either).
    pub fn split(&self, ctx: u32) -> (u32, u32) {
        if ctx & TAG_ONLY != 0 {
            return (ctx & !TAG_ONLY, 0);
        }
        let Some(i) = (ctx as usize).checked_sub(1) else { return (0, 0) };
        self.interned.lock().pairs.get(i).copied().unwrap_or((0, 0))
    }

    /// The tag of context `ctx` (0: none). Takes no lock for a context without a stack.
    pub fn tag_of(&self, ctx: u32) -> u32 {
        self.split(ctx).0
    }

    /// Context `ctx` without its stack: its tag alone.
    pub fn without_stack(&self, ctx: u32) -> u32 {
        tag_only(self.tag_of(ctx))
    }

    /// Distinct stacks stored.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.interned.lock().stacks.len()
    }

    /// A symboliser for one snapshot: holds the symbol cache until dropped.
    pub fn symbolizer(&self) -> Symbolizer<'_> {
        Symbolizer {
            table: self,
            by_id: FxHashMap::default(),
            by_ctx: FxHashMap::default(),
            symbols: self.symbols.lock(),
            none: Arc::from([]),
        }
    }

    /// Stack `id` (not a context: see [`ContextTable::split`]).
    fn stack(&self, id: u32) -> Option<Arc<[usize]>> {
        let t = self.interned.lock();
        t.stacks.get((id as usize).checked_sub(1)?).cloned()
    }
}

/// Turns contexts into frames for one snapshot; each stack is symbolised once.
pub(crate) struct Symbolizer<'a> {
    table: &'a ContextTable,
    /// By stack id.
    by_id: FxHashMap<u32, Arc<[Frame]>>,
    /// By context.
    by_ctx: FxHashMap<u32, Arc<[Frame]>>,
    symbols: MutexGuard<'a, FxHashMap<usize, Arc<[Frame]>>>,
    none: Arc<[Frame]>,
}

impl Symbolizer<'_> {
    /// The frames of context `ctx`: its stack's ([`Symbolizer::stack_frames`]), then, when it
    /// has a tag, the tag as the outermost frame ([`tag_frame`]); empty for 0.
    pub fn frames(&mut self, ctx: u32) -> Arc<[Frame]> {
        if ctx == 0 {
            return self.none.clone();
        }
        if let Some(f) = self.by_ctx.get(&ctx) {
            return f.clone();
        }
        let (tag, stack) = self.table.split(ctx);
        let frames = match (tag, super::tags::name_of(tag)) {
            (0, _) | (_, None) => self.stack_frames(stack),
            (_, Some(name)) => {
                let mut f = self.stack_frames(stack).to_vec();
                f.push(tag_frame(&name));
                f.into()
            }
        };
        self.by_ctx.insert(ctx, frames.clone());
        frames
    }

    /// The frames of stack `id`, innermost first, without gpupool's own (see
    /// [`callers_only`]); empty for 0.
    pub fn stack_frames(&mut self, id: u32) -> Arc<[Frame]> {
        if id == 0 {
            return self.none.clone();
        }
        if let Some(f) = self.by_id.get(&id) {
            return f.clone();
        }
        let Some(stack) = self.table.stack(id) else { return self.none.clone() };
        let mut frames = Vec::with_capacity(stack.len());
        for &ip in stack.iter() {
            let f = self.symbols.entry(ip).or_insert_with(|| symbolise(ip)).clone();
            frames.extend(f.iter().cloned());
        }
        let frames: Arc<[Frame]> = callers_only(frames).into();
        self.by_id.insert(id, frames.clone());
        frames
    }
}

/// The frame that names tag `name` in a snapshot: `{"filename": "<tag>", "line": 0, "name":
/// "tag NAME"}`, the outermost of a block's frames, so that PyTorch's viewer, which groups
/// blocks by their frames from the outermost in (`_memory_viz.py` reverses them for its flame
/// graphs; the memory_viz page lists them), puts a tag's blocks together.
pub(crate) fn tag_frame(name: &str) -> Frame {
    Frame { name: format!("tag {name}"), filename: "<tag>".to_string(), line: 0 }
}

/// Calls `f` with each instruction pointer of the calling thread's stack, innermost first,
/// until it returns false.
fn walk(mut f: impl FnMut(usize) -> bool) {
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
fn symbolise(ip: usize) -> Arc<[Frame]> {
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
fn callers_only(mut frames: Vec<Frame>) -> Vec<Frame> {
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
fn is_gpupool(f: &Frame) -> bool {
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
    fn stacks_are_interned_and_symbolised() {
        let t = ContextTable::default();
        // The same call site each time (a loop the optimiser cannot unroll).
        let ids: Vec<u32> = (0..std::hint::black_box(3)).map(|_| t.capture(0)).collect();
        assert!(ids[0] >= 1);
        assert_eq!(ids[0], ids[1], "the same call site, the same stack");
        let other = t.capture(0);
        assert_ne!(other, ids[0], "another call site");
        assert_eq!(t.len(), 2);
        assert_eq!(t.split(ids[0]), (0, 1));
        // Every frame of a unit test is gpupool's: symbolised, the raw stack names this test
        // (when the binary has its symbols: the GPU machine's copies are stripped).
        let raw: Vec<Frame> =
            t.stack(t.split(ids[0]).1).unwrap().iter().flat_map(|&ip| symbolise(ip).to_vec()).collect();
        // (`resolve` looks one byte before an address, a return address's call.)
        let here = symbolise as fn(usize) -> Arc<[Frame]> as usize + 1;
        if !symbolise(here).iter().all(|f| f.name.starts_with("0x")) {
            assert!(raw.iter().any(|f| f.name.contains("stacks_are_interned_and_symbolised")), "{raw:?}");
        }
        let mut s = t.symbolizer();
        let frames = s.frames(ids[0]);
        assert!(frames.iter().all(|f| !is_gpupool(f)), "{frames:?}");
        assert!(s.frames(0).is_empty());
        assert!(s.frames(999).is_empty());
    }

    #[test]
    fn contexts_pair_a_tag_with_a_stack() {
        let t = ContextTable::default();
        let tag = crate::history::tags::push("stacks-unit").unwrap();
        crate::history::tags::pop().unwrap();
        // One call site, so one stack, with and without the tag.
        #[inline(never)]
        fn at_one_site(t: &ContextTable, tag: u32) -> u32 {
            t.capture(std::hint::black_box(tag))
        }
        // A loop over a slice of unknown length: an optimised build must not unroll it into
        // four call sites.
        let tags = [0, tag, 0, tag];
        let ids: Vec<u32> = std::hint::black_box(&tags[..]).iter().map(|&g| at_one_site(&t, g)).collect();
        let (plain, tagged) = ([ids[0], ids[2]], [ids[1], ids[3]]);
        assert_eq!(t.len(), 1, "one call site");
        assert_ne!(plain[0], tagged[0], "the same stack with and without the tag");
        assert_eq!(plain[0], plain[1]);
        assert_eq!(tagged[0], tagged[1]);
        assert_eq!(t.split(plain[0]).1, t.split(tagged[0]).1);
        assert_eq!(t.split(tagged[0]).0, tag);
        assert_eq!(t.tag_of(plain[0]), 0);
        assert_eq!(t.split(tag_only(tag)), (tag, 0));
        assert_eq!(t.without_stack(tagged[1]), tag_only(tag));
        assert_eq!(tag_only(0), 0);
        let mut s = t.symbolizer();
        assert_eq!(s.frames(tag_only(tag)).to_vec(), [tag_frame("stacks-unit")]);
        let f = s.frames(tagged[0]);
        assert_eq!(f.last(), Some(&tag_frame("stacks-unit")), "the tag is the outermost frame");
        assert_eq!(f.len(), s.frames(plain[0]).len() + 1);
    }
}
