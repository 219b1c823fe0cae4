//! The driver calls of a replay with expandable segments on the simulated device, cold pass
//! and warm pass, without and with the high-water rule (`GPUPOOL_EXPANDABLE_RECLAIM`): what
//! the rule costs, counted rather than timed. On a GPU each page mapped costs a `cuMemMap` and
//! its share of a `cuMemSetAccess`, plus a `cuMemCreate` unless a held handle is mapped, and
//! each page unmapped a `cuMemUnmap`, plus a `cuMemRelease` when its handle goes back to the
//! driver, tens of microseconds in all; the simulated device's times say nothing of that, so
//! the counts are what to compare. Each pass's counts: device synchronisations, waits for an
//! event (the rule unmapping the growing stream's own pages waits for that stream), handles
//! created, pages mapped, access grants, pages unmapped, handles released; then the pages
//! held unmapped in the device's pool after the pass and at most (2 MiB pages; the peak is
//! since the start); then where the bytes between live and reserved go, at the pass's peak of
//! reserved and at its peak of live (`gpupool_replay::breakdown::line`: MiB; free bytes of
//! expandable segments by page size, whole pages between live blocks / at a range's mapped
//! edge, then bytes sharing a page with a live block, between / at an edge; by stream when
//! there are several); the maps a multi-mapping allocator (GMLake) would have been spared
//! (the simulated driver's `multimap` counts: maps of a page whose address's last handle is
//! held unmapped, or is the page itself; the rest; runs of a growth all spared; 2 MiB pages of
//! address space ever mapped beside peak reserved). The ns/event include reading those
//! breakdowns.
//!
//!     cargo run --release -p gpupool-replay --example driver_calls -- [--no-rule] TRACE [CAPACITY_GIB]
//!     driver_calls --cuda TRACE [REPEATS]
//!
//! `--no-rule`: only the replay without the rule (the default's), in half the time.
//!
//! TRACE `random`: `bench`'s random working set (`random_trace` in `examples/c/bench.c`: the
//! same generator, seed and sizes, 100,000 events, sizes log-uniform from 256 B to 4 GiB, up to
//! 1,000 live), made here rather than read.
//!
//! `GPUPOOL_EXPANDABLE_LARGE_PAGES` and `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST` are read from
//! the environment (gpupool's defaults otherwise: requests of 20 MiB and more map 20 MiB
//! pages, or larger ones past 16 a request, in ranges of their own).
//!
//! TRACE `synthetic-bert`: a synthetic dynamic-shape trace, made up here and not recorded
//! (`synthetic_bert`): BERT-base inference in fp16 at random batches (1-32) and sequence
//! lengths (16-512), the tensors of each layer allocated and freed in the order a forward pass
//! makes and drops them. For tests of dynamic shapes until recorded traces replace it.
//!
//! CAPACITY_GIB: the simulated device's memory (default 80, an H100's), which sizes the
//! expandable segments' address ranges. With `--cuda`, the same replays on device 0 of this
//! machine's GPU instead (a fresh allocator each, `REPEATS` times, default 3), timed: cold and
//! warm nanoseconds per event, without and with the rule, what the counts cost there.
use std::sync::Arc;

use gpupool::Allocator;
use gpupool::driver::sim::{SimCounts, SimDriver};
use gpupool_replay::{Event, Trace, breakdown, cuda, input, setting};

