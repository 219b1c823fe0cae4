//! The allocator's part of the allocation history: recording on every device, snapshots, the
//! statistics of tags and the live report (PyTorch `_record_memory_history` and `_snapshot`;
//! see `crate::history`).

use std::sync::Arc;

use crate::caching::allocator::Allocator;
use crate::driver::DevicePtr;
use crate::error::Error;
use crate::history::{AllocatorSettings, HistorySettings, Snapshot, TagStats, tags};

impl Allocator {
    /// Starts, changes or stops the allocation history of every device (PyTorch
    /// `torch.cuda.memory._record_memory_history`): with `Some(settings)`, each device keeps
    /// its newest `settings.max_entries` events (alloc, frees, segments, maps and unmaps,
    /// out-of-memory, snapshots) and the call stacks `settings.context` asks for; a trace
    /// recorded already keeps its newest events up to the new limit. `None` stops recording and
    /// forgets every trace. When stacks stop being kept (`None`, or a context below
    /// [`HistoryContext::State`](crate::history::HistoryContext::State)), the live blocks
    /// forget theirs too; with `None`, the Python code objects that stacks refer to are given
    /// back, under the GIL (see `crate::history`'s `python`).
    ///
    /// Costs, while off, one relaxed load per malloc and free; while on, see docs/history.md
    /// (the table of what it costs). Calls that race with this one record with the old
    /// settings or the new ones.
    ///
    /// Errors: [`Error::DriverUnavailable`] in a process forked from one that used gpupool.
    pub fn record_history(&self, settings: Option<HistorySettings>) -> Result<(), Error> {
        crate::caching::fork::check()?;
        let starting = self.starting.lock();
        let level = self.recorder.set(settings);
        for dev in self.devices.iter().filter_map(|d| d.get()) {
            dev.set_history_level(level);
        }
        drop(starting);
        if settings.is_none() {
            // With no lock held: it takes the GIL.
            self.recorder.contexts.release_python();
        }
        Ok(())
    }

    /// What the history records now; `None` when it is off.
    pub fn history(&self) -> Option<HistorySettings> {
        self.recorder.settings()
    }

    /// Every segment of every device in use, with its blocks, and each device's trace
    /// (PyTorch `torch.cuda.memory._snapshot()`); [`Snapshot::to_pickle`] writes PyTorch's
    /// file. Each device is taken with all its streams locked, as one consistent state; while
    /// history is on, its trace ends with the `snapshot` event this call records. Stacks are
    /// symbolised here, after the locks are released (the first time, reading the debug
    /// information of every library in them can take seconds). Works with history off too:
    /// the segments, no trace, no stacks.
    ///
    /// Errors: [`Error::DriverUnavailable`] in a process forked from one that used gpupool.
    pub fn snapshot(&self) -> Result<Snapshot, Error> {
        self.snapshot_with(true)
    }

    /// [`Allocator::snapshot`], with each device's trace only when `include_traces` (PyTorch
    /// `torch.cuda.memory_snapshot(include_traces=...)`, `MemPool.snapshot`, PR #172672):
    /// without, `device_traces` holds one empty list per device and nothing of the traces is
    /// copied or symbolised, so that the snapshot costs what its segments and blocks cost,
    /// however many events the history holds (docs/history.md has the figures). The segments,
    /// their blocks and their stacks are as with traces; while history is on, the `snapshot`
    /// event is recorded all the same, for a later snapshot with traces.
    ///
    /// Errors: as [`Allocator::snapshot`].
    pub fn snapshot_with(&self, include_traces: bool) -> Result<Snapshot, Error> {
        crate::caching::fork::check()?;
        let mut segments = Vec::new();
        let mut traces = vec![Vec::new(); self.devices.len()];
        let mut held = vec![0; self.devices.len()];
        for ((trace, held), dev) in traces.iter_mut().zip(held.iter_mut()).zip(self.devices.iter()) {
            if let Some(dev) = dev.get() {
                (*trace, *held) = dev.snapshot_into(&mut segments, include_traces);
            }
        }
        let c = self.config();
        let settings = AllocatorSettings {
            conf: c.conf_string(),
            max_split_size: c.max_split_size,
            garbage_collection_threshold: c.garbage_collection_threshold,
            expandable_segments: c.expandable_segments,
            pinned_num_register_threads: c.pinned_num_register_threads,
            release_lock_on_cudamalloc: c.release_lock_on_cudamalloc,
            pinned_use_cuda_host_register: c.pinned_use_cuda_host_register,
            roundup_power2_divisions: c.roundup_power2_divisions.to_vec(),
        };
        Ok(Snapshot::assemble(&self.recorder.contexts, segments, traces, settings, held))
    }

