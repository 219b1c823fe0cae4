//! A snapshot as PyTorch's pickle: the dict `torch.cuda.memory._snapshot()` returns, as
//! `_dump_snapshot()` writes it and `torch.cuda._memory_viz` and the memory_viz page read it
//! (keys and encodings of PyTorch's `_memory_snapshot_pickled`, `torch/csrc/cuda/Module.cpp`).
//!
//! Written by serde-pickle, protocol 3, with the opcodes Python's pickler uses for dicts, lists,
//! tuples, strings, integers, floats and booleans (`EMPTY_DICT`, `MARK`, `SETITEMS`,
//! `EMPTY_LIST`, `APPENDS`, `TUPLE`, `BINUNICODE`, `BININT`, `LONG1`, `BINFLOAT`, `NEWTRUE`,
//! `NEWFALSE`): the memory_viz page's own unpickler knows exactly those and a few more. Every
//! integer is written as a signed 64-bit value: serde-pickle writes an unsigned one of 2^31 or
//! more as a 9-byte `LONG1`, which that unpickler turns into a JavaScript `BigInt`, and the page
//! fails adding it to a size.

use std::io::Write;

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

use super::Action;
use super::snapshot::{AllocatorSettings, Frame, Snapshot, SnapshotBlock, SnapshotSegment, TraceEntry};
use crate::error::Error;

impl Snapshot {
    /// The snapshot as PyTorch's pickle (what `torch.cuda.memory._dump_snapshot` writes).
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_pickle(&mut out).expect("writing to memory does not fail");
        out
    }

    /// Writes the snapshot as PyTorch's pickle to `w`.
    ///
    /// Errors: [`Error::InvalidValue`] when `w` fails, with its error.
    pub fn write_pickle(&self, w: &mut impl Write) -> Result<(), Error> {
        serde_pickle::to_writer(w, &Root(self), serde_pickle::SerOptions::new())
            .map_err(|e| Error::InvalidValue(format!("writing the snapshot failed: {e}")))
    }
}

/// An integer as the snapshot writes it (see the module docs).
fn int<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

/// A map of `(key, value)` pairs of one type each, written in order.
fn map<S: Serializer>(
    s: S,
    len: usize,
    f: impl FnOnce(&mut S::SerializeMap) -> Result<(), S::Error>,
) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(len))?;
    f(&mut m)?;
    m.end()
}

/// A slice, written as a list of its items in the snapshot's layout.
struct List<'a, T>(&'a [T]);

impl<T> Serialize for List<'_, T>
where
    for<'b> Item<'b, T>: Serialize,
{
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut l = s.serialize_seq(Some(self.0.len()))?;
        for i in self.0 {
            l.serialize_element(&Item(i))?;
        }
        l.end()
    }
}

/// A reference that serialises in the snapshot's layout.
struct Item<'a, T>(&'a T);

impl Serialize for Item<'_, Vec<TraceEntry>> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        List(self.0).serialize(s)
    }
}

struct Root<'a>(&'a Snapshot);

impl Serialize for Root<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let snap = self.0;
        map(s, 4, |m| {
            m.serialize_entry("segments", &List(&snap.segments))?;
            m.serialize_entry("device_traces", &List(&snap.device_traces))?;
            m.serialize_entry("allocator_settings", &Item(&snap.allocator_settings))?;
            // gpupool's own key, which PyTorch's viewer and `_snapshot()` readers pass over.
            let held: Vec<i64> = snap.unmapped_held_bytes.iter().map(|&b| int(b)).collect();
            m.serialize_entry("gpupool_unmapped_held_bytes", &held)
        })
    }
}

impl Serialize for Item<'_, Frame> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let f = self.0;
        map(s, 3, |m| {
            m.serialize_entry("filename", &f.filename)?;
            m.serialize_entry("line", &int(f.line))?;
            m.serialize_entry("name", &f.name)
        })
    }
}

impl Serialize for Item<'_, SnapshotSegment> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let g = self.0;
        map(s, 12, |m| {
            m.serialize_entry("device", &int(g.device))?;
            m.serialize_entry("address", &int(g.address))?;
            m.serialize_entry("total_size", &int(g.total_size))?;
            m.serialize_entry("allocated_size", &int(g.allocated_size))?;
            m.serialize_entry("active_size", &int(g.active_size))?;
            m.serialize_entry("requested_size", &int(g.requested_size))?;
            m.serialize_entry("stream", &int(g.stream))?;
            m.serialize_entry("segment_type", if g.is_large { "large" } else { "small" })?;
            // PyTorch's `MempoolId_t` is a pair; its first half is 0 for pools made by
            // `graph_pool_handle()`, as gpupool's ids, and (0, 0) names the default pools.
            m.serialize_entry("segment_pool_id", &(0i64, int(g.pool)))?;
            m.serialize_entry("is_expandable", &g.is_expandable)?;
            m.serialize_entry("frames", &List(&g.frames[..]))?;
            m.serialize_entry("blocks", &List(&g.blocks))
        })
    }
}

impl Serialize for Item<'_, SnapshotBlock> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.0;
        map(s, 5, |m| {
            m.serialize_entry("address", &int(b.address))?;
            m.serialize_entry("size", &int(b.size))?;
            m.serialize_entry("requested_size", &int(b.requested_size))?;
            m.serialize_entry("state", b.state.name())?;
            m.serialize_entry("frames", &List(&b.frames[..]))
        })
    }
}

impl Serialize for Item<'_, TraceEntry> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let e = self.0;
        map(s, 6, |m| {
            m.serialize_entry("action", e.action.name())?;
            // PyTorch writes an out-of-memory event's free bytes under their own name.
            let key = if e.action == Action::Oom { "device_free" } else { "addr" };
            m.serialize_entry(key, &int(e.addr))?;
            m.serialize_entry("size", &int(e.size))?;
            m.serialize_entry("stream", &int(e.stream))?;
            m.serialize_entry("time_us", &e.time_us)?;
            m.serialize_entry("frames", &List(&e.frames[..]))
        })
    }
}

impl Serialize for Item<'_, AllocatorSettings> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let a = self.0;
        map(s, 8, |m| {
            m.serialize_entry("PYTORCH_CUDA_ALLOC_CONF", &a.conf)?;
            // PyTorch writes its `size_t` as an `int64_t`: no limit (the largest size) is -1.
            m.serialize_entry("max_split_size", &(a.max_split_size as i64))?;
            m.serialize_entry("garbage_collection_threshold", &a.garbage_collection_threshold)?;
            m.serialize_entry("expandable_segments", &a.expandable_segments)?;
            m.serialize_entry("pinned_num_register_threads", &int(a.pinned_num_register_threads))?;
            m.serialize_entry("release_lock_on_cudamalloc", &a.release_lock_on_cudamalloc)?;
            m.serialize_entry("pinned_use_cuda_host_register", &a.pinned_use_cuda_host_register)?;
            m.serialize_entry("roundup_power2_divisions", &Divisions(&a.roundup_power2_divisions))
        })
    }
}

/// PyTorch's `roundup_power2_divisions` setting: a dict from the interval's size in MiB, as a
/// string ("1", "2", "4", ...), to its divisions.
struct Divisions<'a>(&'a [usize]);

impl Serialize for Divisions<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        map(s, self.0.len(), |m| {
            for (i, &d) in self.0.iter().enumerate() {
                m.serialize_entry(&(1u64 << i).to_string(), &int(d))?;
            }
            Ok(())
        })
    }
}
