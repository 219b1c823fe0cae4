//! The traces shipped in `replay/traces`, replayed by the command as a user runs it: gpupool
//! under PyTorch's defaults (`expandable_segments:False`) reserves what PyTorch 2.11 reserved
//! for the same allocations on the GPU (`replay/traces/README.md`), and gpupool's defaults
//! less.

use std::process::Command;

use serde_json::Value;

const MIB: u64 = 1 << 20;

/// The rows of `gpupool-replay --json ARGS replay/traces/NAME`.
fn rows(name: &str, args: &[&str]) -> Vec<Value> {
    let trace = format!("{}/traces/{name}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(env!("CARGO_BIN_EXE_gpupool-replay"))
        .arg("--json")
        .args(args)
        .arg(trace)
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn row<'a>(rows: &'a [Value], conf: &str) -> &'a Value {
    rows.iter().find(|r| r["configuration"] == conf).unwrap_or_else(|| panic!("no {conf} row: {rows:?}"))
}

#[test]
fn pipeline_streams_reserves_what_pytorch_did() {
    let all = rows("pipeline_streams.txt.gz", &["--conf", "expandable_segments:False"]);
    let pytorch = row(&all, "expandable_segments:False");
    assert_eq!(pytorch["trace"], "pipeline_streams.txt.gz");
    assert_eq!(pytorch["events"], 1957);
    // 106.8 MiB live at most; PyTorch reserved 176 MiB (1.65x).
    assert_eq!(pytorch["peak_live_bytes"].as_u64().unwrap() / (MIB / 10), 1068);
    assert_eq!(pytorch["peak_reserved_bytes"], 176 * MIB);
    let ratio = pytorch["reserved_over_live"].as_f64().unwrap();
    assert_eq!(format!("{ratio:.3}"), "1.648");
    assert_eq!(pytorch["ooms"], 0);
    // The defaults' expandable segments, in 2 MiB pages for blocks under 20 MiB, reserve less
    // (PyTorch's expandable segments, in 20 MiB pages, 148 MiB on an H200).
    assert_eq!(row(&all, "defaults")["peak_reserved_bytes"], 126 * MIB);
}

#[test]
fn vit_train_reads_as_its_readme_says() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/vit_train.txt.gz");
    let traces = gpupool_replay::input::load(std::path::Path::new(path), None).unwrap();
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0].events.len(), 57_549);
    assert!(traces[0].notes.is_empty(), "{:?}", traces[0].notes);
    // 4700.3 MiB live at most.
    assert_eq!(traces[0].peak_live() as u64 / (MIB / 10), 47003);
}
