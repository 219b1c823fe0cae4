//! The replay as a prediction: `--capacity` says whether and where a trace runs out of memory on
//! a device of that size, `--suggest` which configuration to use, and `--row` sets any of
//! gpupool's variables for a row. On a trace whose answer is known by construction.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const MIB: usize = 1 << 20;

/// 100 blocks of 2 MiB (ten to each 20 MiB segment under PyTorch's defaults, ordinary
/// segments: 200 MiB), then all but the first of each ten freed (each segment keeps a 2 MiB
/// block at its start and 18 MiB free after it), then 19 MiB. With ordinary segments no
/// segment has 19 MiB free in one piece, the cache has no whole free segment to release, and
/// a device of 200 MiB has no room for a new one: out of memory, at event 190. Expandable
/// segments (gpupool's defaults) unmap the free pages of their range on the release and map
/// the 19 MiB at its end: the trace fits.
fn fragmenting_trace() -> PathBuf {
    let mut t = String::new();
    for i in 0..100 {
        t += &format!("a {i} {} 0\n", 2 * MIB);
    }
    for i in (0..100).filter(|i| i % 10 != 0) {
        t += &format!("f {i}\n");
    }
    t += &format!("a 1000 {} 0\n", 19 * MIB);
    // Written aside and renamed into place: the tests run at once, and a reader must never see
    // the file half written by another test.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("fragmenting.txt");
    let aside = dir.join(format!("fragmenting.txt.{:?}", std::thread::current().id()));
    std::fs::write(&aside, t).unwrap();
    std::fs::rename(&aside, &path).unwrap();
    path
}

fn replay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpupool-replay")).args(args).output().expect("the binary runs")
}

fn json(args: &[&str]) -> (Vec<Value>, String) {
    let out = replay(&[&["--json"], args].concat());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (serde_json::from_slice(&out.stdout).unwrap(), err)
}

fn row<'a>(rows: &'a [Value], conf: &str) -> &'a Value {
    rows.iter().find(|r| r["configuration"] == conf).unwrap_or_else(|| panic!("no row {conf}: {rows:#?}"))
}

#[test]
fn capacity_says_where_the_trace_runs_out_of_memory() {
    let path = fragmenting_trace();
    let path = path.to_str().unwrap();
    let ordinary = ["--no-defaults", "--conf", "expandable_segments:False"];
    let (rows, _) = json(&["--capacity", "200MiB", "--conf", "expandable_segments:False", path]);
    let pytorch = row(&rows, "expandable_segments:False");
    assert_eq!(pytorch["ooms"], 1);
    assert_eq!(pytorch["first_oom_event"], 190);
    assert_eq!(pytorch["first_oom_bytes"], 19 * MIB);
    assert_eq!(pytorch["environment"], "GPUPOOL_CONF=expandable_segments:False");
    // The defaults' expandable segments fit.
    let defaults = row(&rows, "defaults");
    assert_eq!((&defaults["ooms"], &defaults["ooms_warm"]), (&0.into(), &0.into()));
    assert_eq!(defaults["first_oom_event"], Value::Null);
    assert_eq!(defaults["environment"], "");
    // A device of 256 MiB has room for the new segment.
    let (rows, _) = json(&[&["--capacity", "256MiB"], &ordinary[..], &[path]].concat());
    assert_eq!(rows[0]["ooms"], 0);
    assert_eq!(rows[0]["first_oom_event"], Value::Null);

    // The table names the first one, the CSV has it.
    let out = replay(&[&["--capacity", "200MiB"], &ordinary[..], &[path]].concat());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.lines().next().unwrap().contains("first OOM"), "{table}");
    assert!(table.contains("event 190: 19.0 MiB"), "{table}");
    let out = replay(&[&["--csv", "--capacity", "200MiB"], &ordinary[..], &[path]].concat());
    let csv = String::from_utf8(out.stdout).unwrap();
    let (header, line) = csv.split_once('\n').unwrap();
    let at = header.split(',').position(|h| h == "first_oom_event").expect("the column");
    assert_eq!(line.split(',').nth(at), Some("190"), "{csv}");
}

