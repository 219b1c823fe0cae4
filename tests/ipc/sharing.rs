//! Device memory shared between processes (`gpupool_ipc_*`) on the simulated device: this test
//! process is the owner, a second process (the test binary run again, `common/ipc.rs`) the
//! importer. Each test runs with expandable segments (gpupool's default: pages shared as
//! descriptors) and with ordinary segments (`cuIpcGetMemHandle`).

use crate::{common, ipc};

use common::process::alone;
use common::{MIB, check};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimOp};
use gpupool::{Allocator, Error};
use ipc::{Consumer, fill, hex, matches};

/// Both configurations: expandable segments (the default) and ordinary ones.
fn each(test: impl Fn(&Allocator, &SimDriver, &str)) {
    // Under Yama's ptrace_scope 1, let the consumer (a child) take this process's descriptors.
    // SAFETY: a plain prctl; it fails harmlessly where Yama is absent.
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    for (name, config) in [("expandable", Config::default()), ("ordinary", Config::pytorch())] {
        let (a, d) = common::sim_with(2, 1 << 30, config);
        test(&a, &d, name);
        check(&a);
    }
}

fn ok_ptr(answer: String) -> u64 {
    let p = answer.strip_prefix("ok ").unwrap_or_else(|| panic!("consumer: {answer}"));
    u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap()
}

fn allocated(a: &Allocator) -> i64 {
    a.stats(0).unwrap().allocated_bytes.all.current
}

#[test]
fn a_block_crosses_bit_for_bit_and_back() {
    each(|a, _, name| {
        let mut c = Consumer::start();
        // A block across page boundaries, after another so that it does not start a segment.
        let before = a.malloc(3 * MIB, 0, 0).unwrap();
        // A large request too: 20 MiB pages of a range of its own (expandable segments).
        let large = a.malloc(45 * MIB + 1, 0, 0).unwrap();
        fill(large, 45 * MIB + 1, 4);
        let hl = a.ipc_export(large).unwrap();
        let ql = ok_ptr(c.ask(&format!("import {} 0", hex(&hl))));
        assert_eq!(c.ask(&format!("check {ql:#x} {} 4", 45 * MIB + 1)), "ok", "{name}: a large block");
        assert_eq!(ok_ptr(c.ask(&format!("close {ql:#x}"))), 0);
        a.free(large).unwrap();
        let len = 5 * MIB + 12345;
        let p = a.malloc(len, 0, 0).unwrap();
        fill(p, len, 7);
        let h = a.ipc_export(p).unwrap();
        assert_eq!(a.ipc_export(p).unwrap(), h, "{name}: a second export gives the same bytes");
        let q = ok_ptr(c.ask(&format!("import {} 0", hex(&h))));
        assert_eq!(c.ask(&format!("check {q:#x} {len} 7")), "ok", "{name}: the importer sees the owner's bytes");
        assert_eq!(c.ask(&format!("fill {q:#x} {len} 9")), "ok");
        assert!(matches(p, len, 9), "{name}: the owner sees the importer's bytes");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 1)]);
        check(a);
        assert_eq!(ok_ptr(c.ask(&format!("close {q:#x}"))), 0);
        assert!(c.ask(&format!("close {q:#x}")).starts_with("err pointer"), "{name}: a second close is refused");
        assert_eq!(c.ask("state").split(' ').next(), Some("0"));
        c.end();
        // Nobody holds it: the free frees at once and ends the export.
        let held = allocated(a);
        a.free(p).unwrap();
        assert_eq!(allocated(a), held - (len.next_multiple_of(512)) as i64, "{name}");
        assert!(a.ipc_exports().is_empty());
        a.free(before).unwrap();
    });
}

#[test]
fn a_block_freed_while_imported_is_not_reused_until_the_close() {
    each(|a, _, name| {
        let mut c = Consumer::start();
        let len = 4 * MIB;
        let p = a.malloc(len, 0, 0).unwrap();
        fill(p, len, 3);
        let h = a.ipc_export(p).unwrap();
        let q = ok_ptr(c.ask(&format!("import {} 0", hex(&h))));
        let held = allocated(a);
        a.free(p).unwrap();
        assert_eq!(allocated(a), held, "{name}: in limbo, the block counts as allocated (as PyTorch's)");
        assert!(matches!(a.free(p), Err(Error::InvalidPointer(m)) if m.contains("double free")), "{name}");
        assert!(matches!(a.ipc_export(p), Err(Error::InvalidPointer(_))), "{name}: a freed block exports no more");
        check(a);
        for _ in 0..3 {
            let r = a.malloc(len, 0, 0).unwrap();
            assert_ne!(r, p, "{name}: the block in limbo was handed out again");
            a.free(r).unwrap();
        }
        a.empty_cache(0).unwrap();
        assert_eq!(a.ipc_reclaim(), 0);
        assert_eq!(c.ask(&format!("check {q:#x} {len} 3")), "ok", "{name}: the importer's bytes survive the free");
        assert_eq!(ok_ptr(c.ask(&format!("close {q:#x}"))), 0);
        assert_eq!(a.ipc_reclaim(), 1, "{name}: closed, the block is freed by the next reclaim");
        assert_eq!(allocated(a), held - len as i64);
        assert!(a.ipc_exports().is_empty());
        check(a);
        // A late import of the handle is refused with a clear error.
        let late = c.ask(&format!("import {} 0", hex(&h)));
        assert!(late.contains("no longer exists"), "{name}: {late}");
        c.end();
    });
}

