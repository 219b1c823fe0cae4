//! A snapshot as PyTorch's pickle: the dict `torch.cuda.memory._snapshot()` returns, as
//! `_dump_snapshot()` writes it and `torch.cuda._memory_viz` and the memory_viz page read it
//! (keys and encodings of PyTorch's `_memory_snapshot_pickled`, `torch/csrc/cuda/Module.cpp`).
//!
//! Pickle protocol 4, what `_dump_snapshot`'s `pickle.dump` writes by default, with CPython's
//! opcodes for it (`writer`): `PROTO`, `FRAME`, `EMPTY_DICT`, `EMPTY_LIST`, `MARK`,
//! `SETITEMS`, `SETITEM`, `APPENDS`, `APPEND`, `SHORT_BINUNICODE`, `BINUNICODE`, `BININT1`,
//! `BININT2`, `BININT`, `LONG1`, `BINFLOAT`, `NEWTRUE`, `NEWFALSE`, `TUPLE2`, `MEMOIZE`,
//! `BINGET`, `LONG_BINGET`, `STOP`: the memory_viz page's own unpickler knows each. Every
//! integer is written as a signed 64-bit value: an unsigned one of 2^63 or more would need a
//! 9-byte `LONG1`, which that unpickler turns into a JavaScript `BigInt`, and the page fails
//! adding it to a size.
//!
//! Written once and referred back to through the memo, as CPython's pickler refers back to an
//! object it has written: each distinct string (keys, actions, file and function names), each
//! distinct frame dict, and each distinct stack's list of frames, which every event, block and
//! segment with that stack shares (PyTorch shares the frame dicts and gives each event a list
//! of its own; a shared list costs an event one reference instead of one per frame). CPython
//! loads them as shared objects: `a["frames"] is b["frames"]` for two events of one stack. The
//! rest (events, blocks, segments, empty lists) is written in full and not memoized, which
//! keeps the memo's indices small and its references short.

mod writer;

use std::io::{self, Write};
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::Action;
use super::frame::Frame;
use super::snapshot::{AllocatorSettings, Snapshot, SnapshotBlock, SnapshotSegment, TraceEntry};
use crate::error::Error;
use writer::Writer;

impl Snapshot {
    /// The snapshot as PyTorch's pickle (what `torch.cuda.memory._dump_snapshot` writes).
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_pickle(&mut out).expect("writing to memory does not fail");
        out
    }

    /// Writes the snapshot as PyTorch's pickle to `w`, 64 KiB at a time (a pickle frame).
    ///
    /// Errors: [`Error::InvalidValue`] when `w` fails, with its error.
    pub fn write_pickle(&self, w: &mut impl Write) -> Result<(), Error> {
        let write = |w: &mut dyn Write| -> io::Result<()> {
            let mut p = Pickler::new(Writer::new(w)?);
            p.snapshot(self)?;
            p.w.finish().map(drop)
        };
        write(w).map_err(|e| Error::InvalidValue(format!("writing the snapshot failed: {e}")))
    }
}

/// An integer as the snapshot writes it (see the module docs).
fn int<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

/// String `s`, written once: referred back to when `memo` has it.
fn string<'a, W: Write>(w: &mut Writer<W>, memo: &mut FxHashMap<&'a str, u32>, s: &'a str) -> io::Result<()> {
    if let Some(&i) = memo.get(s) {
        return w.get(i);
    }
    w.str(s)?;
    if let Some(i) = w.memoize() {
        memo.insert(s, i);
    }
    Ok(())
}

/// The writer, and the memo indices of what it wrote to refer back to, by value (a frame list
/// also by its address: one lookup for every event that shares it).
///
/// The strings of frames (their keys, files and function names) are memoized apart from the
/// others (keys, actions, states), even where equal (a C function named `alloc`): a reader
/// that counts references, as serde-pickle does (birkenfeld/serde-pickle#24), visits what a
/// shared frame holds once per sharing, and would use up an action's string there.
struct Pickler<'a, W: Write> {
    w: Writer<W>,
    strings: FxHashMap<&'a str, u32>,
    frame_strings: FxHashMap<&'a str, u32>,
    frames: FxHashMap<&'a Frame, u32>,
    lists: FxHashMap<&'a [Frame], u32>,
    lists_at: FxHashMap<usize, u32>,
}

