//! Tags on the simulated device: nesting, per-tag statistics with allocations and frees on
//! several threads (a block counts to the tag it was allocated under, whoever frees it), the
//! tag in the snapshot's frames and trace as CPython reads the pickle, tags kept when the
//! history stops keeping stacks, the live report's grouping and order, the out-of-memory
//! message's top tags, and nothing recorded in a process where no tag was pushed.
//!
//! Tag names are process-wide and each thread has its own stack: each test uses names of its
//! own and an allocator of its own, so that tests running at once do not see each other's.
use crate::common;

use std::process::Command;
use std::sync::Arc;

use common::history::python_reads;
use common::{MIB, check, sim};
use gpupool::Allocator;
use gpupool::history::{Frame, HistoryContext, HistorySettings, TagStats, tags};
use gpupool::stats::Stat;

const S: usize = 0x10;

fn stats(a: &Allocator, name: &str) -> TagStats {
    a.tag_stats(name).unwrap()
}

fn tag_frame(name: &str) -> Frame {
    Frame { name: format!("tag {name}"), filename: "<tag>".to_string(), line: 0 }
}

#[test]
fn the_innermost_tag_is_the_blocks() {
    let (a, _drv) = sim(1, 256 * MIB);
    tags::push("nest-outer").unwrap();
    let p1 = a.malloc(1000, 0, S).unwrap();
    tags::push("nest-inner").unwrap();
    let p2 = a.malloc(3 * MIB, 0, S).unwrap();
    tags::push("nest-outer").unwrap();
    let p3 = a.malloc(512, 0, S).unwrap();
    tags::pop().unwrap();
    let p4 = a.malloc(2000, 0, S).unwrap();
    tags::pop().unwrap();
    let p5 = a.malloc(4000, 0, S).unwrap();
    tags::pop().unwrap();
    let untagged = a.malloc(512, 0, S).unwrap();
    assert!(tags::pop().is_err(), "every push was popped");
    let outer = stats(&a, "nest-outer");
    assert_eq!(outer.bytes, Stat { current: 1024 + 512 + 4096, peak: 1024 + 512 + 4096, allocated: 5632, freed: 0 });
    assert_eq!(outer.blocks.current, 3);
    let inner = stats(&a, "nest-inner");
    assert_eq!(inner.bytes.current, (3 * MIB + 2048) as i64);
    assert_eq!(inner.blocks.current, 2);
    // Every block tagged but one: the tags add up to allocated_bytes less that one.
    let allocated = a.stats(0).unwrap().allocated_bytes.all.current;
    assert_eq!(outer.bytes.current + inner.bytes.current + 512, allocated);
    for p in [p1, p2, p3, p4, p5, untagged] {
        a.free(p).unwrap();
    }
    let outer = stats(&a, "nest-outer");
    assert_eq!(outer.bytes, Stat { current: 0, peak: 5632, allocated: 5632, freed: 5632 });
    assert_eq!(outer.blocks, Stat { current: 0, peak: 3, allocated: 3, freed: 3 });
    assert!(a.tag_stats("nest-never-pushed").is_err());
    check(&a);
}

#[test]
fn statistics_across_threads_count_each_block_to_its_own_tag() {
    let (a, _drv) = sim(1, 1 << 30);
    let a = Arc::new(a);
    const THREADS: usize = 4;
    const ROUNDS: usize = 200;
    // Each thread allocates under its tag, and hands every other block to the next thread,
    // which frees it under its own tag: those count to the allocating thread's tag.
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| std::sync::mpsc::channel::<u64>()).unzip();
    let mut rxs: Vec<Option<_>> = rxs.into_iter().map(Some).collect();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let a = a.clone();
            let tx = txs[(t + 1) % THREADS].clone();
            let rx = rxs[t].take().unwrap();
            std::thread::spawn(move || {
                tags::push(&format!("threads-{t}")).unwrap();
                let mut kept = Vec::new();
                for i in 0..ROUNDS {
                    let p = a.malloc(512 * (t + 1), 0, S + t).unwrap();
                    if i % 2 == 0 { tx.send(p).unwrap() } else { kept.push(p) }
                }
                drop(tx);
                // Frees the blocks handed over by the previous thread, under this thread's tag.
                for p in rx {
                    a.free(p).unwrap();
                }
                tags::pop().unwrap();
                kept
            })
        })
        .collect();
    drop(txs);
    let kept: Vec<Vec<u64>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for t in 0..THREADS {
        let s = stats(&a, &format!("threads-{t}"));
        let size = (512 * (t + 1)) as i64;
        let n = ROUNDS as i64;
        assert_eq!(s.blocks.allocated, n, "thread {t}");
        assert_eq!(s.blocks.freed, n / 2, "thread {t}: the other thread's frees count here");
        assert_eq!(s.blocks.current, n / 2);
        assert_eq!(s.bytes.current, size * n / 2);
        assert_eq!(s.bytes.freed, size * n / 2);
        assert!(s.bytes.peak >= s.bytes.current && s.bytes.peak <= size * n, "{s:?}");
    }
    // Freed here, untagged, on this thread: still each to its own tag.
    for (t, ps) in kept.iter().enumerate() {
        for &p in ps {
            a.free(p).unwrap();
        }
        let s = stats(&a, &format!("threads-{t}"));
        assert_eq!((s.bytes.current, s.blocks.current, s.blocks.freed), (0, 0, ROUNDS as i64));
    }
    check(&a);
}

