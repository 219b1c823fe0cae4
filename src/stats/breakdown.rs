//! Where a device's reserved bytes go beyond what the program asked for (gpupool's, not in
//! PyTorch): the bytes between live and reserved, split by cause, for the fragmentation
//! report of `gpupool-replay` (`driver_calls`) and `docs/fragmentation.md`.

/// The free mapped bytes of one stream's expandable segments of one pool and page size.
/// Bytes. A free block (or one in the front cache) counts as *at an edge* when a neighbour is
/// unmapped or it starts or ends its range (a growth's rounding up to whole pages lands there),
/// *between* when both neighbours are mapped blocks (the holes that dynamic shapes leave).
/// Its *whole pages* could be unmapped (`empty_cache` unmaps them; the high-water rule may);
/// its *partial pages* share a page with a block in use, so no unmapping at this page size can
/// give them back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RangeBytes {
    /// The stream of the shard (CUDA stream handle as an integer).
    pub stream: usize,
    /// Whether the ranges are of the large pool (requests over 1 MiB).
    pub large: bool,
    /// The ranges' page size.
    pub page: usize,
    /// Bytes mapped in those ranges (their share of `reserved_bytes`).
    pub mapped: usize,
    /// Whole free pages in free blocks between mapped blocks.
    pub whole_between: usize,
    /// Whole free pages in free blocks at an edge.
    pub whole_edge: usize,
    /// Free bytes in pages shared with a block in use, between mapped blocks.
    pub partial_between: usize,
    /// Free bytes in pages shared with a block in use, at an edge.
    pub partial_edge: usize,
}

impl RangeBytes {
    /// Every free byte of the row.
    pub fn free(&self) -> usize {
        self.whole_between + self.whole_edge + self.partial_between + self.partial_edge
    }
}

/// Where one device's reserved bytes go, taken with every stream's lock held (one consistent
/// state), without changing anything (the front cache is read as it is, not merged). Bytes.
/// `requested + rounding + pending + ordinary_free + ranges' free == reserved`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Breakdown {
    /// Mapped and allocated bytes (`reserved_bytes.all.current`).
    pub reserved: usize,
    /// What the live blocks asked for (`requested_bytes.all.current`).
    pub requested: usize,
    /// What the live blocks hold past it: PyTorch's rounding to 512 bytes, and blocks not
    /// split (`allocated_bytes - requested_bytes`).
    pub rounding: usize,
    /// Blocks freed but awaiting an event or a synchronisation (`record_stream`).
    pub pending: usize,
    /// Free bytes of ordinary segments (`cudaMalloc`'d, all streams).
    pub ordinary_free: usize,
    /// Free mapped bytes of expandable segments, per (stream, pool, page size), in the order
    /// of the device's shards.
    pub ranges: Vec<RangeBytes>,
    /// Physical pages held unmapped in the device's page pool, (page size, bytes); outside
    /// `reserved` (`unmapped_held_bytes`), device memory all the same.
    pub held: Vec<(usize, usize)>,
}

impl Breakdown {
    /// The sum of every cause, which equals [`Breakdown::reserved`].
    pub fn accounted(&self) -> usize {
        self.requested
            + self.rounding
            + self.pending
            + self.ordinary_free
            + self.ranges.iter().map(RangeBytes::free).sum::<usize>()
    }

    /// The row of (`stream`, `large`, `page`), added if missing.
    pub fn row(&mut self, stream: usize, large: bool, page: usize) -> &mut RangeBytes {
        let i = match self.ranges.iter().position(|r| (r.stream, r.large, r.page) == (stream, large, page)) {
            Some(i) => i,
            None => {
                self.ranges.push(RangeBytes { stream, large, page, ..RangeBytes::default() });
                self.ranges.len() - 1
            }
        };
        &mut self.ranges[i]
    }
}