#[test]
fn a_killed_importer_does_not_hold_a_block_forever() {
    each(|a, _, name| {
        let mut c = Consumer::start();
        let p = a.malloc(3 * MIB, 0, 0).unwrap();
        let h = a.ipc_export(p).unwrap();
        ok_ptr(c.ask(&format!("import {} 0", hex(&h))));
        ok_ptr(c.ask(&format!("import {} 0", hex(&h))));
        a.free(p).unwrap();
        assert_eq!(a.ipc_exports(), vec![(p, 0, true, 2)], "{name}");
        c.kill(); // SIGKILL, then reaped
        assert_eq!(a.ipc_reclaim(), 1, "{name}: the dead importer's uses are dropped");
        assert!(a.ipc_exports().is_empty());
        assert_eq!(allocated(a), 0);
    });
}

#[test]
fn a_killed_unreaped_importer_counts_as_dead() {
    let (a, _) = common::sim_with(1, 1 << 30, Config::default());
    let mut c = Consumer::start();
    let p = a.malloc(MIB, 0, 0).unwrap();
    ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(p).unwrap()))));
    a.free(p).unwrap();
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(c.child.id() as i32, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.ipc_reclaim() == 0 {
        assert!(std::time::Instant::now() < deadline, "a zombie importer still holds the block");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    c.child.wait().unwrap();
    check(&a);
}

#[test]
fn bad_handles_get_a_clear_error_and_change_nothing() {
    each(|a, d, name| {
        let mut c = Consumer::start();
        let p = a.malloc(MIB, 0, 0).unwrap();
        let h = a.ipc_export(p).unwrap();
        let ask = |c: &mut Consumer, bytes: &[u8], device: i32| c.ask(&format!("import {} {device}", hex(bytes)));
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200 {
            let garbage: Vec<u8> = (0..h.len())
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            assert!(ask(&mut c, &garbage, 0).contains("magic is wrong"), "{name}");
        }
        for i in [9, 20, 60, 100, 150] {
            let mut bad = h;
            bad[i] ^= 0x40;
            let r = ask(&mut c, &bad, 0);
            assert!(r.contains("version") || r.contains("checksum"), "{name}: byte {i}: {r}");
        }
        let mut cut = h;
        cut[h.len() / 2..].fill(0);
        assert!(ask(&mut c, &cut, 0).contains("checksum"), "{name}");
        let other = ask(&mut c, &h, 1);
        assert!(other.contains("is for device 0") && other.contains("not device 1"), "{name}: {other}");
        assert!(ask(&mut c, &h, 7).contains("device 7"), "{name}");
        assert!(matches!(a.ipc_import(&h, 0), Err(Error::InvalidValue(m)) if m.contains("own export")), "{name}");
        assert_eq!(c.ask("state").split(' ').take(1).collect::<Vec<_>>(), ["0"], "{name}: nothing imported");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 0)], "{name}: no use left behind");
        c.end();
        // An export of a process that has exited.
        let mut owner = Consumer::start();
        let theirs = ipc::handle_of(&owner.ask("export"));
        owner.end();
        let gone = a.ipc_import(&theirs, 0);
        assert!(matches!(&gone, Err(Error::InvalidValue(m)) if m.contains("has exited")), "{name}: {gone:?}");
        assert!(matches!(a.ipc_export(p + 512), Err(Error::InvalidPointer(_))), "{name}: an interior pointer");
        assert!(matches!(a.ipc_export(0x1000), Err(Error::InvalidPointer(_))), "{name}");
        assert!(matches!(a.ipc_close(p), Err(Error::InvalidPointer(_))), "{name}: not an import");
        a.free(p).unwrap();
        let _ = d;
    });
}

#[test]
fn ten_thousand_cycles_leave_address_space_descriptors_and_memory_flat() {
    // Alone in a process of its own: its figures are the process's, which other tests' threads
    // would move.
    if !alone() {
        return;
    }
    each(|a, d, name| {
        let mut c = Consumer::start();
        let keep = a.malloc(MIB, 0, 0).unwrap();
        let cycle = |c: &mut Consumer, i: usize| {
            let len = [MIB, 3 * MIB, 64 << 10][i % 3];
            let p = a.malloc(len, 0, 0).unwrap();
            fill(p, 4096, i as u8);
            let h = a.ipc_export(p).unwrap();
            assert_eq!(c.ask(&format!("cycle {} 4096 {}", hex(&h), i as u8)), "ok 0x1", "{name}: cycle {i}");
            a.free(p).unwrap();
        };
        for i in 0..300 {
            cycle(&mut c, i);
        }
        let (owner_before, used_before) = (ipc::footprint(), d.used(0));
        let consumer_before = c.ask("state");
        for i in 300..10_000 {
            cycle(&mut c, i);
        }
        let (owner_after, used_after) = (ipc::footprint(), d.used(0));
        let consumer_after = c.ask("state");
        assert_eq!(consumer_after, consumer_before, "{name}: the importer's imports, VmSize, descriptors, mappings");
        assert_eq!(owner_after.1, owner_before.1, "{name}: the owner's descriptors");
        assert!(owner_after.0 <= owner_before.0 + 1024, "{name}: VmSize {owner_before:?} -> {owner_after:?}");
        assert_eq!(used_after, used_before, "{name}: device memory");
        assert!(a.ipc_exports().is_empty());
        a.free(keep).unwrap();
        c.end();
    });
}

