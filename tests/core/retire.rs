//! `Allocator::retire_stream` (`gpupool_stream_retire`) attacked from outside: the driver
//! panicking in either of its calls, the current device (-1), a private pool's shard (a graph
//! pool capturing, a sleepable pool asleep), the largest handle, and threads racing it with
//! malloc, free, record_stream and empty_cache on the same stream. Each refusal leaves the
//! pools, the statistics and a capture as they were.
use crate::common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::CaptureMode;
use gpupool::driver::sim::{SimDriver, SimOp};
use gpupool::{Error, SleepMode};

fn config() -> Config {
    Config { expandable_segments: true, ..Config::default() }
}

/// A panic of the driver (as cudarc's for a missing symbol) in the capture status or the wait
/// unwinds out of the retire with nothing changed and no lock left held: the next retire waits.
#[test]
fn a_panicking_driver_call_changes_nothing() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let x = a.malloc(MIB, 0, 5).unwrap();
    a.free(x).unwrap();
    let before = a.stats(0).unwrap();
    for op in [SimOp::StreamGetCaptureInfo, SimOp::StreamSynchronize] {
        drv.inject_panic(op, 0);
        assert!(catch_unwind(AssertUnwindSafe(|| a.retire_stream(0, 5))).is_err(), "{op:?}");
        assert_eq!(a.stats(0).unwrap(), before, "{op:?}");
        check(&a);
    }
    assert!(a.retire_stream(0, 5).unwrap());
    assert_eq!(a.malloc(MIB, 0, 5).unwrap(), x, "the block is still the stream's");
    a.free(x).unwrap();
}

/// Device -1 is the calling thread's current device: a stream served on device 1 is waited
/// for there, and not on device 0.
#[test]
fn device_minus_one_follows_the_current_device() {
    let (a, drv) = sim_with(2, 1 << 30, config());
    let x = a.malloc(MIB, 1, 5).unwrap();
    a.free(x).unwrap();
    SimDriver::set_current_device(0);
    assert!(!a.retire_stream(-1, 5).unwrap(), "device 0 holds nothing of stream 5");
    SimDriver::set_current_device(1);
    assert!(a.retire_stream(-1, 5).unwrap());
    assert_eq!(drv.counts().stream_synchronize, 1);
    SimDriver::set_current_device(0);
    // The largest handle: nothing held, nothing waited; once served, waited for.
    assert!(!a.retire_stream(0, usize::MAX).unwrap());
    let y = a.malloc(MIB, 0, usize::MAX).unwrap();
    a.free(y).unwrap();
    assert!(a.retire_stream(0, usize::MAX).unwrap());
    check(&a);
}

/// A graph pool's shard of a stream that captures: refused, the capture still valid and the
/// pool's block still served to it; a sleepable pool's shard asleep: waited for, and the pool
/// wakes with its block's contents.
#[test]
fn private_pools_shards_are_retired_or_refused() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let graph = a.pool_create();
    a.begin_allocate_to_pool(0, graph, 7).unwrap();
    drv.begin_capture(7, CaptureMode::Global).unwrap();
    let g = a.malloc(4 * MIB, 0, 7).unwrap();
    let before = a.stats(0).unwrap();
    assert!(matches!(a.retire_stream(0, 7), Err(Error::Capture(_))));
    assert_eq!(a.stats(0).unwrap(), before);
    a.free(g).unwrap();
    assert_eq!(a.malloc(4 * MIB, 0, 7).unwrap(), g, "the capture reuses its block");
    assert!(drv.end_capture(7).unwrap(), "the retire did not invalidate the capture");
    a.end_allocate_to_pool(0, graph).unwrap();
    assert!(a.retire_stream(0, 7).unwrap(), "the capture ended: waited for");
    a.free(g).unwrap();
    a.release_pool(0, graph).unwrap();

    let sleepy = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, sleepy, 9).unwrap();
    let s = a.malloc(MIB, 0, 9).unwrap();
    a.end_allocate_to_pool(0, sleepy).unwrap();
    // SAFETY: a live block of 1 MiB mapped by the simulated driver.
    unsafe { (s as *mut u8).write_bytes(0x5a, MIB) };
    a.sleep(0, sleepy, SleepMode::Offload).unwrap();
    assert!(a.retire_stream(0, 9).unwrap(), "an asleep pool's shard is waited for");
    a.wake(0, sleepy).unwrap();
    // SAFETY: as above, mapped again by the wake.
    assert!(unsafe { std::slice::from_raw_parts(s as *const u8, MIB) }.iter().all(|&b| b == 0x5a));
    a.free(s).unwrap();
    a.release_pool(0, sleepy).unwrap();
    check(&a);
}

