//! Where the bytes between live and reserved go, at a pass's peak of reserved and at its peak
//! of live, on the simulated device: [`gpupool::stats::breakdown::Breakdown`] taken during a
//! replay (`examples/driver_calls.rs` prints it; `docs/fragmentation.md` keeps the table).

use gpupool::driver::StreamHandle;
use gpupool::driver::sim::SimDriver;
use gpupool::stats::breakdown::Breakdown;
use gpupool::{Allocator, Error};

use crate::run::Pass;
use crate::trace::{Event, Trace};

/// The device's [`Breakdown`] at two moments of one pass. Peaks are of the pass alone.
#[derive(Clone, Debug, Default)]
pub struct Peaks {
    /// Taken after the allocation that first brought reserved bytes to the pass's highest.
    pub at_reserved: Breakdown,
    /// Taken after the allocation that first brought the trace's live bytes (requested, before
    /// rounding) to their highest.
    pub at_live: Breakdown,
}

/// The index of the event after which the trace's live bytes first reach their peak.
fn live_peak_event(trace: &Trace) -> Option<usize> {
    let mut size = vec![0usize; trace.blocks as usize];
    let (mut live, mut peak, mut at) = (0usize, 0usize, None);
    for (i, e) in trace.events.iter().enumerate() {
        match *e {
            Event::Alloc { id, size: s, .. } => {
                size[id as usize] = s;
                live += s;
                if live > peak {
                    (peak, at) = (live, Some(i));
                }
            }
            Event::Free { id } => live -= std::mem::take(&mut size[id as usize]),
        }
    }
    at
}

/// [`crate::run::pass`] on `a`, whose driver is `drv`, with the [`Peaks`]: the breakdown is
/// read after each allocation that called the driver to map, unmap, allocate or free
/// (reserved bytes change only then) and kept when reserved passes the pass's highest so far,
/// and once at the peak of live bytes; a pass that calls the driver for nothing, or never
/// passes what it held at the peak of live, has its peak of reserved there. Reading it changes nothing in the allocator (front
/// caches are read, not merged), so the pass lays blocks out as [`crate::run::pass`] does.
///
/// Errors: any failure of the allocator other than out-of-memory.
pub fn pass(
    a: &Allocator,
    drv: &SimDriver,
    device: i32,
    trace: &Trace,
    streams: &[StreamHandle],
    ptrs: &mut [u64],
) -> Result<(Pass, Peaks), Error> {
    let live_at = live_peak_event(trace);
    let calls = || {
        let c = drv.counts();
        c.mem_map + c.mem_unmap + c.mem_alloc + c.mem_free
    };
    let mut peaks = Peaks::default();
    let mut seen = calls();
    let pass = crate::run::pass_watched(a, device, trace, streams, ptrs, |i, e| {
        if matches!(e, Event::Alloc { .. }) {
            let now = calls();
            if now != seen {
                seen = now;
                let b = a.breakdown(device)?;
                if b.reserved > peaks.at_reserved.reserved || peaks.at_reserved == Breakdown::default() {
                    peaks.at_reserved = b;
                }
            }
        }
        if live_at == Some(i) {
            peaks.at_live = a.breakdown(device)?;
        }
        Ok(())
    })?;
    // No driver call in the pass: reserved stayed as the pass found it, its peak all along.
    if peaks.at_reserved == Breakdown::default() || peaks.at_reserved.reserved < peaks.at_live.reserved {
        peaks.at_reserved = peaks.at_live.clone();
    }
    Ok((pass, peaks))
}

/// MiB, one decimal.
fn mib(n: usize) -> String {
    format!("{:.1}", n as f64 / 1048576.0)
}

/// One line of `b`, MiB: reserved and its share of requested, then each cause; the expandable
/// segments' free bytes summed by page size and pool (whole pages between / at an edge,
/// partial pages between / at an edge), and, with several streams, by stream; the pages held unmapped.
pub fn line(b: &Breakdown) -> String {
    let mut s = format!(
        "reserved {} = live {} ({:.3}) + rounding {} + pending {} + ordinary free {}",
        mib(b.reserved),
        mib(b.requested),
        b.reserved as f64 / b.requested.max(1) as f64,
        mib(b.rounding),
        mib(b.pending),
        mib(b.ordinary_free)
    );
    let mut kinds: Vec<(usize, bool)> = b.ranges.iter().map(|r| (r.page, r.large)).collect();
    kinds.sort_unstable();
    kinds.dedup();
    for (page, large) in kinds {
        let rows = b.ranges.iter().filter(|r| (r.page, r.large) == (page, large));
        let sum = |f: fn(&gpupool::stats::breakdown::RangeBytes) -> usize| rows.clone().map(f).sum::<usize>();
        s += &format!(
            " + {}M {} pages: whole {}/{} partial {}/{}",
            page >> 20,
            if large { "large" } else { "small" },
            mib(sum(|r| r.whole_between)),
            mib(sum(|r| r.whole_edge)),
            mib(sum(|r| r.partial_between)),
            mib(sum(|r| r.partial_edge))
        );
    }
    let mut streams: Vec<usize> = b.ranges.iter().map(|r| r.stream).collect();
    streams.sort_unstable();
    streams.dedup();
    if streams.len() > 1 {
        for st in streams {
            let free: usize = b.ranges.iter().filter(|r| r.stream == st).map(|r| r.free()).sum();
            s += &format!("; stream {st:#x} free {}", mib(free));
        }
    }
    for &(page, bytes) in &b.held {
        s += &format!("; held {}M pages {}", page >> 20, mib(bytes));
    }
    if b.accounted() != b.reserved {
        s += &format!(" (UNACCOUNTED: {} of {})", b.accounted(), b.reserved);
    }
    s
}