/// Checks with CPython's pickle that the snapshot at argv[1] gives each active block whose
/// address is in argv[2] (a JSON object: address -> tag name) the tag's frame as its outermost,
/// untagged blocks none, and that the `alloc` events of those addresses carry it too.
const CHECK_TAGS: &str = r#"
import json, pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
want = {int(k): v for k, v in json.loads(sys.argv[2]).items()}
seen = {}
for g in snap["segments"]:
    for b in g["blocks"]:
        if b["state"] != "active_allocated":
            continue
        tag = [f for f in b["frames"] if f["filename"] == "<tag>"]
        assert len(tag) <= 1, b
        if tag:
            assert b["frames"][-1] == tag[0] and tag[0]["line"] == 0, b["frames"]
            seen[b["address"]] = tag[0]["name"]
for addr, name in want.items():
    assert seen.get(addr) == ("tag " + name if name else None), (hex(addr), seen.get(addr), name)
for e in snap["device_traces"][0]:
    if e["action"] == "alloc" and e["addr"] in want and want[e["addr"]]:
        assert e["frames"][-1] == {"filename": "<tag>", "line": 0, "name": "tag " + want[e["addr"]]}, e
print("ok")
"#;

fn check_pickle(a: &Allocator, want: &[(u64, &str)]) {
    let want = format!("{{{}}}", want.iter().map(|(p, n)| format!("\"{p}\": \"{n}\"")).collect::<Vec<_>>().join(", "));
    python_reads(&a.snapshot().unwrap().to_pickle(), CHECK_TAGS, &[&want]);
}

#[test]
fn the_snapshot_shows_each_blocks_tag_as_its_outermost_frame() {
    let (a, _drv) = sim(1, 256 * MIB);
    a.record_history(Some(HistorySettings {
        max_entries: 1000,
        context: HistoryContext::All,
        stacks: Default::default(),
    }))
    .unwrap();
    tags::push("snap-encoder").unwrap();
    let p1 = a.malloc(1000, 0, S).unwrap();
    tags::pop().unwrap();
    let plain = a.malloc(1000, 0, S).unwrap();
    tags::push("snap-decoder").unwrap();
    let p2 = a.malloc(3 * MIB, 0, S).unwrap();
    tags::pop().unwrap();
    let snap = a.snapshot().unwrap();
    let block = |p: u64| snap.segments.iter().flat_map(|g| &g.blocks).find(|b| b.address == p).unwrap().clone();
    assert_eq!(block(p1).frames.last(), Some(&tag_frame("snap-encoder")));
    assert!(block(p1).frames.len() > 1, "the stack, then the tag");
    assert!(block(plain).frames.iter().all(|f| f.filename != "<tag>"));
    // The segment made for p2 was made under its tag.
    let seg = snap.segments.iter().find(|g| g.blocks.iter().any(|b| b.address == p2)).unwrap();
    assert_eq!(seg.frames.last(), Some(&tag_frame("snap-decoder")));
    check_pickle(&a, &[(p1, "snap-encoder"), (plain, ""), (p2, "snap-decoder")]);

    // Stacks no longer kept: blocks forget theirs and keep their tags; events carry the tag.
    a.record_history(Some(HistorySettings {
        max_entries: 1000,
        context: HistoryContext::None,
        stacks: Default::default(),
    }))
    .unwrap();
    tags::push("snap-late").unwrap();
    let p3 = a.malloc(5000, 0, S).unwrap();
    tags::pop().unwrap();
    let snap = a.snapshot().unwrap();
    let block = |p: u64| snap.segments.iter().flat_map(|g| &g.blocks).find(|b| b.address == p).unwrap().clone();
    assert_eq!(block(p1).frames.to_vec(), [tag_frame("snap-encoder")]);
    assert_eq!(block(p3).frames.to_vec(), [tag_frame("snap-late")]);
    assert!(block(plain).frames.is_empty());
    let alloc = snap.device_traces[0].iter().rev().find(|e| e.addr == p3).unwrap();
    assert_eq!(alloc.frames.to_vec(), [tag_frame("snap-late")]);
    check_pickle(&a, &[(p1, "snap-encoder"), (p3, "snap-late"), (plain, "")]);

    // History off: the tags stay with the blocks, and the snapshot still shows them.
    a.record_history(None).unwrap();
    let snap = a.snapshot().unwrap();
    let tagged = snap.segments.iter().flat_map(|g| &g.blocks).find(|b| b.address == p2).unwrap();
    assert_eq!(tagged.frames.to_vec(), [tag_frame("snap-decoder")]);
    for p in [p1, plain, p2, p3] {
        a.free(p).unwrap();
    }
    assert_eq!(stats(&a, "snap-encoder").bytes.current, 0);
    assert_eq!(stats(&a, "snap-late").blocks.freed, 1);
    check(&a);
}

