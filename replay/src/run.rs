//! Replaying a trace on an [`Allocator`]: a cold pass from an empty cache, then a warm pass
//! with what the first left cached, as `examples/c/bench.c` replays on the GPU.

use std::sync::Arc;
use std::time::Instant;

use gpupool::config::Config;
use gpupool::driver::StreamHandle;
use gpupool::driver::sim::SimDriver;
use gpupool::{Allocator, Error};

use crate::trace::{Event, Trace};

/// What a replay measured. Bytes are the allocator's statistics (PyTorch's
/// `torch.cuda.memory_stats`), read on the replayed device after each pass; peaks are never
/// reset between the passes, so the warm pass's figures include the cold pass's.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The most bytes reserved at once during the cold pass (`reserved_bytes.all.peak`): the
    /// segments taken from the driver, which is what the GPU gives up to the program.
    pub peak_reserved: usize,
    /// The same over both passes: above [`Outcome::peak_reserved`] when the warm pass, starting
    /// from the cache the cold pass left, needed more.
    pub peak_reserved_warm: usize,
    /// The most bytes allocated at once (`allocated_bytes.all.peak`, rounded sizes), cold pass.
    pub peak_allocated: usize,
    /// The most segments at once (`segment.all.peak`), cold pass.
    pub peak_segments: i64,
    /// Driver allocations during the cold pass (`num_device_alloc`: `cuMemAlloc` calls, and
    /// growths of expandable segments as PyTorch counts its `cuMemMap` calls).
    pub device_allocs: i64,
    /// Driver allocations during the warm pass.
    pub device_allocs_warm: i64,
    /// Times an allocation released the cache and retried (`num_alloc_retries`), both passes.
    pub alloc_retries: i64,
    /// Allocations that failed with out-of-memory during the cold pass. The replay goes on
    /// without the block (its free is skipped).
    pub ooms: u64,
    /// The same during the warm pass.
    pub ooms_warm: u64,
    /// The first allocation that ran out of memory in the cold pass: where a device of this
    /// size would have failed the program.
    pub first_oom: Option<FirstOom>,
    /// Calls that had to lock every stream of the device to settle the exact peaks during the
    /// warm pass (`Allocator::peak_settles`; see gpupool's `src/caching/accounting/peaks/`): a
    /// cost of gpupool's exact peaks that the hit path pays now and then. Not a PyTorch
    /// statistic.
    pub peak_settles_warm: i64,
    /// Wall time of the cold pass over the trace's events, in nanoseconds per event (with the
    /// driver's calls).
    pub cold_ns_per_event: f64,
    /// The same for the warm pass (the allocator's own cost once its cache holds the segments).
    pub warm_ns_per_event: f64,
}

/// The sim device's capacity when none is given: 80 GiB (the H100 the traces of
/// `replay/traces` were recorded on), or twice the largest live peak of `traces` rounded up to
/// a whole GiB when that is more, so that the trace never runs out of memory unless asked to. The capacity matters beyond
/// out-of-memory: expandable segments size their address ranges from the device's memory.
pub fn default_capacity(traces: &[Trace]) -> usize {
    const GIB: usize = 1 << 30;
    let live = traces.iter().map(Trace::peak_live).max().unwrap_or(0);
    (80 * GIB).max(live.saturating_mul(2).div_ceil(GIB).saturating_mul(GIB))
}

/// Replays `trace` on a fresh simulated device of `capacity` bytes under `config` (its driver
/// and `sim_*` fields are not used). Each stream of the trace is a stream of its own there.
///
/// Errors: any failure of the allocator other than out-of-memory (which is counted): a
/// failure there is a bug in gpupool.
pub fn replay_sim(trace: &Trace, config: &Config, capacity: usize) -> Result<Outcome, Error> {
    let a = Allocator::new(Arc::new(SimDriver::new(1, capacity)), config.clone());
    // Distinct, nonzero, pointer-like handles: the simulated device only tells streams apart.
    let streams: Vec<StreamHandle> = (1..=trace.streams.len()).map(|i| i * 0x100).collect();
    replay(&a, 0, trace, &streams)
}