impl<'a, W: Write> Pickler<'a, W> {
    fn new(w: Writer<W>) -> Self {
        Pickler {
            w,
            strings: FxHashMap::default(),
            frame_strings: FxHashMap::default(),
            frames: FxHashMap::default(),
            lists: FxHashMap::default(),
            lists_at: FxHashMap::default(),
        }
    }

    /// A string, written once.
    fn str(&mut self, s: &'a str) -> io::Result<()> {
        string(&mut self.w, &mut self.strings, s)
    }

    /// A dict of `n` entries (fewer than 1,000: one batch), which `entries` writes.
    fn dict(&mut self, n: usize, entries: impl FnOnce(&mut Self) -> io::Result<()>) -> io::Result<()> {
        debug_assert!(n < 1000);
        self.w.dict()?;
        self.w.open(n);
        entries(self)?;
        self.w.close(true, n);
        Ok(())
    }

    /// The list of `items`, each written by `item`.
    fn list<T>(&mut self, items: &'a [T], mut item: impl FnMut(&mut Self, &'a T) -> io::Result<()>) -> io::Result<()> {
        self.w.list()?;
        self.w.open(items.len());
        for (i, x) in items.iter().enumerate() {
            self.w.between(false, i);
            item(self, x)?;
        }
        self.w.close(false, items.len());
        Ok(())
    }

    fn key_str(&mut self, key: &'a str, v: &'a str) -> io::Result<()> {
        self.str(key)?;
        self.str(v)
    }

    fn key_int(&mut self, key: &'a str, v: i64) -> io::Result<()> {
        self.str(key)?;
        self.w.int(v)
    }

    fn key_bool(&mut self, key: &'a str, v: bool) -> io::Result<()> {
        self.str(key)?;
        self.w.bool(v)
    }

    /// A stack's frames, innermost first: written once per distinct stack, then referred to.
    fn frames(&mut self, frames: &'a Arc<[Frame]>) -> io::Result<()> {
        if frames.is_empty() {
            self.w.list()?;
            return Ok(());
        }
        let at = frames.as_ptr() as usize;
        let known = self.lists_at.get(&at).or_else(|| self.lists.get(&frames[..])).copied();
        if let Some(i) = known {
            self.lists_at.insert(at, i);
            return self.w.get(i);
        }
        self.w.list()?;
        let memo = self.w.memoize();
        self.w.open(frames.len());
        for (i, f) in frames.iter().enumerate() {
            self.w.between(false, i);
            self.frame(f)?;
        }
        self.w.close(false, frames.len());
        if let Some(i) = memo {
            self.lists_at.insert(at, i);
            self.lists.insert(&frames[..], i);
        }
        Ok(())
    }

    /// One frame, `{filename, line, name}`: written once, then referred to.
    fn frame(&mut self, f: &'a Frame) -> io::Result<()> {
        if let Some(&i) = self.frames.get(f) {
            return self.w.get(i);
        }
        self.w.dict()?;
        let memo = self.w.memoize();
        self.w.open(3);
        let (w, strings) = (&mut self.w, &mut self.frame_strings);
        string(w, strings, "filename")?;
        string(w, strings, &f.filename)?;
        string(w, strings, "line")?;
        w.int(int(f.line))?;
        string(w, strings, "name")?;
        string(w, strings, &f.name)?;
        w.close(true, 3);
        if let Some(i) = memo {
            self.frames.insert(f, i);
        }
        Ok(())
    }

    fn snapshot(&mut self, snap: &'a Snapshot) -> io::Result<()> {
        self.dict(4, |p| {
            p.str("segments")?;
            p.list(&snap.segments, Self::segment)?;
            p.str("device_traces")?;
            p.list(&snap.device_traces, |p, t| p.list(t, Self::event))?;
            p.str("allocator_settings")?;
            p.settings(&snap.allocator_settings)?;
            // gpupool's own key, which PyTorch's viewer and `_snapshot()` readers pass over:
            // per device ordinal, the bytes of physical pages held unmapped.
            p.str("gpupool_unmapped_held_bytes")?;
            p.list(&snap.unmapped_held_bytes, |p, &b| p.w.int(int(b)))
        })
    }

    fn segment(&mut self, g: &'a SnapshotSegment) -> io::Result<()> {
        self.dict(12 + usize::from(g.is_sleeping), |p| {
            p.key_int("device", int(g.device))?;
            p.key_int("address", int(g.address))?;
            p.key_int("total_size", int(g.total_size))?;
            p.key_int("allocated_size", int(g.allocated_size))?;
            p.key_int("active_size", int(g.active_size))?;
            p.key_int("requested_size", int(g.requested_size))?;
            p.key_int("stream", int(g.stream))?;
            p.key_str("segment_type", if g.is_large { "large" } else { "small" })?;
            // PyTorch's `MempoolId_t` is a pair; its first half is 0 for pools made by
            // `graph_pool_handle()`, as gpupool's ids, and (0, 0) names the default pools.
            p.str("segment_pool_id")?;
            p.w.int(0)?;
            p.w.int(int(g.pool))?;
            p.w.tuple2();
            p.key_bool("is_expandable", g.is_expandable)?;
            // gpupool's: only on a sleeping pool's segments, so that PyTorch's keys are all
            // an awake snapshot holds; its viewer passes over a key it does not know.
            if g.is_sleeping {
                p.key_bool("is_sleeping", true)?;
            }
            p.str("frames")?;
            p.frames(&g.frames)?;
            p.str("blocks")?;
            p.list(&g.blocks, Self::block)
        })
    }

    fn block(&mut self, b: &'a SnapshotBlock) -> io::Result<()> {
        self.dict(5, |p| {
            p.key_int("address", int(b.address))?;
            p.key_int("size", int(b.size))?;
            p.key_int("requested_size", int(b.requested_size))?;
            p.key_str("state", b.state.name())?;
            p.str("frames")?;
            p.frames(&b.frames)
        })
    }

    fn event(&mut self, e: &'a TraceEntry) -> io::Result<()> {
        self.dict(6 + usize::from(e.user_metadata.is_some()), |p| {
            p.key_str("action", e.action.name())?;
            // PyTorch writes an out-of-memory event's free bytes under their own name.
            p.key_int(if e.action == Action::Oom { "device_free" } else { "addr" }, int(e.addr))?;
            p.key_int("size", int(e.size))?;
            p.key_int("stream", int(e.stream))?;
            p.key_int("time_us", e.time_us)?;
            p.str("frames")?;
            p.frames(&e.frames)?;
            // PyTorch's `user_metadata` (the recording thread's metadata, or an annotation's),
            // written only where there is some (`torch.cuda._memory_viz` reads it on `annotate`
            // events, which always carry it). Each distinct string is written once and referred
            // back to.
            if let Some(m) = &e.user_metadata {
                p.key_str("user_metadata", m)?;
            }
            Ok(())
        })
    }

    fn settings(&mut self, a: &'a AllocatorSettings) -> io::Result<()> {
        self.dict(8, |p| {
            p.key_str("PYTORCH_CUDA_ALLOC_CONF", &a.conf)?;
            // PyTorch writes its `size_t` as an `int64_t`: no limit (the largest size) is -1.
            p.key_int("max_split_size", a.max_split_size as i64)?;
            p.str("garbage_collection_threshold")?;
            p.w.float(a.garbage_collection_threshold)?;
            p.key_bool("expandable_segments", a.expandable_segments)?;
            p.key_int("pinned_num_register_threads", int(a.pinned_num_register_threads))?;
            p.key_bool("release_lock_on_cudamalloc", a.release_lock_on_cudamalloc)?;
            p.key_bool("pinned_use_cuda_host_register", a.pinned_use_cuda_host_register)?;
            // A dict from the interval's size in MiB, as a string ("1", "2", "4", ...), to its
            // divisions.
            p.str("roundup_power2_divisions")?;
            let n = a.roundup_power2_divisions.len();
            p.w.dict()?;
            p.w.open(n);
            for (i, &d) in a.roundup_power2_divisions.iter().enumerate() {
                p.w.between(true, i);
                p.w.str(&(1u64 << i.min(63)).to_string())?;
                p.w.int(int(d))?;
            }
            p.w.close(true, n);
            Ok(())
        })
    }
}