    /// Records an `annotate` event for the allocated block at `ptr` (PyTorch
    /// `torch.cuda.memory._annotate_memory`, `TraceEntry::ANNOTATE`, PR #190575): metadata
    /// attached after the allocation, which PyTorch's viewer shows beside the block's own. The
    /// event carries the block's address, requested size and stream, `metadata` as its
    /// `user_metadata` and, where events keep stacks, the caller's; annotations of one block
    /// accumulate, each an event of its own, and change nothing the allocation recorded. While
    /// history is off, nothing is recorded (as PyTorch), but `ptr` and `metadata` are checked
    /// all the same.
    ///
    /// `ptr` is the address [`Allocator::malloc`] returned: PyTorch annotates the base of a
    /// tensor's storage (`_annotate_tensor`), and so must a caller holding an interior pointer.
    ///
    /// Errors, each recording nothing: [`Error::InvalidValue`] for metadata that fails
    /// [`crate::history::metadata::check`] (too long, or JSON that does not parse);
    /// [`Error::InvalidPointer`] when `ptr` is not an allocated block (never allocated by this
    /// allocator, freed, or inside a block); [`Error::DriverUnavailable`] in a process forked
    /// from one that used gpupool. Thread-safe; a block freed on another thread at the same time
    /// is either annotated before its free (the event precedes its `free_requested`) or
    /// reported freed.
    pub fn annotate_memory(&self, ptr: DevicePtr, metadata: &str) -> Result<(), Error> {
        crate::caching::fork::check()?;
        let meta: Arc<str> = crate::history::metadata::check(metadata.as_bytes())?.into();
        self.index.with_segment(ptr, |seg| match seg {
            None => Err(Error::InvalidPointer(format!("pointer {ptr:#x} was not allocated by gpupool"))),
            Some(e) => self.used_device(e.device)?.annotate(&e.owner, ptr, meta),
        })
    }

    /// The statistics of the blocks allocated under tag `name` (see [`crate::history::tags`]),
    /// over every device: bytes (rounded, as `allocated_bytes`) and blocks, each current, peak,
    /// allocated and freed. A block freed on another thread, or under another tag, counts to
    /// the tag it was allocated under. Lock-free but for a read lock; the figures of a block
    /// allocated or freed meanwhile may show in some and not yet in others.
    ///
    /// Errors: [`Error::InvalidValue`] when no thread of the process ever pushed `name`.
    pub fn tag_stats(&self, name: &str) -> Result<TagStats, Error> {
        let id = tags::id_of(name)
            .ok_or_else(|| Error::InvalidValue(format!("no tag named {name:?} was ever pushed in this process")))?;
        Ok(self.recorder.tags.get(id))
    }

    /// Every tag pushed in the process, in the order first pushed, with its statistics on this
    /// allocator (as [`Allocator::tag_stats`]; zero where none of its blocks were allocated
    /// here).
    pub fn all_tag_stats(&self) -> Vec<(Arc<str>, TagStats)> {
        tags::names().into_iter().enumerate().map(|(i, n)| (n, self.recorder.tags.get(i as u32 + 1))).collect()
    }

    /// The live report of `device` (-1: current): its allocated blocks grouped by tag, then
    /// by the call stack that allocated them (where history kept stacks, with
    /// [`HistoryContext::State`](crate::history::HistoryContext::State) or more, when they
    /// were allocated), largest first (bytes, then blocks), one line a row. Stacks are
    /// symbolised here (the first time, reading debug information can take seconds). Each
    /// stream is read under its lock in turn: allocations on other streams go on meanwhile.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn live_report(&self, device: i32) -> Result<String, Error> {
        let dev = self.device_or_init(device)?;
        Ok(crate::history::live_report(dev.device, &self.recorder.contexts, &dev.live_blocks()))
    }
}
