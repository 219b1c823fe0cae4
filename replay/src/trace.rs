//! A trace as the replay sees it: allocations and frees of numbered blocks on numbered streams,
//! in program order, whatever file it came from.

use std::collections::HashMap;

use crate::limits::Budget;

/// One step of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The program allocates a block.
    Alloc {
        /// The block's number: dense (`0..Trace::blocks`), never reused.
        id: u32,
        /// Bytes the program asked for, before any rounding.
        size: usize,
        /// The stream's number, an index into [`Trace::streams`].
        stream: u32,
    },
    /// The program frees a block.
    Free {
        /// The number of a block allocated before and not yet freed.
        id: u32,
    },
}

/// What the allocator that recorded a PyTorch snapshot did over the trace's window, from its
/// `segment_*` events and the segments at the end (see [`crate::snapshot`]). Absent for the
/// text traces, which hold the program's requests only.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    /// The most bytes the recording allocator had reserved (segments allocated, or pages
    /// mapped into expandable segments) at one time during the window.
    pub peak_reserved: usize,
    /// Its `segment_alloc` and `segment_map` events in the window: the driver allocations
    /// PyTorch counts in `num_device_alloc` (`cudaMalloc`, `cuMemMap`).
    pub device_allocs: u64,
    /// Its `oom` events in the window.
    pub ooms: u64,
    /// `PYTORCH_CUDA_ALLOC_CONF` as the snapshot's `allocator_settings` give it, when they do.
    pub conf: Option<String>,
}

/// A trace of one device, ready to replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// Where it came from, for the report: the file name, with the device when a snapshot has
    /// traces of several.
    pub name: String,
    /// The events in program order. Blocks that were alive before the trace began (see
    /// [`Trace::initial_blocks`]) are allocated by its first events.
    pub events: Vec<Event>,
    /// The stream ids of the trace (CUDA stream handles as integers; 0 is the legacy default
    /// stream), by the stream numbers of [`Event::Alloc`].
    pub streams: Vec<i64>,
    /// How many block ids the events use.
    pub blocks: u32,
    /// How many of the first events allocate blocks that were alive before the trace began.
    pub initial_blocks: u32,
    /// Oddities met while reading it (frees of unknown blocks skipped, and the like), one line
    /// each, for the report's notes.
    pub notes: Vec<String>,
    /// What the recording allocator did, for a PyTorch snapshot.
    pub recorded: Option<Recorded>,
}

impl Trace {
    /// The most bytes live at once: the running sum of the requested sizes of the blocks
    /// allocated and not yet freed, at its highest (before any rounding: the floor that no
    /// allocator's reserved bytes can go under).
    pub fn peak_live(&self) -> usize {
        let mut size = vec![0usize; self.blocks as usize];
        let (mut live, mut peak) = (0usize, 0usize);
        for e in &self.events {
            match *e {
                Event::Alloc { id, size: s, .. } => {
                    size[id as usize] = s;
                    live += s;
                    peak = peak.max(live);
                }
                Event::Free { id } => live -= std::mem::take(&mut size[id as usize]),
            }
        }
        peak
    }

    /// How many events are allocations.
    pub fn allocations(&self) -> usize {
        self.events.iter().filter(|e| matches!(e, Event::Alloc { .. })).count()
    }
}

/// Builds a [`Trace`]: numbers the blocks and streams as they come, and keeps the blocks alive
/// before the trace apart, to be allocated first. Each event is charged to a [`Budget`].
pub(crate) struct TraceBuilder<'b> {
    /// The blocks alive before the trace, with the keys they are sorted by.
    initial: Vec<(u64, Event)>,
    events: Vec<Event>,
    streams: Vec<i64>,
    stream_numbers: HashMap<i64, u32>,
    blocks: u32,
    notes: Vec<String>,
    budget: &'b mut Budget,
}

impl<'b> TraceBuilder<'b> {
    pub fn new(budget: &'b mut Budget) -> TraceBuilder<'b> {
        TraceBuilder {
            initial: Vec::new(),
            events: Vec::new(),
            streams: Vec::new(),
            stream_numbers: HashMap::new(),
            blocks: 0,
            notes: Vec::new(),
            budget,
        }
    }

    fn stream(&mut self, stream: i64) -> u32 {
        let next = self.streams.len() as u32;
        *self.stream_numbers.entry(stream).or_insert_with(|| {
            self.streams.push(stream);
            next
        })
    }

    /// A new block id, and the event's cost charged.
    fn next_id(&mut self) -> Result<u32, String> {
        // The event, and the live map entry that the reader keeps for it.
        self.budget.charge(std::mem::size_of::<Event>() as u64 + 24)?;
        let id = self.blocks;
        self.blocks = self.blocks.checked_add(1).ok_or("over 2^32 blocks: more than the replay takes")?;
        Ok(id)
    }

    /// A block allocated by the program during the trace; returns its id.
    ///
    /// Errors: the budget is spent, or the trace has 2^32 blocks already.
    pub fn alloc(&mut self, size: usize, stream: i64) -> Result<u32, String> {
        let id = self.next_id()?;
        let stream = self.stream(stream);
        self.events.push(Event::Alloc { id, size, stream });
        Ok(id)
    }

    /// A block that was alive when the trace began; it is allocated before every event of the
    /// trace, the blocks in the order of `key` (ties in the order of these calls). Returns its
    /// id.
    ///
    /// Errors: as [`TraceBuilder::alloc`].
    pub fn initial(&mut self, size: usize, stream: i64, key: u64) -> Result<u32, String> {
        let id = self.next_id()?;
        let stream = self.stream(stream);
        self.initial.push((key, Event::Alloc { id, size, stream }));
        Ok(id)
    }

    /// The program freed block `id`.
    ///
    /// Errors: the budget is spent.
    pub fn free(&mut self, id: u32) -> Result<(), String> {
        self.budget.charge(std::mem::size_of::<Event>() as u64)?;
        self.events.push(Event::Free { id });
        Ok(())
    }

    /// Keeps a line for the report's notes.
    pub fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    pub fn finish(self, name: String, recorded: Option<Recorded>) -> Trace {
        let initial_blocks = self.initial.len() as u32;
        let mut initial = self.initial;
        initial.sort_by_key(|&(key, _)| key);
        let mut events: Vec<Event> = initial.into_iter().map(|(_, e)| e).collect();
        events.extend(self.events);
        Trace { name, events, streams: self.streams, blocks: self.blocks, initial_blocks, notes: self.notes, recorded }
    }
}