#[test]
fn the_live_report_groups_by_tag_then_stack_largest_first() {
    let (a, _drv) = sim(1, 256 * MIB);
    tags::push("live-small").unwrap();
    let s1 = a.malloc(1000, 0, S).unwrap();
    let s2 = a.malloc(1000, 0, S).unwrap();
    tags::pop().unwrap();
    tags::push("live-large").unwrap();
    let l1 = a.malloc(4 * MIB, 0, S).unwrap();
    tags::pop().unwrap();
    let u = a.malloc(100_000, 0, S).unwrap();
    // Stacks from here on: two call sites under one tag.
    a.record_history(Some(HistorySettings {
        max_entries: 0,
        context: HistoryContext::State,
        stacks: Default::default(),
    }))
    .unwrap();
    tags::push("live-stacked").unwrap();
    #[inline(never)]
    fn site_a(a: &Allocator) -> u64 {
        a.malloc(std::hint::black_box(3 * MIB), 0, S).unwrap()
    }
    #[inline(never)]
    fn site_b(a: &Allocator) -> u64 {
        a.malloc(std::hint::black_box(MIB), 0, S).unwrap()
    }
    let k = [site_b(&a), site_a(&a)];
    tags::pop().unwrap();
    let report = a.live_report(0).unwrap();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines[0], "gpupool live report, device 0: 8.10 MiB in 6 blocks", "{report}");
    let at = |s: &str| report.find(s).unwrap_or_else(|| panic!("{s:?} not in:\n{report}"));
    // Tags by bytes: stacked (4 MiB in 2), large (4 MiB in 1), untagged (98 KiB), small.
    let (stacked, large, none, small) = (
        at("  4.00 MiB in 2 blocks: tag live-stacked\n"),
        at("  4.00 MiB in 1 block: tag live-large\n"),
        at("  98.00 KiB in 1 block: no tag\n"),
        at("  2.00 KiB in 2 blocks: tag live-small\n"),
    );
    assert!(stacked < large && large < none && none < small, "{report}");
    assert!(
        report[small..]
            .starts_with("  2.00 KiB in 2 blocks: tag live-small\n    2.00 KiB in 2 blocks, no call stack recorded\n")
    );
    // Within the stacked tag, each stack on its own, the larger first.
    let (three, one) =
        (at("    3.00 MiB in 1 block, allocated at:\n"), at("    1024.00 KiB in 1 block, allocated at:\n"));
    assert!(stacked < three && three < one && one < large, "{report}");
    for p in [s1, s2, l1, u, k[0], k[1]] {
        a.free(p).unwrap();
    }
    assert_eq!(a.live_report(0).unwrap(), "gpupool live report, device 0: 0 bytes in 0 blocks\n");
    check(&a);
}