/// Replays `trace` on `device` of `a`, stream number `i` of the trace on `streams[i]`: a
/// cold pass, every block still alive freed (untimed), then a warm pass and the same. `a`
/// should be fresh (no allocation yet) for the cold pass to start from an empty cache.
///
/// Errors: as [`replay_sim`]; also [`Error::InvalidValue`] when `streams` is shorter than the
/// trace's streams.
pub fn replay(a: &Allocator, device: i32, trace: &Trace, streams: &[StreamHandle]) -> Result<Outcome, Error> {
    if streams.len() < trace.streams.len() {
        return Err(Error::InvalidValue(format!(
            "the trace has {} streams and only {} were given",
            trace.streams.len(),
            streams.len()
        )));
    }
    let mut ptrs = vec![0u64; trace.blocks as usize];
    let before = a.stats(device)?;
    let cold_pass = pass(a, device, trace, streams, &mut ptrs)?;
    let cold = a.stats(device)?;
    let settles = a.peak_settles(device)?;
    let warm_pass = pass(a, device, trace, streams, &mut ptrs)?;
    let warm = a.stats(device)?;
    let peak_settles_warm = a.peak_settles(device)? - settles;
    let per_event = |ns: u128| if trace.events.is_empty() { 0.0 } else { ns as f64 / trace.events.len() as f64 };
    let bytes = |n: i64| usize::try_from(n).unwrap_or(0);
    Ok(Outcome {
        peak_reserved: bytes(cold.reserved_bytes.all.peak),
        peak_reserved_warm: bytes(warm.reserved_bytes.all.peak),
        peak_allocated: bytes(cold.allocated_bytes.all.peak),
        peak_segments: cold.segment.all.peak,
        device_allocs: cold.num_device_alloc - before.num_device_alloc,
        device_allocs_warm: warm.num_device_alloc - cold.num_device_alloc,
        alloc_retries: warm.num_alloc_retries - before.num_alloc_retries,
        ooms: cold_pass.ooms,
        ooms_warm: warm_pass.ooms,
        first_oom: cold_pass.first_oom,
        peak_settles_warm,
        cold_ns_per_event: per_event(cold_pass.ns),
        warm_ns_per_event: per_event(warm_pass.ns),
    })
}

/// The first allocation of a pass that ran out of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstOom {
    /// Its index in [`Trace::events`], from 0 (the blocks alive before the trace, allocated
    /// first, count).
    pub event: usize,
    /// The bytes it asked for.
    pub size: usize,
}

/// What one [`pass`] measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pass {
    /// The time the events took, in nanoseconds.
    pub ns: u128,
    /// Allocations that ran out of memory (their frees are skipped).
    pub ooms: u64,
    /// The first of them.
    pub first_oom: Option<FirstOom>,
}

/// One pass over `trace`'s events on `device` of `a` (stream number `i` on `streams[i]`), the
/// pointers of live blocks kept in `ptrs` (one per block id, 0 when none; all 0 on return):
/// then frees what is still alive, untimed. [`replay`] runs two; a caller that counts
/// something between passes (the driver's calls, say) runs them itself.
///
/// Errors: any failure of the allocator other than out-of-memory.
pub fn pass(
    a: &Allocator,
    device: i32,
    trace: &Trace,
    streams: &[StreamHandle],
    ptrs: &mut [u64],
) -> Result<Pass, Error> {
    pass_watched(a, device, trace, streams, ptrs, |_, _| Ok(()))
}

/// [`pass`], calling `after(i, event)` after each event `i` (in the timed part: a watcher that
/// reads the allocator is timed with it). The one loop both [`pass`] and the breakdown's pass
/// (`crate::breakdown::pass`) run, so that both lay blocks out alike.
///
/// Errors: any failure of the allocator other than out-of-memory, and the watcher's.
pub fn pass_watched(
    a: &Allocator,
    device: i32,
    trace: &Trace,
    streams: &[StreamHandle],
    ptrs: &mut [u64],
    mut after: impl FnMut(usize, &Event) -> Result<(), Error>,
) -> Result<Pass, Error> {
    let mut ooms = 0;
    let mut first_oom = None;
    let t0 = Instant::now();
    for (i, e) in trace.events.iter().enumerate() {
        match *e {
            Event::Alloc { id, size, stream } => match a.malloc(size, device, streams[stream as usize]) {
                Ok(p) => ptrs[id as usize] = p,
                Err(Error::OutOfMemory(_)) => {
                    ooms += 1;
                    first_oom.get_or_insert(FirstOom { event: i, size });
                }
                Err(e) => return Err(e),
            },
            Event::Free { id } => {
                let p = std::mem::take(&mut ptrs[id as usize]);
                if p != 0 {
                    a.free(p)?;
                }
            }
        }
        after(i, e)?;
    }
    let ns = t0.elapsed().as_nanos();
    for p in ptrs.iter_mut().filter(|p| **p != 0) {
        a.free(std::mem::take(p))?;
    }
    Ok(Pass { ns, ooms, first_oom })
}
