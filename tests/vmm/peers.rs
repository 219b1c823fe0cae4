//! Peer access as PyTorch grants it (`caching::peers`, `Allocator::enable_peer_access`,
//! `gpupool_enable_peer_access`) on simulated hosts of 2 to 4 devices, whose driver records the
//! devices granted at each mapping: a page is mapped for its own device and the peers enabled,
//! no others; enabling a peer grants it every page mapped before (growth, a sleepable pool's
//! pages, pages mapped again at wake); a map costs one device's grant however many devices the
//! host has until a peer is enabled; pages mapped by other threads during the enable get it;
//! a refusal of the driver (or a call that unwinds) leaves no grant and no peer; bad arguments
//! change nothing.
use std::sync::Arc;

use crate::common;

use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};
use gpupool::driver::{DevicePtr, DriverError};
use gpupool::{Allocator, Error, SleepMode};

fn expandable(devices: i32) -> (Allocator, Arc<SimDriver>) {
    sim_with(devices, 1 << 30, Config { expandable_segments: true, ..Config::default() })
}

/// Whether every mapped piece of `device`'s memory grants exactly `want` (in any order).
fn granted(drv: &SimDriver, device: i32, want: &[i32]) -> bool {
    let map = drv.access_map(device);
    map.iter().all(|(_, _, to)| {
        let (mut a, mut b) = (to.clone(), want.to_vec());
        a.sort_unstable();
        b.sort_unstable();
        a == b
    })
}

/// Blocks of several sizes on two streams of `device`: several runs of pages.
fn blocks(a: &Allocator, device: i32) -> Vec<DevicePtr> {
    // 40 MiB: whole 20 MiB pages, in a range of its own (2 MiB pages round less below).
    [3 * MIB, 512, 40 * MIB, 4 * MIB + 5]
        .iter()
        .enumerate()
        .map(|(i, &n)| a.malloc(n, device, 0x10 + (i % 2) * 0x10).unwrap())
        .collect()
}

#[test]
fn a_page_is_mapped_for_its_device_and_the_peers_enabled() {
    for n in 2..=4 {
        let (a, drv) = expandable(n);
        let mine: Vec<Vec<DevicePtr>> = (0..n).map(|d| blocks(&a, d)).collect();
        for d in 0..n {
            assert!(!drv.access_map(d).is_empty());
            assert!(granted(&drv, d, &[d]), "{n} devices: device {d} is mapped for itself alone");
        }
        let c = drv.counts();
        assert_eq!(c.mem_access_descs, c.mem_set_access, "{n} devices: one device named per grant, whatever the host");
        // Device 1 may reach device 0's memory: every page of device 0, mapped now and later.
        assert_eq!(a.enable_peer_access(1, 0), Ok(true));
        assert!(granted(&drv, 0, &[0, 1]), "{n} devices: the pages mapped before");
        assert_eq!(a.peers_of(0).unwrap(), [1]);
        let later = a.malloc(40 * MIB, 0, 0x30).unwrap();
        assert!(granted(&drv, 0, &[0, 1]), "{n} devices: the pages mapped after");
        for d in 1..n {
            assert!(granted(&drv, d, &[d]), "{n} devices: device {d}'s memory is not device 0's peer's");
        }
        let before = drv.counts();
        assert_eq!(a.enable_peer_access(1, 0), Ok(false), "enabled already");
        assert_eq!(drv.counts(), before, "nothing asked of the driver");
        if n > 2 {
            a.enable_peer_access(n - 1, 0).unwrap();
            assert!(granted(&drv, 0, &[0, 1, n - 1]));
            assert_eq!(a.peers_of(0).unwrap(), [1, n - 1]);
        }
        for p in mine.into_iter().flatten().chain([later]) {
            a.free(p).unwrap();
        }
        a.empty_cache(-1).unwrap();
        for d in 0..n {
            a.empty_cache(d).unwrap();
        }
        check(&a);
    }
}