/// Threads on stream 5 allocating, freeing and recording stream 6, another emptying the cache,
/// while one retires stream 5 over and over: every call succeeds, and the pools are sound.
#[test]
fn threads_racing_a_retire_on_the_same_stream() {
    let (a, _drv) = sim_with(1, 1 << 30, config());
    let a = Arc::new(a);
    std::thread::scope(|s| {
        for t in 0..2usize {
            let a = &a;
            s.spawn(move || {
                for i in 0..2_000usize {
                    let p = a.malloc((1 + (i + t) % 7) * 256 * 1024, 0, 5).unwrap();
                    if i % 3 == 0 {
                        a.record_stream(p, 6).unwrap();
                    }
                    a.free(p).unwrap();
                }
            });
        }
        s.spawn(|| {
            for _ in 0..200 {
                a.empty_cache(0).unwrap();
            }
        });
        s.spawn(|| {
            for _ in 0..2_000 {
                a.retire_stream(0, 5).unwrap();
            }
        });
    });
    a.empty_cache(0).unwrap();
    let st = a.stats(0).unwrap();
    assert_eq!(st.allocated_bytes.all.current, 0);
    assert_eq!(st.reserved_bytes.all.current, 0);
    check(&a);
}

/// A block of stream 6 in use on stream 5 (`record_stream`), stream 5 never served: its retire
/// waits for stream 5's work, which reads the block, and the block forgets the use, so that
/// its free records no event on the destroyed handle (an error of the driver, or an event of
/// whatever new stream got the handle, not ordered after the old one's work).
#[test]
fn a_live_block_in_use_on_the_stream_is_waited_for_and_forgets_it() {
    let (a, drv) = sim_with(1, 1 << 30, config());
    let y = a.malloc(4 * MIB, 0, 6).unwrap();
    a.record_stream(y, 5).unwrap();
    assert!(a.retire_stream(0, 5).unwrap(), "the block is in use on stream 5");
    assert_eq!(drv.counts().stream_synchronize, 1, "the host waited for stream 5");
    let records = drv.counts().event_record;
    a.free(y).unwrap();
    assert_eq!(drv.counts().event_record, records, "no event on the retired stream");
    assert_eq!(a.malloc(4 * MIB, 0, 6).unwrap(), y, "free at once for stream 6");
    a.free(y).unwrap();
    check(&a);
}

/// One thread puts a sleepable pool holding a block of stream 9 to sleep and wakes it, over
/// and over, while another allocates and frees on stream 9 in the default pools and a third
/// retires stream 9: every call succeeds, and the pool's block comes back whole.
#[test]
fn a_retire_racing_sleep_and_wake_of_the_streams_pool() {
    let (a, _drv) = sim_with(1, 1 << 30, config());
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, 9).unwrap();
    let p = a.malloc(3 * MIB, 0, 9).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    // SAFETY: a live block of 3 MiB mapped by the simulated driver.
    unsafe { (p as *mut u8).write_bytes(0x3c, 3 * MIB) };
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..200 {
                a.sleep(0, pool, SleepMode::Offload).unwrap();
                a.wake(0, pool).unwrap();
            }
        });
        s.spawn(|| {
            for i in 0..2_000usize {
                let q = a.malloc((1 + i % 5) * MIB, 0, 9).unwrap();
                a.free(q).unwrap();
            }
        });
        s.spawn(|| {
            for _ in 0..2_000 {
                a.retire_stream(0, 9).unwrap();
            }
        });
    });
    // SAFETY: as above, awake.
    assert!(unsafe { std::slice::from_raw_parts(p as *const u8, 3 * MIB) }.iter().all(|&b| b == 0x3c));
    a.free(p).unwrap();
    a.release_pool(0, pool).unwrap();
    check(&a);
}