#[test]
fn threads_export_and_import_at_once() {
    each(|a, _, name| {
        let mut c = Consumer::start();
        let blocks: Vec<u64> = (0..4).map(|i| a.malloc((i + 1) * MIB, 0, 0).unwrap()).collect();
        let handles: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = blocks.iter().map(|&p| s.spawn(move || hex(&a.ipc_export(p).unwrap()))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::thread::scope(|s| {
            // The owner keeps allocating, exporting and freeing other blocks on other threads.
            for t in 0..2usize {
                s.spawn(move || {
                    for i in 0..300 {
                        let p = a.malloc(MIB + i * 512, 0, t + 1).unwrap();
                        a.ipc_export(p).unwrap();
                        a.free(p).unwrap();
                    }
                });
            }
            assert_eq!(c.ask(&format!("threads 200 {}", handles.join(" "))), "true", "{name}");
        });
        assert_eq!(a.ipc_exports().len(), 4, "{name}");
        for p in blocks {
            a.free(p).unwrap();
        }
        assert!(a.ipc_exports().is_empty());
        check(a);
        c.end();
    });
}

fn fault() -> DriverError {
    DriverError::Cuda { call: "test", code: 999, name: "CUDA_ERROR_UNKNOWN".into() }
}

#[test]
fn a_fault_at_each_step_leaves_the_accounting_right() {
    each(|a, d, name| {
        let p = a.malloc(5 * MIB, 0, 0).unwrap();
        fill(p, 5 * MIB, 1);
        for op in [SimOp::DeviceUuid, SimOp::MemExport, SimOp::IpcGetMemHandle] {
            d.inject_fault(op, 0, fault());
            let r = a.ipc_export(p);
            let fired = d.pending_faults() == 0;
            d.clear_faults();
            if fired {
                assert!(r.is_err(), "{name}: {op:?}");
                assert!(a.ipc_exports().is_empty(), "{name}: {op:?} left an export");
                check(a);
            }
        }
        let h = a.ipc_export(p).unwrap();
        let mut c = Consumer::start();
        let fired = if name == "expandable" { "ok 8" } else { "ok 3" };
        assert_eq!(c.ask(&format!("faults {} {} 1", hex(&h), 5 * MIB)), fired, "{name}");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 0)], "{name}: every failed import dropped its use");
        assert_eq!(c.ask("state").split(' ').next(), Some("0"));
        c.end();
        a.free(p).unwrap();
        check(a);
    });
}

#[test]
fn a_driver_that_cannot_share_says_so() {
    let d = SimDriver::new(1, 1 << 30);
    d.inject(SimOp::MemExport, 0, gpupool::driver::sim::SimFault::MissingSymbol);
    let a = Allocator::new(std::sync::Arc::new(d), Config::default());
    let p = a.malloc(MIB, 0, 0).unwrap();
    let r = a.ipc_export(p);
    assert!(matches!(&r, Err(Error::DriverUnavailable(m)) if m.contains("cuMemExportToShareableHandle")), "{r:?}");
    a.free(p).unwrap();
    assert!(a.driver().device_uuid(0).is_ok());
}

#[test]
fn a_free_racing_an_import_never_hands_an_imported_block_out() {
    each(|a, _, name| {
        let mut c = Consumer::start();
        let (mut imported, mut refused) = (0, 0);
        for i in 0..2000usize {
            let len = [MIB, 64 << 10][i % 2];
            let p = a.malloc(len, 0, 0).unwrap();
            fill(p, 4096, i as u8);
            let h = a.ipc_export(p).unwrap();
            // The consumer imports, checks and closes while this process frees the block and
            // writes other bytes into whatever the next malloc gives.
            c.send(&format!("cycle {} 4096 {}", hex(&h), i as u8));
            a.free(p).unwrap();
            let q = a.malloc(len, 0, 0).unwrap();
            fill(q, 4096, (i as u8).wrapping_add(1));
            match c.answer().as_str() {
                "ok 0x1" => imported += 1,
                r if r.contains("freed the block") || r.contains("no longer exists") => refused += 1,
                r => panic!("{name}: cycle {i}: {r}"),
            }
            a.free(q).unwrap();
            a.ipc_reclaim();
        }
        assert_eq!(imported + refused, 2000);
        assert!(a.ipc_exports().is_empty(), "{name}");
        eprintln!("{name}: {imported} imports won the race, {refused} were refused");
        c.end();
    });
}
