//! `gpupool_ipc_*` attacked as an outsider would, on the simulated device: every byte of a
//! handle flipped in turn, handles forged with a valid checksum (absurd sizes and offsets,
//! another descriptor of the owner, an owner that is another program), a 65th importer, an
//! importer that exits without closing, a handle replayed once its descriptor was reused, and
//! an export racing a sleep of its pool. Each must be refused with a clear error and change
//! nothing. The importer is the test binary run again (`common/ipc.rs`), as in `sharing.rs`.

use crate::{common, ipc};

use common::{MIB, check};
use gpupool::config::Config;
use gpupool::{Allocator, Error, IPC_HANDLE_SIZE, SleepMode};
use ipc::{Consumer, fill, hex, matches};

/// Both configurations: expandable segments (the default) and ordinary ones.
fn each(test: impl Fn(&Allocator, &str)) {
    // SAFETY: a plain prctl; it fails harmlessly where Yama is absent.
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    for (name, config) in [("expandable", Config::default()), ("ordinary", Config::pytorch())] {
        let (a, _) = common::sim_with(2, 1 << 30, config);
        test(&a, name);
        check(&a);
    }
}

fn ok_ptr(answer: String) -> u64 {
    let p = answer.strip_prefix("ok ").unwrap_or_else(|| panic!("consumer: {answer}"));
    u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap()
}

/// The consumer's imports open and its descriptors (`state`: imports, VmSize, descriptors, ...).
fn imports_and_fds(c: &mut Consumer) -> (String, String) {
    let s = c.ask("state");
    let w: Vec<&str> = s.split(' ').collect();
    (w[0].to_string(), w[2].to_string())
}

/// The handle's checksum made right again after a field was changed (FNV-1a of the first 144
/// bytes, at byte 144; `src/ipc/handle.rs`).
fn reseal(h: &mut [u8; IPC_HANDLE_SIZE]) {
    let sum = h[..144].iter().fold(0xcbf2_9ce4_8422_2325u64, |s, &b| (s ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    h[144..152].copy_from_slice(&sum.to_le_bytes());
}

fn forged(h: &[u8; IPC_HANDLE_SIZE], at: usize, bytes: &[u8]) -> [u8; IPC_HANDLE_SIZE] {
    let mut f = *h;
    f[at..at + bytes.len()].copy_from_slice(bytes);
    reseal(&mut f);
    f
}

/// Process 1's start time in clock ticks (`/proc/1/stat`, field 22), as handles carry it.
fn start_time_of_init() -> u64 {
    let stat = std::fs::read_to_string("/proc/1/stat").unwrap_or_default();
    let rest = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    rest.split_ascii_whitespace().nth(19).and_then(|f| f.parse().ok()).unwrap_or(1)
}

#[test]
fn every_byte_flipped_in_turn_is_refused_and_changes_nothing() {
    each(|a, name| {
        let mut c = Consumer::start();
        let p = a.malloc(3 * MIB, 0, 0).unwrap();
        let h = a.ipc_export(p).unwrap();
        let before = imports_and_fds(&mut c);
        for i in 0..IPC_HANDLE_SIZE {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = h;
                bad[i] ^= flip;
                let r = c.ask(&format!("import {} 0", hex(&bad)));
                assert!(r.starts_with("err the IPC handle is not valid"), "{name}: byte {i} ^ {flip:#x}: {r}");
            }
        }
        assert_eq!(imports_and_fds(&mut c), before, "{name}: nothing imported, no descriptor left open");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 0)], "{name}: no use left behind");
        let q = ok_ptr(c.ask(&format!("import {} 0", hex(&h))));
        assert_eq!(ok_ptr(c.ask(&format!("close {q:#x}"))), 0, "{name}: the real handle still imports");
        c.end();
        a.free(p).unwrap();
    });
}

