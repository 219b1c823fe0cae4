//! The simulated device's memory as other processes share it (issue 40, defect 9): an export
//! must not move a page's bytes (the simulator copied a page into a `memfd` at its first export
//! and mapped the copy over it, losing what another thread wrote meanwhile to a neighbouring
//! block: 199 to 200 rounds of 200), an importer keeps no descriptor per page while its import
//! is open (docs/ipc.md), and pinned host memory is limited as on a real host (a 32 TiB
//! request succeeded). The importer is the test binary run again (`common/ipc.rs`).

use crate::{common, ipc};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::{MIB, check};
use gpupool::Error;
use gpupool::config::Config;
use gpupool::driver::ops::*;
use gpupool::driver::sim::SimDriver;
use gpupool::driver::{Driver, DriverError};
use gpupool::host::HostAllocator;
use ipc::{Consumer, fill, hex, matches};

/// A configuration by name: expandable segments (gpupool's default) or ordinary ones.
type Named = (&'static str, fn() -> Config);
const CONFIGS: [Named; 2] = [("expandable", Config::default), ("ordinary", Config::pytorch)];

/// A thread writes sequence numbers, one 8-byte slot after another, into a block while the
/// block beside it on the same page (segment) is exported for the first time: every write
/// must be there afterwards. 40 rounds a configuration, each on a new page (the cache given
/// back between rounds, so that each export is the page's first).
#[test]
fn a_first_export_loses_no_write_another_thread_makes_to_the_page() {
    // Its importers (tens of processes, killed and reaped) and the process's export table
    // are the process's: alone in a child of the binary, as in a binary of its own.
    if !common::process::alone() {
        return;
    }
    for (name, config) in CONFIGS {
        let (a, _) = common::sim_with(1, 1 << 30, config());
        for round in 0..40 {
            let neighbour = a.malloc(MIB, 0, 0).unwrap();
            let block = a.malloc(MIB / 2, 0, 0).unwrap();
            let slots = MIB / 8;
            let (written, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
            std::thread::scope(|s| {
                s.spawn(|| {
                    let base = neighbour as *mut u64;
                    for i in 0..slots {
                        // SAFETY: simulated device memory is host memory; the slot lies in
                        // `neighbour`, which this thread alone writes.
                        unsafe { base.add(i).write_volatile(i as u64 + 1) };
                        written.store(i + 1, Ordering::Release);
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        (0..8).for_each(|_| std::hint::spin_loop());
                    }
                });
                while written.load(Ordering::Acquire) < 1000 {
                    std::hint::spin_loop();
                }
                a.ipc_export(block).unwrap();
                // The writer goes on a little past the export, then stops.
                let after = written.load(Ordering::Acquire) + 1000;
                while written.load(Ordering::Acquire) < after.min(slots) {
                    std::hint::spin_loop();
                }
                stop.store(true, Ordering::Relaxed);
            });
            let n = written.load(Ordering::Acquire);
            let base = neighbour as *const u64;
            // SAFETY: as above; the writer has ended.
            let lost = (0..n).filter(|&i| unsafe { base.add(i).read_volatile() } != i as u64 + 1).count();
            assert_eq!(lost, 0, "{name}, round {round}: {lost} of {n} writes lost to the export");
            a.free(block).unwrap();
            a.free(neighbour).unwrap();
            a.empty_cache(0).unwrap();
        }
        check(&a);
    }
}

/// The bytes of a block exported, written on both sides, survive the page's unmapping and
/// mapping again (a physical page keeps its bytes while it lives, as on a GPU) and the
/// importer sees the owner's writes made after its import.
#[test]
fn an_importer_keeps_no_descriptor_per_page_and_sees_every_write() {
    // Its importers (tens of processes, killed and reaped) and the process's export table
    // are the process's: alone in a child of the binary, as in a binary of its own.
    if !common::process::alone() {
        return;
    }
    // SAFETY: a plain prctl; it fails harmlessly where Yama is absent.
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    for (name, config) in CONFIGS {
        let (a, _) = common::sim_with(1, 1 << 30, config());
        let mut c = Consumer::start();
        let fds = |c: &mut Consumer| c.ask("state").split(' ').nth(2).unwrap().to_string();
        let before = fds(&mut c);
        // Five pages of 2 MiB and more: one descriptor each, before the fix.
        let len = 9 * MIB + 4321;
        let p = a.malloc(len, 0, 0).unwrap();
        fill(p, len, 1);
        let h = hex(&a.ipc_export(p).unwrap());
        let q = c.ask(&format!("import {h} 0"));
        let q = q.strip_prefix("ok ").unwrap_or_else(|| panic!("{name}: {q}")).to_string();
        assert_eq!(fds(&mut c), before, "{name}: the importer holds descriptors while its import is open");
        assert_eq!(c.ask(&format!("check {q} {len} 1")), "ok", "{name}");
        fill(p, len, 2);
        assert_eq!(c.ask(&format!("check {q} {len} 2")), "ok", "{name}: a write after the import");
        assert_eq!(c.ask(&format!("fill {q} {len} 3")), "ok");
        assert!(matches(p, len, 3), "{name}: the importer's write");
        assert_eq!(c.ask(&format!("close {q}")), "ok 0x0");
        assert_eq!(fds(&mut c), before, "{name}");
        c.end();
        a.free(p).unwrap();
        check(&a);
    }
}

#[test]
fn pinned_memory_is_limited_by_what_the_host_can_pin() {
    // Its importers (tens of processes, killed and reaped) and the process's export table
    // are the process's: alone in a child of the binary, as in a binary of its own.
    if !common::process::alone() {
        return;
    }
    let sim = Arc::new(SimDriver::new(1, 1 << 30));
    assert_eq!(sim.host_alloc(0, 32 << 40), Err(DriverError::OutOfMemory), "32 TiB pinned");
    assert_eq!(sim.pinned_bytes(), 0);
    sim.set_host_capacity(64 * MIB);
    let a = sim.host_alloc(0, 40 * MIB).unwrap();
    assert_eq!(sim.host_alloc(0, 40 * MIB), Err(DriverError::OutOfMemory), "past the limit");
    // Registered memory counts too.
    let mut mine = vec![0u8; 30 * MIB];
    assert!(sim.host_register(0, mine.as_mut_ptr() as usize, mine.len()).is_err());
    sim.host_free(0, a).unwrap();
    sim.host_register(0, mine.as_mut_ptr() as usize, mine.len()).unwrap();
    assert_eq!(sim.pinned_bytes(), 30 * MIB);
    sim.host_unregister(0, mine.as_mut_ptr() as usize).unwrap();
    assert_eq!(sim.pinned_bytes(), 0);

    // Through gpupool's pinned allocator: out of memory, and nothing changed.
    let host = HostAllocator::new(sim.clone() as Arc<dyn Driver>, &Config::default());
    let before = host.stats();
    assert!(matches!(host.malloc(32 << 40), Err(Error::OutOfMemory(_))));
    assert_eq!(host.stats().allocated_bytes, before.allocated_bytes);
    let p = host.malloc(MIB).unwrap();
    host.free(p).unwrap();
}