#[test]
fn a_sleeping_pool_wakes_with_the_peers_enabled_meanwhile() {
    let (a, drv) = expandable(3);
    let pool = a.pool_create_sleepable();
    a.begin_allocate_to_pool(2, pool, 0x10).unwrap();
    let p = a.malloc(50 * MIB, 2, 0x10).unwrap();
    a.end_allocate_to_pool(2, pool).unwrap();
    let q = a.malloc(3 * MIB, 2, 0x10).unwrap();
    a.sleep(2, pool, SleepMode::Discard).unwrap();
    a.enable_peer_access(0, 2).unwrap();
    assert!(granted(&drv, 2, &[2, 0]), "the default pools' pages");
    a.wake(2, pool).unwrap();
    assert!(granted(&drv, 2, &[2, 0]), "the pages mapped again at wake");
    assert!(drv.access_map(2).iter().map(|m| m.1).sum::<usize>() >= 53 * MIB);
    assert!(granted(&drv, 0, &[0]) && granted(&drv, 1, &[1]));
    a.free(p).unwrap();
    a.free(q).unwrap();
    check(&a);
}

#[test]
fn pages_mapped_while_a_peer_is_enabled_get_it() {
    for round in 0..6 {
        let (a, drv) = expandable(2);
        let a = Arc::new(a);
        let growers: Vec<_> = (0..3)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..40 {
                        let stream = 0x100 * (t + 1) + (i % 4) * 8;
                        held.push(a.malloc((i % 7 + 1) * 3 * MIB, 0, stream).unwrap());
                        if i % 3 == 0 {
                            a.free(held.swap_remove(0)).unwrap();
                        }
                    }
                    held
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_micros(200 * round));
        a.enable_peer_access(1, 0).unwrap();
        let held: Vec<_> = growers.into_iter().flat_map(|g| g.join().unwrap()).collect();
        assert!(granted(&drv, 0, &[0, 1]), "round {round}: every page of device 0, however it raced");
        for p in held {
            a.free(p).unwrap();
        }
        check(&a);
    }
}

#[test]
fn a_refused_grant_leaves_no_peer_and_no_grant() {
    for fault in [SimFault::Fail(DriverError::OutOfMemory), SimFault::Panic] {
        for skip in [0, 1, 3] {
            let (a, drv) = expandable(4);
            let mine = blocks(&a, 0);
            let runs = drv.access_map(0).len();
            assert!(runs > 3, "several runs of pages to grant");
            drv.inject(SimOp::MemSetAccess, skip, fault.clone());
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.enable_peer_access(3, 0)));
            match (&fault, r) {
                (SimFault::Panic, Err(_)) => {}
                (SimFault::Fail(_), Ok(Err(Error::Cuda(m)))) => {
                    assert!(m.contains("device 3") && m.contains("device 0"), "{m}")
                }
                (_, r) => panic!("{fault:?} {skip}: {:?}", r.map_err(|_| "panic")),
            }
            drv.clear_faults();
            assert!(a.peers_of(0).unwrap().is_empty(), "{fault:?} {skip}: not enabled");
            assert!(granted(&drv, 0, &[0]), "{fault:?} {skip}: the grants made were revoked");
            let more = a.malloc(6 * MIB, 0, 0x40).unwrap();
            assert!(granted(&drv, 0, &[0]), "{fault:?} {skip}: later maps grant no peer");
            assert_eq!(a.enable_peer_access(3, 0), Ok(true), "{fault:?} {skip}: a second try goes through");
            assert!(granted(&drv, 0, &[0, 3]));
            for p in mine.into_iter().chain([more]) {
                a.free(p).unwrap();
            }
            check(&a);
        }
    }
}

#[test]
fn bad_arguments_change_nothing() {
    let (a, drv) = expandable(2);
    let p = a.malloc(5 * MIB, 0, 0).unwrap();
    let before = drv.counts();
    for (device, peer, says) in
        [(0, 0, "its own peer"), (2, 0, "device 2 is out of range"), (-1, 0, "out of range"), (0, 7, "peer 7")]
    {
        match a.enable_peer_access(device, peer) {
            Err(Error::InvalidValue(m)) => assert!(m.contains(says), "{device} {peer}: {m}"),
            r => panic!("{device} {peer}: {r:?}"),
        }
    }
    assert_eq!(drv.counts(), before);
    assert!(granted(&drv, 0, &[0]) && a.peers_of(0).unwrap().is_empty());
    a.free(p).unwrap();
    check(&a);
}
