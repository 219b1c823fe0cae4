//! Call stacks (PyTorch `CapturedTraceback` with its `symbolize`): captured at an event as bare
//! instruction pointers with the `backtrace` crate's unwinder, followed by the ids of the
//! thread's Python frames (`super::python`, under CPython; [`HistoryStacks`] says which of the
//! two), interned so that each distinct stack is stored once and named by a `u32` (a block's
//! `ctx`, an event's), and symbolised only when a snapshot is taken, each instruction pointer
//! once (the symbols found are kept for later snapshots), the Python frames put in place of the
//! interpreter's evaluation loops as PyTorch does ([`interleave`]).
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

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::HistoryStacks;
use super::frame::Frame;
use super::native::{callers_only, interleave, symbolise, walk};
use super::python::{self, MAX_PY_FRAMES, PY_BIT, PyFrames, Scope};

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
    /// The Python frames of the stacks.
    python: PyFrames,
    /// Which frames a stack holds: a [`HistoryStacks`], as a number.
    stacks: AtomicU32,
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
    /// Which frames stacks hold from now on.
    pub fn set_stacks(&self, stacks: HistoryStacks) {
        self.stacks.store(stacks as u32, Ordering::Relaxed);
    }

    fn stacks(&self) -> HistoryStacks {
        HistoryStacks::from_u32(self.stacks.load(Ordering::Relaxed)).unwrap_or_default()
    }

    /// The calling thread's Python frames, read for the stacks captured until the scope is
    /// dropped, unless stacks hold native frames only (see [`PyFrames::scope`]). Call with no
    /// lock of gpupool's held.
    pub fn python_scope(&self) -> Scope {
        if self.stacks() == HistoryStacks::Native { Scope::none() } else { self.python.scope() }
    }

    /// Gives back the Python objects the stacks hold (see [`PyFrames::release`]). Call with
    /// no lock of gpupool's held.
    pub fn release_python(&self) {
        self.python.release();
    }

    /// The context of `tag` (0: none) and the calling thread's stack, interned: its id (1 or
    /// more), or [`tag_only`] when 2 billion distinct contexts are stored already. Unwinds the
    /// stack (some microseconds) and resolves nothing; the Python frames are those of the
    /// thread's scope ([`ContextTable::python_scope`]).
    #[inline(never)]
    pub fn capture(&self, tag: u32) -> u32 {
        let mut ips = [0usize; MAX_FRAMES + MAX_PY_FRAMES];
        let mut n = 0;
        let stacks = self.stacks();
        if stacks != HistoryStacks::Python {
            walk(|ip| {
                ips[n] = ip;
                n += 1;
                n < MAX_FRAMES
            });
        }
        if stacks != HistoryStacks::Native {
            n += self.python.capture(&mut ips[n..]);
        }
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

    /// A symboliser for one snapshot: holds the symbol cache until dropped, and the GIL when
    /// Python frames are to be named. Call with no lock of gpupool's held.
    pub fn symbolizer(&self) -> Symbolizer<'_> {
        // The GIL first, then the cache's lock (see `python`'s lock order).
        let names = self.python.namer();
        Symbolizer {
            table: self,
            by_id: FxHashMap::default(),
            by_ctx: FxHashMap::default(),
            symbols: self.symbols.lock(),
            names,
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
    names: python::Namer<'a>,
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
    /// [`callers_only`]), its Python frames in place of the interpreter's ([`interleave`]);
    /// empty for 0.
    pub fn stack_frames(&mut self, id: u32) -> Arc<[Frame]> {
        if id == 0 {
            return self.none.clone();
        }
        if let Some(f) = self.by_id.get(&id) {
            return f.clone();
        }
        let Some(stack) = self.table.stack(id) else { return self.none.clone() };
        let mut frames = Vec::with_capacity(stack.len());
        let mut py = Vec::new();
        for &ip in stack.iter() {
            if ip & PY_BIT != 0 {
                py.push(self.names.frame(ip & !PY_BIT));
                continue;
            }
            let f = self.symbols.entry(ip).or_insert_with(|| symbolise(ip)).clone();
            frames.extend(f.iter().cloned());
        }
        let frames: Arc<[Frame]> = interleave(callers_only(frames), py).into();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::native::is_gpupool;

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
    fn without_cpython_stacks_are_native_as_before() {
        // `cargo test` runs no CPython: the default (`All`) captures what `Native` does, and
        // `Python` an empty stack.
        let t = ContextTable::default();
        #[inline(never)]
        fn at_one_site(t: &ContextTable) -> u32 {
            t.capture(0)
        }
        let modes = [HistoryStacks::Native, HistoryStacks::All, HistoryStacks::Python];
        let ids: Vec<u32> = std::hint::black_box(&modes[..])
            .iter()
            .map(|&m| {
                t.set_stacks(m);
                at_one_site(&t)
            })
            .collect();
        assert_eq!(ids[0], ids[1], "the same stack with and without Python frames");
        let mut s = t.symbolizer();
        assert!(!s.frames(ids[1]).is_empty());
        assert!(s.frames(ids[2]).is_empty(), "Python frames only: none");
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