fn main() {
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).is_some_and(|a| a == "--cuda") {
        return on_gpu(&args[2..]);
    }
    let no_rule = args.get(1).is_some_and(|a| a == "--no-rule");
    if no_rule {
        args.remove(1);
    }
    if args.len() < 2 || args.len() > 3 {
        eprintln!("usage: driver_calls [--no-rule] TRACE [CAPACITY_GIB] | driver_calls --cuda TRACE [REPEATS]");
        std::process::exit(2);
    }
    let traces = load(&args[1]);
    let capacity = args.get(2).map_or(80usize << 30, |g| g.parse::<usize>().unwrap() << 30);
    let t = &traces[0];
    println!("{}: {} events, peak live {:.1} MiB", args[1], t.events.len(), t.peak_live() as f64 / 1048576.0);
    let rules: &[bool] = if no_rule { &[false] } else { &[false, true] };
    for &reclaim in rules {
        // GPUPOOL_EXPANDABLE_LARGE_PAGES from the environment, read by gpupool's own parser.
        let config = expandable(reclaim);
        let drv = Arc::new(SimDriver::new(1, capacity));
        let a = Allocator::new(drv.clone(), config);
        let streams: Vec<usize> = (1..=t.streams.len()).map(|i| i * 0x100).collect();
        let mut ptrs = vec![0u64; t.blocks as usize];
        for pass in ["cold", "warm"] {
            let c0 = drv.counts();
            // The counts include the frees after the pass: with expandable segments a free
            // calls the driver for nothing, so they count what the events did.
            let (done, peaks) = breakdown::pass(&a, &drv, 0, t, &streams, &mut ptrs).expect("replay");
            let ns = done.ns;
            let c1 = drv.counts();
            let ns = ns as f64 / t.events.len() as f64;
            let d = |f: fn(&SimCounts) -> u64| f(&c1) - f(&c0);
            let s = a.stats(0).unwrap();
            println!(
                "reclaim {reclaim:5} {pass}: syncs {:5} event waits {:5} create {:6} map {:6} set_access {:6} unmap {:6} \
                 release {:6}; held now/peak {}/{} pages; reserved/live {:.3}; {ns:.0} ns/event (sim)",
                d(|c| c.device_synchronize),
                d(|c| c.event_synchronize),
                d(|c| c.mem_create),
                d(|c| c.mem_map),
                d(|c| c.mem_set_access),
                d(|c| c.mem_unmap),
                d(|c| c.mem_release),
                s.unmapped_held_bytes.current >> 21,
                s.unmapped_held_bytes.peak >> 21,
                s.reserved_bytes.all.peak as f64 / t.peak_live() as f64
            );
            println!(
                "  multi-mapping: maps returnable {} same {} new {} (fresh {}); runs spared {}/{}; address space mapped \
                 {} pages (new this pass {}), peak reserved {} pages",
                d(|c| c.map_returnable),
                d(|c| c.map_same),
                d(|c| c.map_new),
                d(|c| c.map_fresh),
                d(|c| c.map_runs_spared),
                d(|c| c.map_runs),
                c1.va_pages_first_mapped,
                d(|c| c.va_pages_first_mapped),
                s.reserved_bytes.all.peak >> 21
            );
            println!("  at peak reserved: {}", breakdown::line(&peaks.at_reserved));
            println!("  at peak live:     {}", breakdown::line(&peaks.at_live));
        }
    }
}

/// The replays of `main` on the GPU, timed.
fn on_gpu(args: &[String]) {
    let traces = load(&args[0]);
    let repeats = args.get(1).map_or(3, |r| r.parse::<usize>().unwrap());
    let gpu = cuda::Gpu::open().expect("a GPU");
    let t = &traces[0];
    println!(
        "{} on the GPU: {} events, peak live {:.1} MiB",
        args[0],
        t.events.len(),
        t.peak_live() as f64 / 1048576.0
    );
    for reclaim in [false, true] {
        // GPUPOOL_EXPANDABLE_LARGE_PAGES from the environment, read by gpupool's own parser.
        let config = expandable(reclaim);
        for _ in 0..repeats {
            let o = gpu.replay(t, &config).expect("replay");
            println!(
                "reclaim {reclaim:5}: cold {:8.0} ns/event, warm {:8.0} ns/event; reserved/live {:.3}",
                o.cold_ns_per_event,
                o.warm_ns_per_event,
                o.peak_reserved_warm as f64 / t.peak_live() as f64
            );
        }
    }
}

/// Expandable segments, with the high-water rule or not, and `GPUPOOL_EXPANDABLE_LARGE_PAGES`
/// from the environment, read by gpupool's own parser.
fn expandable(reclaim: bool) -> gpupool::config::Config {
    let mut row = "GPUPOOL_CONF=expandable_segments:True".to_string();
    for name in ["GPUPOOL_EXPANDABLE_LARGE_PAGES", "GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST"] {
        if let Ok(v) = std::env::var(name) {
            row += &format!(";{name}={v}");
        }
    }
    let mut config = setting::Setting::row(&row).unwrap_or_else(|e| panic!("{e}")).config;
    config.expandable_reclaim = reclaim;
    config
}

