//! PyTorch's memory snapshot (`torch.cuda.memory._dump_snapshot()`: the dictionary of
//! `torch.cuda.memory._snapshot()` written by Python's `pickle.dump`, protocol 4 in Python 3.8
//! to 3.13, 5 from 3.14), read as traces to replay.
//!
//! What is read, as `torch/csrc/cuda/memory_snapshot.cpp` and `Module.cpp` write it:
//! - `device_traces`: one list per device of trace entries, each a dict with `action`, `addr`
//!   (`device_free` instead for `oom`), `size`, `stream`, and further keys (`time_us`,
//!   `frames`, `pool_id`, `user_metadata`, ...) that the replay does not need. The `size` of an
//!   `alloc` is the size the program asked for (`orig_size` in `CUDACachingAllocator.cpp`'s
//!   `malloc`), that of a `free_requested` the block's `requested_size`.
//! - `segments`: each with `device`, `address`, `total_size`, `stream` and its `blocks` (each
//!   with `size`, `requested_size`, `state`, and `address` since PyTorch 2.1; before, blocks
//!   tile their segment in order from its address, which is how the address is found then).
//! - `allocator_settings.PYTORCH_CUDA_ALLOC_CONF`, where present: the report's recorded row
//!   names it, and a row replays it on gpupool (`cli`).
//!
//! How a device's entries become a trace:
//! - `alloc` allocates a block at `addr`; `free_requested` frees the block at its `addr`: the
//!   moment the program gave it back. `free_completed` (when the recording allocator could
//!   reuse it, after other streams' events) is the allocator's doing, not the program's, and is
//!   skipped; a trace recorded with `skip_actions=["free_requested"]` frees at `free_completed`
//!   instead. `segment_*`, `oom`, `snapshot`, `annotate` (metadata attached to a live block,
//!   PyTorch's `_annotate_memory`; its `user_metadata`, like every entry's, is not needed) and
//!   other actions are not replayed, each counted in the notes; the `segment_*` and `oom`
//!   entries give [`Recorded`], what PyTorch itself reserved. A snapshot taken without traces
//!   (`include_traces=False`: every device's list empty) replays its live blocks alone.
//! - A history that wrapped (`max_entries` reached) or began late starts with frees of blocks
//!   allocated before it, and ends with blocks alive that it never saw allocated. Both kinds
//!   are taken as alive when the trace begins, as PyTorch's viewer (`MemoryViz.js`,
//!   `process_alloc_data`) draws them: a free of an address not alive is the free of a block of
//!   the entry's `size` and `stream` allocated before the trace; each `active_allocated` block
//!   of the device's `segments` that no `alloc` of the trace accounts for is a block of its
//!   `requested_size`, on its segment's stream, alive from before the trace to its end. They
//!   are allocated by the trace's first events, in address order (the recording allocator's
//!   layout; their real order is lost). `active_pending_free` blocks were freed by the program
//!   already and are not replayed. A `free_completed` of a block not alive is skipped, since
//!   the program had freed it before the window.
//! - An `alloc` at an address still alive (a free missing from the trace) frees the older
//!   block first. Each such repair, and each kind of entry skipped, is counted in the trace's
//!   notes.
//! - Private pools (CUDA graphs, `MemPool`) are replayed in the ordinary pools.
//!
//! `raw.rs` (in `snapshot/`): the parts of the snapshot's dict that the replay reads, taken
//! from the decoded pickle and checked, each bad or missing field an error naming where it is.

mod raw;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufRead;

use crate::limits::Budget;
use crate::pickle;
use crate::trace::{Recorded, Trace, TraceBuilder};
use raw::{Entry, Segment};

/// The most kinds of entries not replayed that the notes name one by one.
const MAX_NOTED_ACTIONS: usize = 10;

/// Whether `bytes` starts as a pickle of protocol 2 or later does (the `PROTO` opcode), which
/// no text trace does.
pub fn is_pickle(bytes: &[u8]) -> bool {
    bytes.len() >= 2 && bytes[0] == 0x80 && (2..=5).contains(&bytes[1])
}

