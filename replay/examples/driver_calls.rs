//! The driver calls of a replay with expandable segments on the simulated device, cold pass
//! and warm pass, without and with the high-water rule (`GPUPOOL_EXPANDABLE_RECLAIM`): what
//! the rule costs, counted rather than timed. On a GPU each page mapped costs a `cuMemCreate`,
//! `cuMemMap` and its share of a `cuMemSetAccess`, and each page unmapped a `cuMemUnmap` and
//! `cuMemRelease`, tens of microseconds in all; the simulated device's times say nothing of
//! that, so the counts are what to compare.
//!
//!     cargo run --release -p gpupool-replay --example driver_calls -- TRACE [CAPACITY_GIB]
//!
//! CAPACITY_GIB: the simulated device's memory (default 80, an H100's), which sizes the
//! expandable segments' address ranges.
use std::sync::Arc;

use gpupool::Allocator;
use gpupool::driver::sim::{SimCounts, SimDriver};
use gpupool_replay::{input, run, setting};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 2 || args.len() > 3 {
        eprintln!("usage: driver_calls TRACE [CAPACITY_GIB]");
        std::process::exit(2);
    }
    let traces = input::load(std::path::Path::new(&args[1]), None).expect("trace");
    let capacity = args.get(2).map_or(80usize << 30, |g| g.parse::<usize>().unwrap() << 30);
    let t = &traces[0];
    println!("{}: {} events, peak live {:.1} MiB", args[1], t.events.len(), t.peak_live() as f64 / 1048576.0);
    for reclaim in [false, true] {
        let mut config = setting::Setting::conf("expandable_segments:True").unwrap().config;
        config.expandable_reclaim = reclaim;
        let drv = Arc::new(SimDriver::new(1, capacity));
        let a = Allocator::new(drv.clone(), config);
        let streams: Vec<usize> = (1..=t.streams.len()).map(|i| i * 0x100).collect();
        let mut ptrs = vec![0u64; t.blocks as usize];
        for pass in ["cold", "warm"] {
            let c0 = drv.counts();
            // The counts include the frees after the pass: with expandable segments a free
            // calls the driver for nothing, so they count what the events did.
            let ns = run::pass(&a, 0, t, &streams, &mut ptrs).expect("replay").ns;
            let c1 = drv.counts();
            let ns = ns as f64 / t.events.len() as f64;
            let d = |f: fn(&SimCounts) -> u64| f(&c1) - f(&c0);
            let s = a.stats(0).unwrap();
            println!(
                "reclaim {reclaim:5} {pass}: syncs {:5} create {:6} map {:6} set_access {:6} unmap {:6}; reserved/live {:.3}; {ns:.0} ns/event (sim)",
                d(|c| c.device_synchronize),
                d(|c| c.mem_create),
                d(|c| c.mem_map),
                d(|c| c.mem_set_access),
                d(|c| c.mem_unmap),
                s.reserved_bytes.all.peak as f64 / t.peak_live() as f64
            );
        }
    }
}
