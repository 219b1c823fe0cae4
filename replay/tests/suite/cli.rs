//! The command line, run as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TRACE: &str = "a 1 12582912 0\na 2 500000 7\na 3 3145728 0\nf 1\nf 2\nf 3\n";

fn trace_file(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, TRACE).unwrap();
    path
}

fn replay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpupool-replay")).args(args).output().expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn several_confs_give_several_rows() {
    let path = trace_file("cli-rows.txt");
    let out = replay(&[
        "--conf",
        "expandable_segments:False",
        "--conf=expandable_segments:False,max_split_size_mb:128",
        "--conf",
        "roundup_power2_divisions:4",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let confs: Vec<&str> = rows.iter().map(|r| r["configuration"].as_str().unwrap()).collect();
    // The defaults first, then each --conf in order.
    assert_eq!(
        confs,
        [
            "defaults",
            "expandable_segments:False",
            "expandable_segments:False,max_split_size_mb:128",
            "roundup_power2_divisions:4"
        ]
    );
    for r in &rows {
        assert_eq!(r["trace"], "cli-rows.txt");
        assert_eq!(r["driver"], "sim");
        assert_eq!(r["events"], 6);
        assert_eq!(r["streams"], 2);
        assert_eq!(r["peak_live_bytes"], 15 * 1048576 + 500_000);
        assert_eq!(r["capacity_bytes"], 80u64 << 30);
    }
    // Ordinary segments: 12 + 2 + 20 MiB (see peaks.rs), whatever max_split_size.
    for r in [&rows[1], &rows[2]] {
        assert_eq!(r["peak_reserved_bytes"], 34 * 1048576);
        assert_eq!(r["device_allocs"], 3);
    }
    // The defaults, expandable segments, map 2 MiB pages as needed: 12 MiB, then 2 MiB on the
    // second stream, then 4 MiB for the 3 MiB block.
    assert_eq!(rows[0]["peak_reserved_bytes"], 18 * 1048576);

    // CSV: a header, then the same rows.
    let out = replay(&["--csv", "--conf", "expandable_segments:False", "--capacity", "1GiB", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let csv = text(&out.stdout);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "{csv}");
    assert!(lines[0].starts_with("trace,configuration,driver,capacity_bytes,events"), "{csv}");
    assert!(lines[1].starts_with("cli-rows.txt,defaults,sim,1073741824,6,2,0,"), "{csv}");
    assert!(lines[2].starts_with("cli-rows.txt,expandable_segments:False,sim,1073741824,6,2,0,"), "{csv}");

    // No --conf: one row of the defaults; the table names its columns.
    let out = replay(&[path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert_eq!(table.lines().count(), 2, "{table}");
    assert!(table.starts_with("trace") && table.contains("reserved/live"), "{table}");
    assert!(table.lines().nth(1).unwrap().contains("defaults"), "{table}");
    assert!(table.contains("1.163"), "18 MiB over 15.48 MiB: {table}");
}

#[test]
fn no_defaults_leaves_the_defaults_out_and_an_empty_conf_is_the_defaults() {
    let path = trace_file("cli-defaults.txt");
    let path = path.to_str().unwrap();
    let confs = |args: &[&str]| -> Vec<String> {
        let out = replay(&[&["--json"], args, &[path]].concat());
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        rows.iter().map(|r| r["configuration"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(confs(&[]), ["defaults"]);
    assert_eq!(confs(&["--no-defaults", "--conf", "expandable_segments:True"]), ["expandable_segments:True"]);
    // '' names the defaults: replayed once, first.
    assert_eq!(confs(&["--conf", "expandable_segments:True", "--conf", ""]), ["defaults", "expandable_segments:True"]);
    assert_eq!(
        confs(&["--no-defaults", "--conf", "expandable_segments:True", "--conf="]),
        ["expandable_segments:True", "defaults"]
    );
    // Nothing left to replay.
    let out = replay(&["--no-defaults", path]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--no-defaults leaves nothing to replay"), "{}", text(&out.stderr));
}

#[test]
fn a_bad_conf_is_refused_with_status_2() {
    let path = trace_file("cli-bad.txt");
    let out = replay(&["--conf", "expandable_segments:Maybe", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("--conf \"expandable_segments:Maybe\""), "{err}");
    assert!(err.contains("expandable_segments:Maybe is not valid: expected True or False"), "{err}");
    assert!(out.stdout.is_empty());

    let out = replay(&["--conf", "no_such_key:1", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown key \"no_such_key\""), "{}", text(&out.stderr));

    for args in [
        &["--driver", "opencl"][..],
        &["--capacity", "lots"],
        &["--driver", "cuda", "--capacity", "1GiB"],
        &["--format", "xml"],
        &["--bogus"],
        &["--json=yes"],
        &[],
    ] {
        let mut all: Vec<&str> = args.to_vec();
        if !args.is_empty() {
            all.push(path.to_str().unwrap());
        }
        let out = replay(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("--help"), "{args:?}");
    }
    let out = replay(&["--help"]);
    assert!(out.status.success() && text(&out.stdout).starts_with("usage: gpupool-replay"));
}

#[test]
fn a_missing_file_fails_with_status_1() {
    let out = replay(&["/nonexistent/trace.txt"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("/nonexistent/trace.txt"), "{}", text(&out.stderr));
}

#[test]
fn driver_cuda_fails_cleanly_without_a_gpu() {
    let path = trace_file("cli-cuda.txt");
    let out = replay(&["--driver", "cuda", "--json", path.to_str().unwrap()]);
    match gpupool::driver::cuda::CudaDriver::new() {
        Err(e) => {
            assert_eq!(out.status.code(), Some(1));
            let err = text(&out.stderr);
            assert!(err.contains("--driver cuda: no GPU to replay on"), "{err}");
            assert!(err.contains(&e.to_string()), "{err}");
            assert!(out.stdout.is_empty());
        }
        // A machine with a GPU: the replay must work there.
        Ok(_) => {
            assert!(out.status.success(), "{}", text(&out.stderr));
            let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(rows[0]["driver"], "cuda");
            assert_eq!(rows[0]["peak_reserved_bytes"], 34 * 1048576);
        }
    }
}

#[test]
fn help_says_the_text_format_and_where_traces_are() {
    let out = replay(&["--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for says in ["'a ID SIZE STREAM'", "'f ID'", "SIZE bytes", "STREAM, an integer id", "replay/traces"] {
        assert!(help.contains(says), "--help does not say {says:?}:\n{help}");
    }
    assert!(!help.contains("shared/traces"), "users have no ../shared/traces:\n{help}");
    // The help fits a terminal of 100 columns.
    assert!(help.lines().all(|l| l.chars().count() <= 100), "{help}");
}

#[test]
fn version_prints_the_crates_version() {
    for flag in ["--version", "-V"] {
        let out = replay(&[flag]);
        assert!(out.status.success(), "{flag}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), format!("gpupool-replay {}\n", env!("CARGO_PKG_VERSION")));
    }
    let out = replay(&["--version=1"]);
    assert_eq!(out.status.code(), Some(2));
}
