//! Replays a trace of `../shared/traces` (uncompressed) on the simulated device, twice (cold,
//! then warm, as `bench` does), and prints ns per event, how many calls had to lock every
//! stream to settle the peaks, and peak reserved bytes since the start over the trace's peak
//! live bytes (the most its requests hold at once, before rounding). The peaks are never reset:
//! a reset would make the warm pass settle for new peaks that the figure is there to count.
//!
//!     cargo run --release --example replay -- trace.txt [GPUPOOL_CONF | expandable]
//!
//! The optional second argument configures the allocator as `GPUPOOL_CONF` does (PyTorch's
//! syntax, e.g. `expandable_segments:True`), or is `expandable`, short for
//! `expandable_segments:True`. The configuration is printed first (expandable_segments, and
//! the options that differ from their defaults), so a key this build does not read shows there
//! as not taken rather than passing silently.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use gpupool::{Allocator, config::Config, driver::sim::SimDriver};

/// The most bytes live at once: the running sum of the requested sizes of the allocations not
/// yet freed, at its highest.
fn peak_live(events: &[(bool, u64, usize, usize)]) -> usize {
    let mut live = HashMap::new();
    let (mut cur, mut peak) = (0usize, 0usize);
    for &(alloc, id, size, _) in events {
        if alloc {
            live.insert(id, size);
            cur += size;
            peak = peak.max(cur);
        } else if let Some(size) = live.remove(&id) {
            cur -= size;
        }
    }
    peak
}

fn main() {
    let path = std::env::args().nth(1).expect("usage: replay TRACE.txt [GPUPOOL_CONF]");
    let config = match std::env::args().nth(2) {
        Some(word) if word == "expandable" => Config { expandable_segments: true, ..Config::default() },
        Some(conf) => Config::from_lookup(|name| (name == "GPUPOOL_CONF").then(|| conf.clone()))
            .unwrap_or_else(|e| panic!("GPUPOOL_CONF={conf}: {e}")),
        None => Config::default(),
    };
    let mut shown = vec![format!("expandable_segments:{}", if config.expandable_segments { "True" } else { "False" })];
    shown.extend(
        config
            .options_text()
            .lines()
            .filter(|l| !l.ends_with("(default)") && !l.starts_with("GPUPOOL_DRIVER="))
            .map(String::from),
    );
    println!("configuration: {}", shown.join(" "));

    let text = std::fs::read_to_string(&path).expect("read the trace");
    let mut events = Vec::new();
    let mut streams = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["a", id, size, stream] => {
                let n = streams.len();
                let s = *streams.entry(stream.to_string()).or_insert(0x100 * (n + 1));
                events.push((true, id.parse::<u64>().unwrap(), size.parse::<usize>().unwrap(), s));
            }
            ["f", id] => events.push((false, id.parse().unwrap(), 0, 0)),
            _ => {}
        }
    }
    let live_peak = peak_live(&events);
    let a = Allocator::new(Arc::new(SimDriver::new(1, 80 << 30)), config);
    let mut live: HashMap<u64, u64> = HashMap::with_capacity(events.len());
    for pass in ["cold", "warm"] {
        let settles = a.peak_settles(0).unwrap();
        let t0 = Instant::now();
        for &(alloc, id, size, stream) in &events {
            if alloc {
                live.insert(id, a.malloc(size, 0, stream).unwrap());
            } else if let Some(p) = live.remove(&id) {
                a.free(p).unwrap();
            }
        }
        let ns = t0.elapsed().as_nanos() as f64 / events.len() as f64;
        for (_, p) in live.drain() {
            a.free(p).unwrap();
        }
        let reserved = a.stats(0).unwrap().reserved_bytes.all.peak as f64;
        println!(
            "{pass}: {} events on {} streams, {ns:.0} ns/event, {} peak settles, peak reserved {:.1} MiB / peak \
             live {:.1} MiB = {:.3}",
            events.len(),
            streams.len(),
            a.peak_settles(0).unwrap() - settles,
            reserved / 1048576.0,
            live_peak as f64 / 1048576.0,
            reserved / live_peak as f64
        );
    }
}
