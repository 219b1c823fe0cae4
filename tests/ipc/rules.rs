//! Exported blocks among gpupool's other mechanisms, on the simulated device, with a second
//! process as the importer (`common/ipc.rs`): a handle imported twice, an import outliving its
//! owner, the history of a block in limbo, the out-of-memory path and sleep.

use crate::{common, ipc};

use common::{MIB, check};
use gpupool::config::Config;
use gpupool::{Allocator, Error};
use ipc::{Consumer, fill, hex};

fn ok_ptr(answer: String) -> u64 {
    let p = answer.strip_prefix("ok ").unwrap_or_else(|| panic!("consumer: {answer}"));
    u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap()
}

/// Both configurations: expandable segments (the default) and ordinary ones.
fn each(test: impl Fn(&Allocator, &str)) {
    // SAFETY: a plain prctl (see tests/ipc/sharing.rs).
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    for (name, config) in [("expandable", Config::default()), ("ordinary", Config::pytorch())] {
        let (a, _) = common::sim_with(2, 1 << 30, config);
        test(&a, name);
        check(&a);
    }
}

#[test]
fn the_history_records_a_limbo_block_freed_once_when_the_limbo_frees_it() {
    use gpupool::history::{Action, HistoryContext, HistorySettings};
    each(|a, name| {
        let settings =
            HistorySettings { max_entries: 1000, context: HistoryContext::State, stacks: Default::default() };
        a.record_history(Some(settings)).unwrap();
        let mut c = Consumer::start();
        let p = a.malloc(2 * MIB, 0, 0).unwrap();
        let q = ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(p).unwrap()))));
        a.free(p).unwrap();
        let frees = |a: &Allocator| {
            let snap = a.snapshot().unwrap();
            snap.device_traces[0].iter().filter(|e| e.action == Action::FreeRequested && e.addr == p).count()
        };
        assert_eq!(frees(a), 0, "{name}: in limbo, the block is still allocated in the history");
        check(a);
        ok_ptr(c.ask(&format!("close {q:#x}")));
        assert_eq!(a.ipc_reclaim(), 1);
        assert_eq!(frees(a), 1, "{name}");
        check(a);
        c.end();
        a.record_history(None).unwrap();
    });
}

#[test]
fn the_out_of_memory_path_reclaims_the_limbo_first() {
    for config in [Config::default(), Config::pytorch()] {
        let (a, _) = common::sim_with(1, 64 * MIB, config);
        let mut c = Consumer::start();
        let p = a.malloc(40 * MIB, 0, 0).unwrap();
        let q = ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(p).unwrap()))));
        a.free(p).unwrap();
        assert!(matches!(a.malloc(40 * MIB, 0, 0), Err(Error::OutOfMemory(_))), "held: no room");
        ok_ptr(c.ask(&format!("close {q:#x}")));
        // No gpupool_ipc_* call and no empty_cache in between: the out-of-memory path finds it.
        let r = a.malloc(40 * MIB, 0, 0).unwrap();
        assert!(a.ipc_exports().is_empty());
        a.free(r).unwrap();
        check(&a);
        c.end();
    }
}

#[test]
fn an_import_outlives_its_owner() {
    // The owner is a consumer process too; this process only relays the handle.
    let mut owner = Consumer::start();
    let mut user = Consumer::start();
    let h = owner.ask("export");
    let q = ok_ptr(user.ask(&format!("import {h} 0")));
    owner.end();
    assert_eq!(user.ask(&format!("check {q:#x} {} 77", MIB)), "ok", "the bytes outlive their owner");
    assert_eq!(ok_ptr(user.ask(&format!("close {q:#x}"))), 0);
    assert!(user.ask(&format!("import {h} 0")).contains("has exited"));
    assert_eq!(user.ask("state").split(' ').next(), Some("0"));
    user.end();
}

#[test]
fn a_pool_holding_exported_blocks_does_not_sleep() {
    let (a, _) = common::sim_with(1, 1 << 30, Config::default());
    let mut c = Consumer::start();
    let p = a.malloc(MIB, 0, 0).unwrap();
    let q = ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(p).unwrap()))));
    let refused = a.sleep(0, 0, gpupool::SleepMode::Discard);
    assert!(matches!(&refused, Err(Error::InvalidValue(m)) if m.contains("exported")), "{refused:?}");
    a.free(p).unwrap();
    let refused = a.sleep(0, 0, gpupool::SleepMode::Discard);
    assert!(matches!(&refused, Err(Error::InvalidValue(_))), "in limbo, still imported: {refused:?}");
    ok_ptr(c.ask(&format!("close {q:#x}")));
    a.sleep(0, 0, gpupool::SleepMode::Discard).unwrap();
    a.wake(0, 0).unwrap();
    check(&a);
    c.end();
}

#[test]
fn a_handle_imported_twice_is_closed_twice() {
    each(|a, name| {
        let mut c = Consumer::start();
        let p = a.malloc(MIB, 0, 0).unwrap();
        fill(p, MIB, 5);
        let h = hex(&a.ipc_export(p).unwrap());
        let q1 = ok_ptr(c.ask(&format!("import {h} 0")));
        let q2 = ok_ptr(c.ask(&format!("import {h} 0")));
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 2)], "{name}");
        assert_eq!(ok_ptr(c.ask(&format!("close {q1:#x}"))), 0);
        assert_eq!(c.ask(&format!("check {q2:#x} {} 5", MIB)), "ok", "{name}: the other import is intact");
        assert_eq!(ok_ptr(c.ask(&format!("close {q2:#x}"))), 0);
        assert!(c.ask(&format!("close {q2:#x}")).starts_with("err"), "{name}");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 0)], "{name}");
        c.end();
        a.free(p).unwrap();
    });
}

/// An import of expandable pages is mapped for the importer's device and the peers enabled
/// there, and gains a peer enabled after it (PyTorch's `enablePeerAccess` grants the imported
/// expandable segments of `ipcMemHandle_to_devptr` likewise).
#[test]
fn an_import_is_mapped_for_the_peers_enabled_and_gains_a_later_one() {
    // SAFETY: a plain prctl (see tests/ipc/sharing.rs).
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    let (a, _d) = common::sim_with(2, 1 << 30, Config::default());
    let mut c = Consumer::start();
    let p = a.malloc(5 * MIB, 0, 0).unwrap();
    fill(p, 5 * MIB, 3);
    let q = ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(p).unwrap()))));
    let pieces = c.ask("access 0");
    assert!(!pieces.is_empty() && pieces.split(' ').all(|x| x == "0"), "mapped for device 0 alone: {pieces}");
    assert_eq!(c.ask("peer 1 0"), "ok 0x1");
    let pieces = c.ask("access 0");
    assert!(!pieces.is_empty() && pieces.split(' ').all(|x| x == "0.1"), "the import gained device 1: {pieces}");
    let r = a.malloc(3 * MIB, 0, 0).unwrap();
    let q2 = ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(r).unwrap()))));
    let pieces = c.ask("access 0");
    assert!(pieces.split(' ').all(|x| x == "0.1"), "an import after it is mapped for device 1 too: {pieces}");
    assert_eq!(ok_ptr(c.ask(&format!("close {q:#x}"))), 0);
    assert_eq!(ok_ptr(c.ask(&format!("close {q2:#x}"))), 0);
    c.end();
    a.free(p).unwrap();
    a.free(r).unwrap();
    check(&a);
}