#[test]
fn suggest_picks_a_configuration_that_fits() {
    let path = fragmenting_trace();
    let (rows, err) = json(&["--capacity", "200MiB", "--suggest", path.to_str().unwrap()]);
    // The defaults, then the grid.
    assert_eq!(rows.len(), 1 + gpupool_replay::setting::GRID.len(), "{rows:#?}");
    assert_eq!(rows[0]["configuration"], "defaults");
    let suggested: Vec<&Value> = rows.iter().filter(|r| r["suggested"] == true).collect();
    assert_eq!(suggested.len(), 1, "{rows:#?}");
    let s = suggested[0];
    // Only expandable segments fit here: which of those is the fastest is the machine's.
    assert!(!s["configuration"].as_str().unwrap().contains("expandable_segments:False"), "{s:#?}");
    assert_eq!((&s["ooms"], &s["ooms_warm"]), (&0.into(), &0.into()));
    assert_eq!(row(&rows, "expandable_segments:False")["first_oom_event"], 190);
    assert!(
        err.contains(&format!(
            "suggested for fragmenting.txt, of 12 configurations: {}",
            s["configuration"].as_str().unwrap()
        )),
        "{err}"
    );
    assert!(err.contains("(the defaults: ") && !err.contains("out of memory)"), "{err}");
    match s["environment"].as_str().unwrap() {
        "" => assert!(err.contains("  gpupool: nothing to set (the defaults)\n"), "{err}"),
        env => assert!(err.contains(&format!("  gpupool: {env}\n")), "{err}"),
    }
    // The garbage collection rows leave 1% of the device out: their tenth segment does not fit.
    let gc = row(&rows, "expandable_segments:False,garbage_collection_threshold:0.8,per_process_memory_fraction:0.99");
    assert_eq!(gc["first_oom_event"], 90);

    // The table says it below the legend; a trace that fits everywhere gets a suggestion
    // too, with the command line of PyTorch when it uses only PyTorch's keys.
    let out = replay(&["--suggest", "--conf", "expandable_segments:False", path.to_str().unwrap()]);
    let report = String::from_utf8(out.stdout).unwrap();
    let tail = report.rsplit_once("\n\n").unwrap().1;
    assert!(tail.starts_with("suggested for fragmenting.txt, of 12 configurations: "), "{report}");
    assert!(tail.contains("  gpupool: "), "{report}");
    // Nothing fits a device of 100 MiB.
    let (_, err) = json(&["--capacity", "100MiB", "--suggest", path.to_str().unwrap()]);
    assert!(
        err.contains("suggested for fragmenting.txt: none: each of the 12 configurations tried ran out of memory"),
        "{err}"
    );
}

#[test]
fn a_row_sets_any_of_gpupools_variables() {
    let path = fragmenting_trace();
    let path = path.to_str().unwrap();
    let (rows, _) = json(&[
        "--capacity",
        "200MiB",
        "--no-defaults",
        "--row",
        "GPUPOOL_CONF=expandable_segments:True",
        "--row",
        " GPUPOOL_EXPANDABLE_RECLAIM=1 ; GPUPOOL_CONF=expandable_segments:True ",
        path,
    ]);
    assert_eq!(rows[0]["configuration"], "expandable_segments:True");
    assert_eq!(rows[1]["configuration"], "expandable_segments:True + GPUPOOL_EXPANDABLE_RECLAIM=1");
    assert_eq!(rows[1]["environment"], "GPUPOOL_CONF=expandable_segments:True GPUPOOL_EXPANDABLE_RECLAIM=1");
    // The high-water rule unmaps free pages before growing past the peak: the 19 MiB needs no
    // release-and-retry then.
    assert_eq!(rows[0]["alloc_retries"], 2);
    assert_eq!(rows[1]["alloc_retries"], 0);

    for (row, says) in [
        ("GPUPOOL_CONF", "is not NAME=VALUE"),
        ("GPUPOOL_NO_SUCH=1", "\"GPUPOOL_NO_SUCH\" is not one of gpupool's variables (GPUPOOL_CONF, "),
        ("GPUPOOL_SIM_CAPACITY=1GiB", "GPUPOOL_SIM_CAPACITY chooses the device, which --driver and --capacity do"),
        ("GPUPOOL_EXPANDABLE_RECLAIM=maybe", "GPUPOOL_EXPANDABLE_RECLAIM"),
        ("GPUPOOL_CONF=a:1;GPUPOOL_CONF=b:2", "GPUPOOL_CONF is given twice"),
        ("GPUPOOL_CONF=expandable_segments:Maybe", "expandable_segments:Maybe is not valid"),
    ] {
        let out = replay(&["--row", row, path]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{row}: {err}");
        assert!(err.contains(&format!("--row {row:?}: ")) && err.contains(says), "{row}: {err}");
    }
}
