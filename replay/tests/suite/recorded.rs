//! Snapshots recorded by PyTorch itself (`replay/tests/fixtures/mlp/*.pickle.gz`, written by
//! `fixtures/mlp/record.py` on a GPU), each read and checked against what PyTorch's own statistics
//! said of the same run (`NAME.json` beside it): the allocations, the peak of the bytes
//! requested, and the peak reserved, which the recorded row must find from the segment events
//! (and which gpupool's replay under the defaults reserves too, for a recording under them).

use std::path::Path;

use gpupool::config::Config;
use gpupool_replay::input::load;
use gpupool_replay::run::replay_sim;

fn fixtures() -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlp");
    let mut found: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_str().is_some_and(|s| s.ends_with(".pickle.gz")))
        .collect();
    found.sort();
    found
}

#[test]
fn each_fixture_reads_as_pytorch_counted_it() {
    let mut checked = 0;
    for path in fixtures() {
        let name = path.to_str().unwrap();
        let json = path.with_extension("").with_extension("json");
        let expect: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e} (record.py writes it)", json.display())),
        )
        .unwrap();
        let traces = load(&path, Some(0)).unwrap_or_else(|e| panic!("{e}"));
        let t = &traces[0];
        assert_eq!(t.initial_blocks, 0, "{name}: the history began before the first allocation");
        assert_eq!(t.allocations() as u64, expect["allocs"].as_u64().unwrap(), "{name}");
        assert_eq!(t.streams.len() as u64, expect["streams"].as_u64().unwrap(), "{name}");
        assert_eq!(t.peak_live() as u64, expect["peak_live_bytes"].as_u64().unwrap(), "{name}");
        let r = t.recorded.as_ref().expect("a snapshot has a recorded row");
        assert_eq!(r.peak_reserved as u64, expect["peak_reserved_bytes"].as_u64().unwrap(), "{name}");
        assert_eq!(r.device_allocs, expect["device_allocs"].as_u64().unwrap(), "{name}");
        assert_eq!(r.conf.as_deref(), expect["conf"].as_str(), "{name}");
        // Under PyTorch's defaults, gpupool reserves what PyTorch did.
        if r.conf.as_deref() == Some("") {
            let o = replay_sim(t, &Config::pytorch(), 80 << 30).unwrap();
            assert_eq!(o.peak_reserved as u64, expect["peak_reserved_bytes"].as_u64().unwrap(), "{name}");
            assert_eq!(o.device_allocs as u64, expect["device_allocs"].as_u64().unwrap(), "{name}");
        }
        checked += 1;
    }
    // The three recorded with PyTorch 2.11 on an H100 (README.md), and any added since.
    assert!(checked >= 3, "{checked} fixtures");
}