#[test]
fn forged_handles_with_a_valid_checksum_are_refused_and_change_nothing() {
    each(|a, name| {
        let mut c = Consumer::start();
        let p = a.malloc(3 * MIB, 0, 0).unwrap();
        fill(p, 3 * MIB, 5);
        let h = a.ipc_export(p).unwrap();
        let before = imports_and_fds(&mut c);
        let mut forgeries: Vec<(&str, [u8; IPC_HANDLE_SIZE])> = vec![
            ("size 2^63", forged(&h, 64, &(1u64 << 63).to_le_bytes())),
            ("size u64::MAX", forged(&h, 64, &u64::MAX.to_le_bytes())),
            ("size one more", forged(&h, 64, &(3 * MIB as u64 + 1).to_le_bytes())),
            ("offset 2^63", forged(&h, 72, &(1u64 << 63).to_le_bytes())),
            ("offset beyond the block", forged(&h, 72, &(64 * MIB as u64).to_le_bytes())),
            ("another export id", forged(&h, 56, &u64::MAX.to_le_bytes())),
            ("the other kind", forged(&h, 12, &[3 - h[12], 0, 0, 0])),
            ("kind 0", forged(&h, 12, &[0, 0, 0, 0])),
            ("pid 0", forged(&h, 16, &[0, 0, 0, 0])),
            ("another start time", forged(&h, 24, &[1, 0, 0, 0, 0, 0, 0, 0])),
            ("a zeroed segment handle", forged(&h, 80, &[0u8; 64])),
        ];
        // Every other descriptor of the owner (its stdin, the test harness's, the pages' ...).
        let fds: Vec<[u8; 4]> = (0..64i32).chain([i32::MAX, -1]).map(i32::to_le_bytes).collect();
        forgeries.extend(fds.iter().map(|fd| ("another descriptor", forged(&h, 20, fd))));
        // A live process that is another program (init), with its real start time.
        let init = start_time_of_init();
        forgeries.push(("pid 1", forged(&forged(&h, 16, &1u32.to_le_bytes()), 24, &init.to_le_bytes())));
        for (what, f) in &forgeries {
            if f == &h {
                continue;
            }
            let r = c.ask(&format!("import {} 0", hex(f)));
            assert!(r.starts_with("err "), "{name}: {what}: {r}");
            assert!(!r.contains("panic"), "{name}: {what}: {r}");
        }
        assert_eq!(imports_and_fds(&mut c), before, "{name}: nothing imported, no descriptor left open");
        assert_eq!(a.ipc_exports(), vec![(p, 0, false, 0)], "{name}: no use left behind");
        let q = ok_ptr(c.ask(&format!("import {} 0", hex(&h))));
        assert_eq!(c.ask(&format!("check {q:#x} {} 5", 3 * MIB)), "ok", "{name}");
        assert_eq!(ok_ptr(c.ask(&format!("close {q:#x}"))), 0);
        c.end();
        a.free(p).unwrap();
    });
}

#[test]
fn the_65th_importer_gets_a_clear_error_and_the_first_64_keep_theirs() {
    let (a, _) = common::sim_with(1, 1 << 30, Config::default());
    // SAFETY: a plain prctl.
    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    let p = a.malloc(MIB, 0, 0).unwrap();
    fill(p, MIB, 9);
    let h = hex(&a.ipc_export(p).unwrap());
    let mut cs: Vec<Consumer> = (0..65).map(|_| Consumer::start()).collect();
    let mut qs = Vec::new();
    for c in &mut cs[..64] {
        qs.push(ok_ptr(c.ask(&format!("import {h} 0"))));
        // A second import of the same process takes no second slot.
        ok_ptr(c.ask(&format!("import {h} 0")));
    }
    let r = cs[64].ask(&format!("import {h} 0"));
    assert!(r.starts_with("err ") && r.contains("64 processes already"), "{r}");
    assert_eq!(imports_and_fds(&mut cs[64]).0, "0");
    assert_eq!(a.ipc_exports(), vec![(p, 0, false, 128)]);
    for (c, q) in cs.iter_mut().zip(&qs) {
        assert_eq!(c.ask(&format!("check {q:#x} {MIB} 9")), "ok");
    }
    // One importer ends: its slot serves the 65th.
    cs.remove(0).end();
    ok_ptr(cs[63].ask(&format!("import {h} 0")));
    a.free(p).unwrap();
    assert_eq!(a.ipc_exports(), vec![(p, 0, true, 127)]);
    for c in cs {
        c.end();
    }
    assert_eq!(a.ipc_reclaim(), 1);
    check(&a);
}

