//! Importer slots of processes that died (issue 40, defect 3): an export takes 64 importer
//! processes at once, and one that exits or is killed holding an import must not keep its
//! slot. Here 64 importers die every way a process can (killed and reaped, killed and left a
//! zombie, exited without closing) while the owner calls nothing: the next import clears
//! their slots itself. Then new importers race each other and the owner to clear a full table
//! of dead ones: no live importer's use is ever cleared with them. The importer is the test
//! binary run again (`common/ipc.rs`), as in `sharing.rs`.

use crate::{common, ipc};

use common::{MIB, check};
use gpupool::Allocator;
use gpupool::config::Config;
use ipc::{Consumer, fill, hex};

fn ok_ptr(answer: String) -> u64 {
    let p = answer.strip_prefix("ok ").unwrap_or_else(|| panic!("consumer: {answer}"));
    u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap()
}

/// An allocator of one simulated device and an exported block of 1 MiB filled with `seed`,
/// by its handle.
fn exported(seed: u8) -> (Allocator, u64, String) {
    let (a, _) = common::sim_with(1, 1 << 30, Config::default());
    // Under Yama's ptrace_scope 1, let the consumers (children) take this process's descriptors.
    // SAFETY: a plain prctl; it fails harmlessly where Yama is absent.
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    let p = a.malloc(MIB, 0, 0).unwrap();
    fill(p, MIB, seed);
    let h = hex(&a.ipc_export(p).unwrap());
    (a, p, h)
}

/// 64 consumers, each holding an import of `h`, then dead: a third killed and reaped, a
/// third killed and left zombies (returned, to be reaped by the caller), a third exited
/// without closing.
fn fill_with_dead(h: &str) -> Vec<Consumer> {
    let mut cs: Vec<Consumer> = (0..64).map(|_| Consumer::start()).collect();
    for c in &mut cs {
        ok_ptr(c.ask(&format!("import {h} 0")));
    }
    let mut zombies = Vec::new();
    for (i, mut c) in cs.into_iter().enumerate() {
        match i % 3 {
            0 => c.kill(),
            1 => {
                c.child.kill().unwrap();
                zombies.push(c);
            }
            _ => {
                assert_eq!(c.ask("quit"), "bye");
                assert!(c.child.wait().unwrap().success());
            }
        }
    }
    // A killed child is a zombie once the kernel has torn it down; wait for that.
    for c in &mut zombies {
        let stat = format!("/proc/{}/stat", c.child.id());
        let zombie = || {
            std::fs::read_to_string(&stat).is_ok_and(|s| s.rsplit(')').next().unwrap().trim_start().starts_with('Z'))
        };
        while !zombie() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    zombies
}

#[test]
fn an_import_clears_the_slots_of_dead_importers_when_the_owner_calls_nothing() {
    let (a, p, h) = exported(6);
    let mut zombies = fill_with_dead(&h);
    // Nothing of the owner's ran since: the 65th importer finds every slot taken by the dead.
    let mut cs: Vec<Consumer> = (0..64).map(|_| Consumer::start()).collect();
    for (i, c) in cs.iter_mut().enumerate() {
        let q = ok_ptr(c.ask(&format!("import {h} 0")));
        assert_eq!(c.ask(&format!("check {q:#x} {MIB} 6")), "ok", "importer {i}");
    }
    let mut extra = Consumer::start();
    let r = extra.ask(&format!("import {h} 0"));
    assert!(r.starts_with("err ") && r.contains("64 processes already"), "64 live importers fill it: {r}");
    assert_eq!(a.ipc_exports(), vec![(p, 0, false, 64)], "the live importers' uses, and only theirs");
    for c in cs {
        c.end();
    }
    extra.end();
    zombies.iter_mut().for_each(|z| drop(z.child.wait()));
    a.free(p).unwrap();
    assert!(a.ipc_exports().is_empty());
    check(&a);
}

#[test]
fn the_owners_reclaim_clears_a_live_exports_dead_importers() {
    let (a, p, h) = exported(8);
    let mut zombies = fill_with_dead(&h);
    assert_eq!(a.ipc_reclaim(), 0, "nothing in limbo");
    zombies.iter_mut().for_each(|z| drop(z.child.wait()));
    // The slots were cleared by the reclaim: an import has nothing left to clear, and the
    // owner's count says no use.
    let mut c = Consumer::start();
    ok_ptr(c.ask(&format!("import {h} 0")));
    assert_eq!(a.ipc_exports(), vec![(p, 0, false, 1)]);
    c.end();
    a.free(p).unwrap();
    check(&a);
}

/// 40 importers at once against a table full of dead ones, the owner listing its exports (and
/// so clearing) all the while: every import succeeds, and the owner counts each live use once.
#[test]
fn importers_and_the_owner_clearing_at_once_never_lose_a_live_use() {
    let (a, p, h) = exported(9);
    for round in 0..3 {
        let mut zombies = fill_with_dead(&h);
        let mut cs: Vec<Consumer> = (0..40).map(|_| Consumer::start()).collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (answers, most) = std::thread::scope(|s| {
            let lister = s.spawn(|| {
                let mut most = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    most = most.max(a.ipc_exports()[0].3);
                }
                most
            });
            cs.iter_mut().for_each(|c| c.send(&format!("import {h} 0")));
            let answers: Vec<String> = cs.iter_mut().map(Consumer::answer).collect();
            // Stopped before anything is checked, so that a failure does not leave it running.
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            (answers, lister.join().unwrap())
        });
        for (i, r) in answers.iter().enumerate() {
            assert!(r.starts_with("ok "), "round {round}, importer {i}: {r}");
        }
        assert!(most <= 40, "round {round}: {most} uses counted at once");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 40)], "round {round}");
        for c in cs {
            c.end();
        }
        zombies.iter_mut().for_each(|z| drop(z.child.wait()));
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 0)], "round {round}");
    }
    a.free(p).unwrap();
    check(&a);
}