/// Reads a PyTorch memory snapshot pickle from `r`: one trace for each device with entries or
/// live blocks, or only device `device` when it is given. `name` names the traces (with
/// `:device N` added when the snapshot has more than one). The pickle's objects and the
/// traces' events are charged to `budget`.
///
/// Errors: the bytes are not a pickle ([`crate::pickle::read`]), or not of a dict in the
/// snapshot's layout (the message names the field at fault and what was expected); the
/// snapshot has nothing to replay, or `device` has neither entries nor live blocks.
pub fn read_snapshot(
    name: &str,
    r: impl BufRead,
    device: Option<usize>,
    budget: &mut Budget,
) -> Result<Vec<Trace>, String> {
    let not = |e: String| format!("{name}: not a PyTorch memory snapshot ({e})");
    let pickled = pickle::read(r, budget, raw::is_read).map_err(not)?;
    let raw = raw::read(&pickled).map_err(not)?;
    // Each device's segments, and the devices with something to replay: only the numbers
    // that occur are visited, however large.
    let mut segments: BTreeMap<u64, Vec<&Segment>> = BTreeMap::new();
    for s in &raw.segments {
        segments.entry(s.device).or_default().push(s);
    }
    let mut used: BTreeSet<u64> =
        (0u64..).zip(&raw.device_traces).filter(|(_, t)| !t.is_empty()).map(|(d, _)| d).collect();
    for (&d, segs) in &segments {
        if segs.iter().any(|s| s.blocks.iter().any(|b| b.state != "inactive")) {
            used.insert(d);
        }
    }
    let chosen: Vec<u64> = match device.map(|d| d as u64) {
        Some(d) if used.contains(&d) => vec![d],
        Some(d) => {
            let with: Vec<String> = used.iter().map(u64::to_string).collect();
            return Err(format!(
                "{name}: device {d} has no trace entries and no live blocks in this snapshot (devices with some: {})",
                if with.is_empty() { "none".to_string() } else { with.join(", ") }
            ));
        }
        None if used.is_empty() => {
            return Err(format!(
                "{name}: the snapshot has no trace entries and no live blocks: nothing to replay (was the \
                 history recorded? torch.cuda.memory._record_memory_history() records it)"
            ));
        }
        None => used.iter().copied().collect(),
    };
    let several = used.len() > 1;
    let mut traces = Vec::new();
    for d in chosen {
        let entries = usize::try_from(d).ok().and_then(|d| raw.device_traces.get(d)).map_or(&[][..], |t| &t[..]);
        let segments = segments.get(&d).map_or(&[][..], |s| &s[..]);
        let trace_name = if several { format!("{name}:device {d}") } else { name.to_string() };
        let conf = raw.conf.clone();
        let trace = device_trace(trace_name, entries, segments, conf, budget).map_err(|e| format!("{name}: {e}"))?;
        traces.push(trace);
    }
    Ok(traces)
}