#[test]
fn an_importer_that_exits_without_closing_lets_the_block_go() {
    each(|a, name| {
        let mut c = Consumer::start();
        let p = a.malloc(2 * MIB, 0, 0).unwrap();
        ok_ptr(c.ask(&format!("import {} 0", hex(&a.ipc_export(p).unwrap()))));
        a.free(p).unwrap();
        assert_eq!(a.ipc_reclaim(), 0, "{name}: held while the importer runs");
        assert_eq!(c.ask("quit"), "bye");
        assert!(c.child.wait().unwrap().success());
        assert_eq!(a.ipc_reclaim(), 1, "{name}: an importer that exited holds nothing");
        assert!(a.ipc_exports().is_empty());
    });
}

#[test]
fn a_handle_replayed_after_its_descriptor_was_reused_is_refused() {
    each(|a, name| {
        let mut c = Consumer::start();
        let p = a.malloc(MIB, 0, 0).unwrap();
        let old = a.ipc_export(p).unwrap();
        a.free(p).unwrap();
        // New exports, some of which take the old record's descriptor number.
        let news: Vec<u64> = (0..8).map(|_| a.malloc(MIB, 0, 0).unwrap()).collect();
        news.iter().for_each(|&q| assert!(a.ipc_export(q).is_ok()));
        let r = c.ask(&format!("import {} 0", hex(&old)));
        assert!(r.starts_with("err ") && r.contains("no longer exists"), "{name}: {r}");
        assert_eq!(imports_and_fds(&mut c).0, "0");
        assert!(a.ipc_exports().iter().all(|e| e.3 == 0), "{name}: no use left behind");
        news.into_iter().for_each(|q| a.free(q).unwrap());
        c.end();
    });
}

/// A sleep checks for exported blocks before it begins; an export that comes while its copies
/// are under way must be refused, or the sleep refused: never a sleeping pool holding an
/// exported block (its importers would keep the old pages).
#[test]
fn an_export_racing_a_sleep_never_leaves_a_sleeping_pool_exported() {
    let (a, _) = common::sim_with(1, 1 << 30, Config::default());
    let (mut slept, mut exported_first, mut refused) = (0, 0, 0);
    for i in 0..40u64 {
        let big = a.malloc(96 * MIB, 0, 0).unwrap();
        fill(big, 96 * MIB, 3);
        let small = a.malloc(MIB, 0, 0).unwrap();
        let (sleep, exports) = std::thread::scope(|s| {
            let sleeper = s.spawn(|| a.sleep(0, 0, SleepMode::Offload));
            std::thread::sleep(std::time::Duration::from_micros(i * 100));
            let mut exports = 0;
            while !sleeper.is_finished() {
                match a.ipc_export(small) {
                    Ok(_) => exports += 1,
                    Err(Error::InvalidValue(m)) if m.contains("sleep") => {}
                    Err(e) => panic!("{e}"),
                }
            }
            (sleeper.join().unwrap(), exports)
        });
        match sleep {
            Ok(()) => {
                slept += 1;
                assert!(a.ipc_exports().is_empty(), "round {i}: a sleeping pool holds an exported block");
                a.wake(0, 0).unwrap();
                assert!(matches(big, 96 * MIB, 3));
            }
            Err(Error::InvalidValue(m)) if m.contains("exported") => exported_first += 1,
            Err(e) => panic!("round {i}: {e}"),
        }
        refused += (exports == 0) as usize;
        a.free(small).unwrap();
        a.free(big).unwrap();
        check(&a);
    }
    eprintln!("{slept} sleeps, {exported_first} refused for an export, {refused} rounds with no export");
}