/// The traces of `arg`: a file's, or `bench`'s random working set for `random`.
fn load(arg: &str) -> Vec<Trace> {
    if arg == "random" {
        return vec![random_working_set()];
    }
    if arg == "synthetic-bert" {
        return vec![synthetic_bert()];
    }
    input::load(std::path::Path::new(arg), None).expect("trace")
}

/// `random_trace` of `examples/c/bench.c`, event for event: xorshift64 (13, 7, 17) from its seed,
/// an allocation when nothing is live or (below 1,000 live) on an odd draw, of
/// `256 * e^(u * ln 2^30)` bytes for `u` uniform in [0, 1) from the draw's top 53 bits, else
/// the free of a live block drawn uniformly, the last one moved into its place.
fn random_working_set() -> Trace {
    const LIVE: usize = 1000;
    const OPS: usize = 100_000;
    let mut rng: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut events, mut live, mut id) = (Vec::with_capacity(OPS), Vec::<u32>::with_capacity(LIVE), 0u32);
    for _ in 0..OPS {
        let alloc = live.is_empty() || (live.len() < LIVE && next() & 1 == 1);
        if alloc {
            let u = (next() >> 11) as f64 / 9_007_199_254_740_992.0;
            let size = (256.0 * (u * (65536.0f64 * 4.0 * 64.0).ln()).exp()) as usize;
            events.push(Event::Alloc { id, size, stream: 0 });
            live.push(id);
            id += 1;
        } else {
            let k = (next() % live.len() as u64) as usize;
            events.push(Event::Free { id: live.swap_remove(k) });
        }
    }
    Trace { name: "random working set".into(), events, streams: vec![0], blocks: id, ..Trace::default() }
}

/// A synthetic BERT-base inference trace (not recorded; sizes as PyTorch would request them,
/// order roughly a forward pass's): 220 MB of fp16 weights in 200 tensors allocated first,
/// then 300 steps, each a batch `b` in 1..=32 and a length `l` in 16..=512 drawn by xorshift64,
/// through 12 layers: q, k and v (`b*l*768` halves each), attention scores and their softmax
/// (`b*12*l*l`), the context, the output projection, the feed-forward pair (`b*l*3072`), each
/// freed once the next tensor that reads it is made.
fn synthetic_bert() -> Trace {
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut events, mut id) = (Vec::new(), 0u32);
    let mut alloc = |events: &mut Vec<Event>, size: usize| {
        events.push(Event::Alloc { id, size, stream: 0 });
        id += 1;
        id - 1
    };
    let free = |events: &mut Vec<Event>, id: u32| events.push(Event::Free { id });
    for k in 0..200 {
        let size = if k == 0 {
            30522 * 768 * 2
        } else if k % 8 < 4 {
            768 * 768 * 2
        } else {
            768 * 3072 * 2
        };
        alloc(&mut events, size);
    }
    for _ in 0..300 {
        let b = 1 + (next() % 32) as usize;
        let l = 16 + (next() % 497) as usize;
        let h = b * l * 768 * 2;
        let mut hidden = alloc(&mut events, h);
        for _ in 0..12 {
            let (q, k, v) = (alloc(&mut events, h), alloc(&mut events, h), alloc(&mut events, h));
            let scores = alloc(&mut events, b * 12 * l * l * 2);
            free(&mut events, q);
            free(&mut events, k);
            let probs = alloc(&mut events, b * 12 * l * l * 2);
            free(&mut events, scores);
            let ctx = alloc(&mut events, h);
            free(&mut events, probs);
            free(&mut events, v);
            let out = alloc(&mut events, h);
            free(&mut events, ctx);
            let normed = alloc(&mut events, h);
            free(&mut events, out);
            free(&mut events, hidden);
            let up = alloc(&mut events, b * l * 3072 * 2);
            let act = alloc(&mut events, b * l * 3072 * 2);
            free(&mut events, up);
            let down = alloc(&mut events, h);
            free(&mut events, act);
            hidden = alloc(&mut events, h);
            free(&mut events, down);
            free(&mut events, normed);
        }
        free(&mut events, hidden);
    }
    Trace { name: "synthetic bert".into(), events, streams: vec![0], blocks: id, ..Trace::default() }
}
