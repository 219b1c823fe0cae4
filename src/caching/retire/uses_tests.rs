//! The retire's set of streams named by `record_stream` (`uses`) on the simulated device: a
//! retire still finds every use, the set stays bounded while streams come and go, and the
//! invariant checker catches a use the set does not note.

use std::sync::Arc;

use crate::caching::allocator::Allocator;
use crate::caching::ipc::EXPORTED;
use crate::config::Config;
use crate::driver::sim::SimDriver;

const KIB: usize = 1 << 10;

fn sim() -> (Allocator, Arc<SimDriver>) {
    let drv = Arc::new(SimDriver::new(1, 1 << 30));
    (Allocator::new(drv.clone(), Config::default()), drv)
}

/// The streams the device's shards note, summed over the shards.
fn noted(a: &Allocator) -> usize {
    a.device_or_init(0).unwrap().shards.all().iter().map(|s| s.lock().retire_uses.len()).sum()
}

#[test]
fn a_retire_finds_each_use_and_forgets_it() {
    let (a, drv) = sim();
    let blocks: Vec<_> = (0..8).map(|_| a.malloc(4 * KIB, 0, 5).unwrap()).collect();
    a.record_stream(blocks[3], 9).unwrap();
    a.record_stream(blocks[6], 9).unwrap();
    a.record_stream(blocks[6], 5).unwrap();
    assert_eq!(noted(&a), 1, "stream 9 once; the owner's own stream is no use");
    assert!(!a.retire_stream(0, 11).unwrap(), "stream 11: no shard, no use");
    assert_eq!(drv.counts().stream_synchronize, 0);
    assert!(a.retire_stream(0, 9).unwrap(), "stream 9 has no shard but two blocks in use on it");
    assert_eq!(noted(&a), 0, "the uses are forgotten, and the stream with them");
    a.check_invariants().unwrap();
    let events = drv.counts().event_record;
    for p in blocks {
        a.free(p).unwrap();
    }
    assert_eq!(drv.counts().event_record, events, "no event recorded on the retired handle");
    assert!(!a.retire_stream(0, 9).unwrap(), "nothing left on stream 9");
    a.check_invariants().unwrap();
}

/// Ten thousand streams, each named for a block then freed: the set is rebuilt from the live
/// blocks whenever it passes its bound, so it stays small, and a stream still in use stays.
#[test]
fn the_set_stays_bounded_while_streams_come_and_go() {
    let (a, _drv) = sim();
    let kept = a.malloc(4 * KIB, 0, 5).unwrap();
    a.record_stream(kept, 7).unwrap();
    for s in 0..10_000usize {
        let p = a.malloc(4 * KIB, 0, 5).unwrap();
        a.record_stream(p, 0x1000 + s).unwrap();
        a.free(p).unwrap();
        assert!(noted(&a) <= 65, "{} streams noted after {s}", noted(&a));
    }
    a.check_invariants().unwrap();
    assert!(a.retire_stream(0, 7).unwrap(), "the live block's use survived every rebuild");
    a.free(kept).unwrap();
    a.check_invariants().unwrap();
}

/// A use added without the set's note (as a path that forgot to note would) breaks the rule;
/// the export mark's handle is no use, and its retire leaves the mark.
#[test]
fn the_checker_catches_a_use_the_set_misses() {
    let (a, _drv) = sim();
    let p = a.malloc(4 * KIB, 0, 5).unwrap();
    a.check_invariants().unwrap();
    let shard = a.device_or_init(0).unwrap().shards.all().into_iter().find(|s| s.stream == 5).unwrap();
    {
        let mut st = shard.lock();
        let id = st.allocated(p).unwrap();
        st.blocks[id].add_stream_use(EXPORTED);
    }
    a.check_invariants().expect("an export's mark is no stream's use");
    {
        let mut st = shard.lock();
        let id = st.allocated(p).unwrap();
        st.blocks[id].add_stream_use(42);
    }
    let e = a.check_invariants().unwrap_err();
    assert!(e.contains("which the retire's set does not note"), "{e}");
    // The all-ones handle, a stream to the sim and the export mark to gpupool: its retire
    // leaves the mark (an importer may still read the block).
    a.retire_stream(0, EXPORTED).unwrap();
    let id = shard.lock().allocated(p).unwrap();
    assert!(shard.lock().blocks[id].stream_uses.contains(&EXPORTED), "the export's mark stays");
    shard.lock().note_stream_use(42);
    a.check_invariants().unwrap();
    assert!(a.retire_stream(0, 42).unwrap());
    a.check_invariants().unwrap();
}

/// Threads naming streams for their blocks and freeing them while another retires those
/// streams: the set and the blocks' uses stay consistent (the checker's rule), nothing panics,
/// and a retire after the threads end finds no use left on any of them.
#[test]
fn threads_naming_and_retiring_streams_keep_the_rule() {
    let (a, _drv) = sim();
    let a = Arc::new(a);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let retirer = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.retire_stream(0, 0x9000 + n % 8).unwrap();
                n += 1;
            }
        })
    };
    let workers: Vec<_> = (0..4usize)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for i in 0..3_000usize {
                    let p = a.malloc(4 * KIB, 0, 0x100 + t).unwrap();
                    a.record_stream(p, 0x9000 + (i * 7 + t) % 8).unwrap();
                    live.push(p);
                    if live.len() > 16 {
                        a.free(live.swap_remove(i % 16)).unwrap();
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    retirer.join().unwrap();
    a.check_invariants().unwrap();
    for s in 0..8 {
        a.retire_stream(0, 0x9000 + s).unwrap();
    }
    assert_eq!(noted(&a), 0, "every use forgotten or freed, every stream forgotten");
    a.check_invariants().unwrap();
}
