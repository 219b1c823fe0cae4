//! Replays a trace of `../shared/traces` (uncompressed) on the simulated device, twice (cold,
//! then warm, as `bench` does), and prints ns per event and how many calls had to lock every
//! stream to settle the peaks: `cargo run --release --example replay -- trace.txt`.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use gpupool::{Allocator, config::Config, driver::sim::SimDriver};

fn main() {
    let path = std::env::args().nth(1).expect("usage: replay TRACE.txt");
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
    let a = Allocator::new(Arc::new(SimDriver::new(1, 80 << 30)), Config::default());
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
        println!(
            "{pass}: {} events on {} streams, {ns:.0} ns/event, {} peak settles",
            events.len(),
            streams.len(),
            a.peak_settles(0).unwrap() - settles
        );
    }
}
