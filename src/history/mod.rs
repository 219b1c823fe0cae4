//! Allocation history and snapshots, in PyTorch's terms and formats: what
//! `torch.cuda.memory._record_memory_history()` records, what `torch.cuda.memory._snapshot()`
//! returns and what `_dump_snapshot()` writes, so that PyTorch's memory viewer
//! (`torch.cuda._memory_viz`, the memory_viz page) reads gpupool's snapshots as it reads
//! PyTorch's.
//!
//! - `entry`: one event as recorded, its stack still an id;
//! - `frame`: one frame of a symbolised stack ([`Frame`]);
//! - `native`: native frames: unwound, symbolised, gpupool's own left out;
//! - `ring`: the trace of one device, the newest `max_entries` events (PyTorch
//!   `RingBuffer<TraceEntry>`);
//! - `stacks`: call stacks, captured unresolved and interned, symbolised when a snapshot is
//!   taken (PyTorch `CapturedTraceback` with `symbolize`);
//! - `python`: the Python frames of a stack under CPython, found at run time (PyTorch's
//!   `stacks="all"`/`"python"`);
//! - `recorder`: the recorder of an allocator and the flag each device reads on its malloc
//!   and free paths;
//! - `snapshot`: what a snapshot holds ([`Snapshot`]);
//! - `pickle`: the snapshot as PyTorch's pickle, each string, frame and stack written once;
//! - [`tags`]: names a thread pushes, carried by the blocks it allocates, and counted per name;
//! - [`metadata`]: the string a thread sets for the events it records (PyTorch's
//!   `user_metadata`), and the payload of `annotate` events;
//! - `report`: the live report, a device's allocated blocks grouped by tag and by call stack,
//!   largest first (`Allocator::live_report`).
//!
//! Recording costs the malloc and free paths one relaxed load of the device's flag while it is
//! off. The allocator core calls the recorder at each event (`src/caching`), under the lock of
//! the shard the event changes, so that a device's trace is in the order the events happened.

mod entry;
mod frame;
pub mod metadata;
mod native;
mod pickle;
mod python;
mod recorder;
mod report;
mod ring;
mod snapshot;
mod stacks;
pub mod tags;

pub(crate) use entry::Entry;
pub use frame::Frame;
pub(crate) use python::Scope;
pub(crate) use recorder::{HistoryHook, Recorder};
pub(crate) use report::live_report;
pub(crate) use snapshot::RawSegment;
pub use snapshot::{AllocatorSettings, BlockState, Snapshot, SnapshotBlock, SnapshotSegment, TraceEntry};
pub(crate) use stacks::ContextTable;
pub use tags::TagStats;

/// Which call stacks are kept (PyTorch `RecordContext`, the `context` argument of
/// `torch.cuda.memory._record_memory_history`). Each level keeps what the one before it keeps.
/// A stack is the native stack of the thread that called gpupool, innermost frame first,
/// gpupool's own frames left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HistoryContext {
    /// No stacks (PyTorch `context=None`): the trace and the snapshot's `frames` are empty.
    None = 0,
    /// The stack of each allocation, kept with its block while it is live, for the snapshot's
    /// `segments` (PyTorch `context="state"`): a block's `frames` say who allocated it, a
    /// segment's who made it.
    State = 1,
    /// Also the stack on each `alloc`, `segment_alloc`, `segment_map` and `oom` event of the
    /// trace; the `free_requested` and `free_completed` events of a block carry its
    /// allocation's stack (PyTorch `context="alloc"`).
    Alloc = 2,
    /// Also a stack captured at each free (PyTorch `context="all"`), on its `free_requested`
    /// event and, when the block is returned at once, its `free_completed`.
    All = 3,
}

impl HistoryContext {
    /// The level numbered `value` (0 to 3, as PyTorch numbers `RecordContext`).
    pub fn from_u32(value: u32) -> Option<HistoryContext> {
        [HistoryContext::None, HistoryContext::State, HistoryContext::Alloc, HistoryContext::All]
            .into_iter()
            .find(|c| *c as u32 == value)
    }

    /// The name PyTorch's `_record_memory_history` gives the level: `none`, `state`, `alloc`,
    /// `all`.
    pub fn name(self) -> &'static str {
        match self {
            HistoryContext::None => "none",
            HistoryContext::State => "state",
            HistoryContext::Alloc => "alloc",
            HistoryContext::All => "all",
        }
    }
}

/// What an allocator records while history is on ([`crate::Allocator::record_history`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistorySettings {
    /// Events kept per device: the newest this many (PyTorch `max_entries`). 0 keeps none,
    /// only the per-block state of [`HistoryContext::State`] (PyTorch's `enabled="state"`).
    pub max_entries: usize,
    /// Which call stacks are kept.
    pub context: HistoryContext,
    /// Which frames a stack holds: native, Python, or both.
    pub stacks: HistoryStacks,
}

/// Which frames a stack holds (PyTorch's `stacks` argument of `_record_memory_history`).
/// Python frames are those of the calling thread when the process runs CPython and the thread
/// has a Python thread state (see `docs/history.md`); in a C or C++ program there are none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HistoryStacks {
    /// Native frames, the Python frames in place of the interpreter's evaluation loops
    /// (PyTorch `stacks="all"`, its default).
    #[default]
    All = 0,
    /// Python frames only, no native unwinding (PyTorch `stacks="python"`): a thread without
    /// Python frames records an empty stack.
    Python = 1,
    /// Native frames only, Python never read.
    Native = 2,
}

impl HistoryStacks {
    /// The mode numbered `value` (see [`HistoryStacks`]).
    pub fn from_u32(value: u32) -> Option<HistoryStacks> {
        [HistoryStacks::All, HistoryStacks::Python, HistoryStacks::Native].into_iter().find(|s| *s as u32 == value)
    }

    /// Its name: `all`, `python`, `native`.
    pub fn name(self) -> &'static str {
        match self {
            HistoryStacks::All => "all",
            HistoryStacks::Python => "python",
            HistoryStacks::Native => "native",
        }
    }
}

/// The kind of an event of the trace, with PyTorch's name for it (`TraceEntry::Action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// A block handed to a caller (`alloc`): address and size of the block, the size asked.
    Alloc,
    /// The caller freed a block (`free_requested`); it may still wait for the events of
    /// `record_stream` or for a device synchronisation.
    FreeRequested,
    /// The freed block went back to its pool (`free_completed`): at once after its
    /// `free_requested`, or once its events completed or the device was synchronised.
    FreeCompleted,
    /// A segment obtained from the driver (`segment_alloc`, `cuMemAlloc`).
    SegmentAlloc,
    /// A segment given back to the driver (`segment_free`, `cuMemFree`).
    SegmentFree,
    /// Pages mapped into an expandable segment (`segment_map`): address and bytes.
    SegmentMap,
    /// Pages of an expandable segment unmapped and released (`segment_unmap`).
    SegmentUnmap,
    /// A request failed for lack of memory (`oom`): the bytes the device had free, and the
    /// rounded size asked.
    Oom,
    /// A snapshot was taken (`snapshot`): the device's active bytes then.
    Snapshot,
    /// Metadata attached to a live block after its allocation (`annotate`, PyTorch
    /// `TraceEntry::ANNOTATE`, `torch.cuda.memory._annotate_memory`): the block's address, its
    /// requested size, and the annotation as the event's `user_metadata`.
    Annotate,
}

impl Action {
    /// PyTorch's name for the action, as the snapshot's `device_traces` write it.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::Annotate => "annotate",
        }
    }
}
