//! The call attacked: driver faults of every kind through the allocator (an error names the
//! range and changes nothing, a panic leaves the stream's lock free), and threads that
//! allocate, free and empty the cache while others ask for ranges and descriptors of their
//! live blocks: every answer is mapped when the driver is asked (the simulated driver
//! refuses a range that is not), every descriptor is the run's size.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::common::{MIB, check, sim_with, xorshift};
use crate::fd_size;
use gpupool::Error;
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimFault, SimOp};

#[test]
fn driver_faults_are_reported_and_change_nothing() {
    for config in [Config::pytorch(), Config::default()] {
        let (a, drv) = sim_with(1, 256 * MIB, config);
        let p = a.malloc(3 * MIB, 0, 0).unwrap();
        let want = a.mapped_range(p).unwrap();
        let reserved = a.stats(0).unwrap().reserved_bytes.all.current;
        let cuda = DriverError::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
        };
        drv.inject(SimOp::MemGetHandleForAddressRange, 0, SimFault::Fail(cuda));
        match a.mapped_range_dmabuf(p) {
            Err(Error::Cuda(m)) => assert!(m.contains("CUDA_ERROR_INVALID_VALUE") && m.contains("dma-buf"), "{m}"),
            other => panic!("{:?}", other.map(|r| r.0)),
        }
        drv.inject(SimOp::MemGetHandleForAddressRange, 0, SimFault::Fail(DriverError::OutOfMemory));
        assert!(matches!(a.mapped_range_dmabuf(p), Err(Error::OutOfMemory(_))));
        drv.inject(SimOp::MemGetHandleForAddressRange, 0, SimFault::MissingSymbol);
        match a.mapped_range_dmabuf(p) {
            Err(Error::DriverUnavailable(m)) => assert!(m.contains("cuMemGetHandleForAddressRange"), "{m}"),
            other => panic!("{:?}", other.map(|r| r.0)),
        }
        drv.inject_panic(SimOp::MemGetHandleForAddressRange, 0);
        assert!(catch_unwind(AssertUnwindSafe(|| a.mapped_range_dmabuf(p))).is_err());
        assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, reserved);
        // The stream's lock was released by the unwinding: the stream still serves.
        let q = a.malloc(MIB, 0, 0).unwrap();
        a.free(q).unwrap();
        let (r, fd) = a.mapped_range_dmabuf(p).unwrap();
        assert_eq!((r, fd_size(&fd)), (want, want.bytes as u64));
        a.free(p).unwrap();
        check(&a);
    }
}

#[test]
fn threads_allocate_and_release_while_others_ask_for_their_ranges() {
    let (a, drv) = sim_with(1, 1024 * MIB, Config::default());
    let a = Arc::new(a);
    let stop = Arc::new(AtomicBool::new(false));
    let asked = Arc::new(AtomicUsize::new(0));
    let releaser = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                a.empty_cache(0).unwrap();
                std::thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, asked) = (a.clone(), asked.clone());
            std::thread::spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                let mut live: Vec<(u64, usize)> = Vec::new();
                // Two threads share stream 1, two have their own: asks race the stream's
                // growth and release on the same lock and on others.
                let stream = if t < 2 { 1 } else { 10 + t as usize };
                for _ in 0..2000 {
                    let r = xorshift(&mut rng);
                    if live.len() < 6 && r % 3 != 0 {
                        let size = [512, 600 << 10, 2 * MIB, 5 * MIB, 9 * MIB][(r >> 8) as usize % 5];
                        live.push((a.malloc(size, 0, stream).unwrap(), size));
                    } else if !live.is_empty() {
                        let (p, _) = live.swap_remove((r >> 16) as usize % live.len());
                        a.free(p).unwrap();
                    }
                    if let Some(&(p, size)) = live.get((r >> 24) as usize % live.len().max(1)) {
                        let inside = p + (r >> 32) % size as u64;
                        let (run, fd) = a.mapped_range_dmabuf(inside).unwrap();
                        assert!(run.base <= p && p + size as u64 <= run.base + run.bytes as u64, "{run:?}");
                        assert_eq!(fd_size(&fd), run.bytes as u64);
                        asked.fetch_add(1, Ordering::Relaxed);
                    }
                }
                for (p, _) in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    releaser.join().unwrap();
    assert!(asked.load(Ordering::Relaxed) > 2000, "{} asks", asked.load(Ordering::Relaxed));
    assert_eq!(drv.counts().dmabufs as usize, asked.load(Ordering::Relaxed), "every ask reached the driver once");
    check(&a);
    a.empty_cache(0).unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes.all.current, 0);
}

#[test]
fn asks_racing_sleep_and_wake_get_the_range_or_a_refusal_never_a_driver_error() {
    let (a, _drv) = sim_with(1, 512 * MIB, Config::default());
    let a = Arc::new(a);
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(0, pool, 4).unwrap();
    let p = a.malloc(6 * MIB, 0, 4).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    let awake = a.mapped_range(p).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sleeper = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rounds = 0;
            while !stop.load(Ordering::Relaxed) || rounds < 20 {
                a.sleep(0, pool, gpupool::SleepMode::Discard).unwrap();
                a.wake(0, pool).unwrap();
                rounds += 1;
            }
            rounds
        })
    };
    let (mut got, mut refused) = (0, 0);
    for i in 0..2000u64 {
        match a.mapped_range_dmabuf(p + i * 4096 % (6 * MIB as u64)) {
            Ok((r, fd)) => {
                assert_eq!((r, fd_size(&fd)), (awake, awake.bytes as u64));
                got += 1;
            }
            Err(Error::InvalidValue(m)) => {
                assert!(m.contains("sleeps"), "{m}");
                refused += 1;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = sleeper.join().unwrap();
    assert!(rounds >= 20 && got + refused == 2000, "{got} answered, {refused} refused, {rounds} sleeps");
    // Awake again: the same range (the pages are mapped at the same addresses).
    let (r, fd) = a.mapped_range_dmabuf(p).unwrap();
    assert_eq!((r, fd_size(&fd)), (awake, awake.bytes as u64));
    a.free(p).unwrap();
    check(&a);
}