/// The trace of one device, as the module's documentation says.
///
/// Errors: the budget is spent.
fn device_trace(
    name: String,
    entries: &[Entry],
    segments: &[&Segment],
    conf: Option<String>,
    budget: &mut Budget,
) -> Result<Trace, String> {
    let free_action =
        if entries.iter().any(|e| e.action == "free_requested") { "free_requested" } else { "free_completed" };
    let mut b = TraceBuilder::new(budget);
    // Address -> id of the block alive there.
    let mut live: HashMap<u64, u32> = HashMap::new();
    let mut skipped: HashMap<&str, u64> = HashMap::new();
    let (mut before, mut realloc, mut no_addr) = (0u64, 0u64, 0u64);
    // The recording allocator's reserved bytes, relative to where the window began.
    let (mut reserved, mut lowest, mut highest) = (0i128, 0i128, 0i128);
    let (mut device_allocs, mut ooms, mut segment_events) = (0u64, 0u64, 0u64);
    for e in entries {
        let size = usize::try_from(e.size).unwrap_or(usize::MAX);
        match e.action {
            "alloc" | "free_requested" | "free_completed" if e.addr.is_none() => no_addr += 1,
            "alloc" => {
                let addr = e.addr.expect("checked above");
                if let Some(old) = live.remove(&addr) {
                    realloc += 1;
                    b.free(old)?;
                }
                live.insert(addr, b.alloc(size, e.stream)?);
            }
            a if a == free_action => {
                let addr = e.addr.expect("checked above");
                match live.remove(&addr) {
                    Some(id) => b.free(id)?,
                    None => {
                        before += 1;
                        let id = b.initial(size, e.stream, addr)?;
                        b.free(id)?;
                    }
                }
            }
            "free_completed" => {}
            "segment_alloc" | "segment_map" => {
                device_allocs += 1;
                segment_events += 1;
                reserved += e.size as i128;
                highest = highest.max(reserved);
            }
            "segment_free" | "segment_unmap" => {
                segment_events += 1;
                reserved -= e.size as i128;
                lowest = lowest.min(reserved);
            }
            "oom" => ooms += 1,
            other => *skipped.entry(other).or_default() += 1,
        }
    }
    // The blocks alive at the end that the trace never saw allocated.
    let mut at_end = 0u64;
    let mut accounted = 0usize;
    for s in segments {
        let mut addr = s.address;
        for block in &s.blocks {
            let at = block.address.unwrap_or(addr);
            addr = at.saturating_add(block.size);
            if block.state != "active_allocated" {
                continue;
            }
            if live.contains_key(&at) {
                accounted += 1;
            } else {
                let size = usize::try_from(block.requested_size.unwrap_or(block.size)).unwrap_or(usize::MAX);
                b.initial(size, s.stream, at)?;
                at_end += 1;
            }
        }
    }
    if before > 0 {
        b.note(format!("{before} blocks freed by the trace were allocated before it began: allocated first"));
    }
    if at_end > 0 {
        b.note(format!(
            "{at_end} blocks alive in the snapshot's segments were allocated before the trace began: allocated first"
        ));
    }
    if !segments.is_empty() && accounted < live.len() {
        b.note(format!(
            "{} blocks alive at the end of the trace are not active_allocated in the snapshot's segments",
            live.len() - accounted
        ));
    }
    if realloc > 0 {
        b.note(format!("{realloc} allocs at an address still alive: the older block was freed first"));
    }
    if no_addr > 0 {
        b.note(format!("{no_addr} alloc or free entries without an addr were skipped"));
    }
    let mut skipped: Vec<_> = skipped.into_iter().collect();
    skipped.sort();
    // A handful of kinds in a real snapshot; a list of any length in a made-up one.
    let others = skipped.len().saturating_sub(MAX_NOTED_ACTIONS);
    for (action, n) in skipped.into_iter().take(MAX_NOTED_ACTIONS) {
        b.note(format!("{n} '{action}' entries are not replayed"));
    }
    if others > 0 {
        b.note(format!("entries of {others} other actions are not replayed"));
    }
    // Reserved at the end is the segments' total; the window began `reserved` bytes below it.
    let at_end_reserved: i128 = segments.iter().map(|s| s.total_size as i128).sum();
    let start = at_end_reserved - reserved;
    let recorded = if segments.is_empty() && segment_events == 0 {
        None
    } else if start + lowest < 0 {
        b.note(format!(
            "the snapshot's segments ({at_end_reserved} bytes) and its segment events disagree: \
             no recorded peak"
        ));
        None
    } else {
        if segment_events == 0 {
            b.note("the trace has no segment events: the recorded peak is what the segments hold at its end".into());
        }
        Some(Recorded {
            peak_reserved: usize::try_from(start + highest).unwrap_or(usize::MAX),
            device_allocs,
            ooms,
            conf,
        })
    };
    Ok(b.finish(name, recorded))
}