/// A name holding a control character (C0, DEL, C1) or a Unicode line or paragraph separator
/// is refused, naming the byte where it is, and changes nothing: a newline in a name once
/// forged a line of the live report.
#[test]
fn a_name_with_a_control_character_is_refused() {
    let (a, _drv) = sim(1, 256 * MIB);
    let forged = "ctl-x\n  8.00 GiB in 999 blocks: tag fake";
    for (name, at) in [
        (forged, 5),
        ("ctl-tab\there", 7),
        ("ctl-cr\r", 6),
        ("ctl-nul\0", 7),
        ("ctl-del\u{7f}", 7),
        ("ctl-é\u{85}next", 6),
        ("ctl-csi\u{9b}", 7),
        ("\u{2028}ctl-line", 0),
        ("ctl-para\u{2029}", 8),
    ] {
        tags::push("ctl-good").unwrap();
        let e = tags::push(name).expect_err(name);
        assert!(matches!(e, gpupool::Error::InvalidValue(_)), "{name:?}: {e:?}");
        assert!(e.message().contains(&format!("at byte {at}")), "{name:?}: {e}");
        assert!(tags::id_of(name).is_none(), "{name:?} was interned");
        assert_eq!(tags::name_of(tags::current()).as_deref(), Some("ctl-good"), "{name:?} was pushed");
        tags::pop().unwrap();
    }
    assert!(tags::pop().is_err(), "each refused push left the stack as it was");
    tags::push("ctl-good").unwrap();
    assert!(tags::push(forged).is_err());
    let p = a.malloc(1000, 0, S).unwrap();
    tags::pop().unwrap();
    let report = a.live_report(0).unwrap();
    assert_eq!(report.lines().count(), 3, "{report}");
    assert!(report.contains(" in 1 block: tag ctl-good\n") && !report.contains("fake"), "{report}");
    a.free(p).unwrap();
    // Other characters outside ASCII are names like any other.
    tags::push("ctl-ünïcödé ✓ 名前").unwrap();
    tags::pop().unwrap();
    check(&a);
}

#[test]
fn out_of_memory_names_the_top_tags() {
    let (a, _drv) = sim(1, 64 * MIB);
    let mut held = Vec::new();
    for (name, size, n) in [("oom-a", 4 * MIB, 2), ("oom-b", 20 * MIB, 1), ("oom-c", MIB, 3), ("oom-d", 512, 1)] {
        tags::push(name).unwrap();
        for _ in 0..n {
            held.push(a.malloc(size, 0, S).unwrap());
        }
        tags::pop().unwrap();
    }
    let e = a.malloc(1 << 30, 0, S).unwrap_err().to_string();
    assert!(
        e.contains(
            " Tags holding the most allocated memory on this device: oom-b 20.00 MiB in 1 block, oom-a 8.00 MiB in 2 \
             blocks, oom-c 3.00 MiB in 3 blocks. If reserved"
        ),
        "{e}"
    );
    for p in held {
        a.free(p).unwrap();
    }
    check(&a);
}

/// Run by [`nothing_is_recorded_where_no_tag_was_pushed`] in a process of its own: no tag is
/// ever pushed there, so the flag stays down and nothing of tags is recorded.
#[test]
#[ignore = "run in a process of its own by nothing_is_recorded_where_no_tag_was_pushed"]
fn untagged_process() {
    assert!(!tags::in_use());
    let (a, _drv) = sim(1, 256 * MIB);
    a.record_history(Some(HistorySettings {
        max_entries: 100,
        context: HistoryContext::None,
        stacks: Default::default(),
    }))
    .unwrap();
    let ps: Vec<u64> = (0..10).map(|i| a.malloc(1000 * (i + 1), 0, S).unwrap()).collect();
    a.free(ps[0]).unwrap();
    assert!(a.all_tag_stats().is_empty());
    let snap = a.snapshot().unwrap();
    assert!(snap.segments.iter().flat_map(|g| &g.blocks).all(|b| b.frames.is_empty()));
    assert!(snap.device_traces[0].iter().all(|e| e.frames.is_empty()));
    let report = a.live_report(0).unwrap();
    assert!(report.contains(": no tag\n") && !report.contains("tag "), "{report}");
    assert!(tags::pop().is_err());
    assert!(!tags::in_use(), "a refused pop sets nothing");
    check(&a);
    println!("untagged process ok");
}

#[test]
fn nothing_is_recorded_where_no_tag_was_pushed() {
    let child = common::process::test_path(module_path!(), "untagged_process");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &child, "--ignored", "--nocapture", "--test-threads=1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("untagged process ok"), "{text}");
}
