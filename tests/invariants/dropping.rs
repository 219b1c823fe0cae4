//! Dropping an allocator gives the driver back every cached segment and every event.

use crate::common;

use common::{MIB, sim};

/// Allocations on several streams, some used on other streams (`record_stream`), all freed:
/// the cache then holds segments, blocks awaiting events, and events kept for reuse.
fn fill_and_free(a: &gpupool::Allocator) {
    let mut ptrs = Vec::new();
    for (i, size) in [512usize, 4096, 300 << 10, 3 * MIB, 12 * MIB, 30 * MIB].into_iter().enumerate() {
        for stream in [0usize, 0x10, 0x20] {
            let p = a.malloc(size + i, 0, stream).unwrap();
            if size < MIB {
                a.record_stream(p, 0x30 + stream).unwrap();
            }
            ptrs.push(p);
        }
    }
    for p in ptrs {
        a.free(p).unwrap();
    }
}

/// PyTorch's allocator lives as long as the process; a gpupool `Allocator` may be dropped
/// earlier, and must then give the driver back every cached segment and every event.
#[test]
fn dropping_an_allocator_gives_the_driver_everything_back() {
    let (a, drv) = sim(1, 1 << 30);
    fill_and_free(&a);
    // One round of event processing, so that completed events are kept for reuse.
    a.free(a.malloc(512, 0, 0).unwrap()).unwrap();
    assert!(drv.used(0) > 0 && drv.live_events() > 0, "the test must leave something cached");
    drop(a);
    assert_eq!(
        (drv.used(0), drv.live_allocations(), drv.live_events()),
        (0, 0, 0),
        "bytes, allocations and events the dropped allocator left with the driver"
    );
}

/// As above, with the freed blocks still awaiting events on a stream whose work has not
/// completed: the drop waits for them, as `empty_cache` does.
#[test]
fn dropping_an_allocator_waits_for_pending_events_and_gives_everything_back() {
    let (a, drv) = sim(1, 1 << 30);
    for s in [0x30usize, 0x40, 0x50] {
        drv.hold_stream(s);
    }
    fill_and_free(&a);
    assert!(a.stats(0).unwrap().active.all.current > 0, "blocks must await events");
    drop(a);
    assert_eq!((drv.used(0), drv.live_allocations(), drv.live_events()), (0, 0, 0));
}
