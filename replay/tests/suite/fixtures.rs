//! Snapshots PyTorch itself wrote (replay/tests/fixtures, recorded on an H100 with PyTorch 2.11
//! by examples/python/record_snapshots.py): every one replays, and the `recorded` row gives the
//! peak reserved bytes `torch.cuda.max_memory_reserved()` reported in the same run.
use std::path::Path;
use std::process::Command;

#[test]
fn every_pytorch_fixture_replays_and_its_recorded_row_is_pytorchs_peak() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".pickle.gz") else { continue };
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{stem}.json"))).unwrap()).unwrap();
        let want = meta["max_memory_reserved"].as_u64().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_gpupool-replay")).arg("--csv").arg(&path).output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let csv = String::from_utf8(out.stdout).unwrap();
        let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
        let col = header.iter().position(|h| *h == "peak_reserved_bytes").unwrap();
        let recorded = csv
            .lines()
            .find(|l| l.split(',').nth(2) == Some("recorded"))
            .unwrap_or_else(|| panic!("{name}: no recorded row in\n{csv}"));
        let got: u64 = recorded.split(',').nth(col).unwrap().parse().unwrap();
        assert_eq!(got, want, "{name}: recorded peak reserved against torch.cuda.max_memory_reserved()");
        assert!(csv.lines().any(|l| l.split(',').nth(2) == Some("sim")), "{name}: no replayed row");
        seen += 1;
    }
    assert_eq!(seen, 8, "the eight fixtures of record_snapshots.py");
}
