//! Out of memory only when the device is really full (issue 39): a request that fits a block
//! whose free was waiting for another stream's event is served from the pool once the
//! out-of-memory path has waited for that event, even when the block's segment cannot go back
//! to the driver (another block of it is live). PyTorch's `DeviceCachingAllocator::malloc`
//! raised `OutOfMemoryError` there (pytorch/pytorch#189504): after `release_cached_blocks`
//! (which runs `synchronize_and_free_events`) its retry chain tried only `cudaMalloc`, never the
//! pool again, so an identical call made right after succeeded (fixed upstream by #191302, a
//! second `get_free_block`). gpupool serves the request from the pool the wait refilled, with
//! PyTorch's ordinary segments and with expandable ones.
use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;

/// Two blocks in one segment on stream 1, the first used on stream 2 (held, so its event is
/// pending) and freed; the rest of the device taken on stream 3; then the first block's size
/// asked again on stream 1.
/// `same_address`: ordinary segments serve it with that very block; an expandable segment's
/// out-of-memory path may unmap its free pages and map them where the growth lands instead.
fn a_block_freed_behind_an_event_serves_the_request_that_fills_the_device(config: Config, same_address: bool) {
    let capacity = 64 * MIB;
    let (a, drv) = sim_with(1, capacity, config);
    let x = a.malloc(8 * MIB, 0, 1).unwrap();
    let y = a.malloc(6 * MIB, 0, 1).unwrap();
    a.record_stream(x, 2).unwrap();
    drv.hold_stream(2);
    a.free(x).unwrap();
    let rest = capacity - drv.used(0);
    let z = a.malloc(rest, 0, 3).unwrap();
    assert_eq!(drv.used(0), capacity, "the device is full");

    let again = a.malloc(8 * MIB, 0, 1).unwrap();
    if same_address {
        assert_eq!(again, x, "served by the block the event held back, from the pool");
    }
    let s = a.stats(0).unwrap();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0), "one retry after waiting for the event, no error");
    assert_eq!(drv.counts().event_synchronize, 1, "the out-of-memory path waited for stream 2's event");
    // Nothing more was taken from the driver to serve it.
    assert_eq!(drv.used(0), capacity);
    check(&a);

    for p in [again, y, z] {
        a.free(p).unwrap();
    }
    drv.release_stream(2);
    a.empty_cache(0).unwrap();
    assert_eq!(drv.used(0), 0);
    check(&a);
}

#[test]
fn with_ordinary_segments() {
    a_block_freed_behind_an_event_serves_the_request_that_fills_the_device(Config::pytorch(), true);
}

#[test]
fn with_expandable_segments() {
    a_block_freed_behind_an_event_serves_the_request_that_fills_the_device(Config::default(), false);
}
