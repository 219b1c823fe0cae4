//! A snapshot's own configuration (its `allocator_settings.PYTORCH_CUDA_ALLOC_CONF`) in the
//! report: the recorded row shows it, and a row replays it on gpupool after the defaults.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;

use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;
use gpupool::history::{HistoryContext, HistorySettings};
use serde_json::Value;

const MIB: usize = 1 << 20;

/// A snapshot that gpupool writes of a small program (12, 3 and 1 MiB on one stream) run under
/// `config` on a simulated device of 4 GiB; its configuration string names every key.
fn snapshot(name: &str, config: Config) -> PathBuf {
    let a = Allocator::new(Arc::new(SimDriver::new(1, 4096 * MIB)), config);
    a.record_history(Some(HistorySettings {
        max_entries: 1000,
        context: HistoryContext::None,
        stacks: Default::default(),
    }))
    .unwrap();
    let ptrs: Vec<u64> = [12 * MIB, 3 * MIB, MIB].iter().map(|&s| a.malloc(s, 0, 0x10).unwrap()).collect();
    for p in ptrs {
        a.free(p).unwrap();
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    a.snapshot().unwrap().write_pickle(&mut std::fs::File::create(&path).unwrap()).unwrap();
    path
}

fn replay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpupool-replay")).args(args).output().expect("the binary runs")
}

fn json_rows(args: &[&str]) -> (Vec<Value>, String) {
    let out = replay(&[&["--json", "--capacity", "4GiB"], args].concat());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (serde_json::from_slice(&out.stdout).unwrap(), err)
}

fn labels(rows: &[Value]) -> Vec<(String, String)> {
    rows.iter()
        .map(|r| (r["configuration"].as_str().unwrap().to_string(), r["driver"].as_str().unwrap().to_string()))
        .collect()
}

#[test]
fn the_recorded_configuration_is_replayed_after_the_defaults() {
    // PyTorch's defaults, every key named: ordinary segments.
    let config = Config::pytorch();
    let conf = config.conf_string();
    let path = snapshot("recorded-ordinary.pickle", config);
    let path = path.to_str().unwrap();
    let (rows, _) = json_rows(&["--conf", "max_split_size_mb:64", path]);
    let own = |s: &str| (conf.clone(), s.to_string());
    assert_eq!(
        labels(&rows),
        [own("recorded"), ("defaults".into(), "sim".into()), own("sim"), ("max_split_size_mb:64".into(), "sim".into())]
    );
    // gpupool under the recording's configuration reserves what the recording did: 12 MiB, a
    // 20 MiB segment for 3 MiB and a 2 MiB small one for 1 MiB.
    assert_eq!(rows[0]["peak_reserved_bytes"], 34 * MIB);
    assert_eq!(rows[2]["peak_reserved_bytes"], rows[0]["peak_reserved_bytes"]);
    // The defaults are gpupool's, not the recording's: expandable segments, 12 MiB, then
    // 2 MiB pages: 4 MiB for 3 MiB, 2 MiB (small pool) for 1 MiB.
    assert_eq!(rows[1]["peak_reserved_bytes"], 18 * MIB);

    // --no-defaults: only the --conf rows (and what PyTorch did).
    let (rows, _) = json_rows(&["--no-defaults", "--conf", "max_split_size_mb:64", path]);
    assert_eq!(labels(&rows), [own("recorded"), ("max_split_size_mb:64".into(), "sim".into())]);

    // The same configuration asked for by --conf: replayed once.
    let (rows, err) = json_rows(&["--conf", "expandable_segments:False", path]);
    assert_eq!(
        labels(&rows),
        [own("recorded"), ("defaults".into(), "sim".into()), ("expandable_segments:False".into(), "sim".into())]
    );
    assert!(err.contains("the recorded configuration is that of the row \"expandable_segments:False\""), "{err}");
}

#[test]
fn a_recording_under_the_defaults_has_no_row_of_its_own() {
    let path = snapshot("recorded-defaults.pickle", Config::default());
    let (rows, err) = json_rows(&[path.to_str().unwrap()]);
    assert_eq!(
        labels(&rows),
        [(Config::default().conf_string(), "recorded".into()), ("defaults".into(), "sim".into())]
    );
    assert!(err.contains("the recorded configuration is that of the row \"defaults\""), "{err}");
    assert_eq!(rows[0]["peak_reserved_bytes"], rows[1]["peak_reserved_bytes"]);
}

#[test]
fn the_recorded_row_names_what_the_snapshot_says() {
    use gpupool_replay::report::Row;
    use gpupool_replay::{Recorded, Trace};
    let row = |conf: Option<&str>| {
        let r = Recorded { peak_reserved: 0, device_allocs: 0, ooms: 0, conf: conf.map(String::from) };
        Row::recorded(&Trace::default(), &r).configuration
    };
    // An empty PYTORCH_CUDA_ALLOC_CONF: none was set, the recording ran with PyTorch's
    // defaults, which gpupool's differ from in this key.
    assert_eq!(row(Some("")), "expandable_segments:False");
    assert_eq!(row(None), "as recorded");
    assert_eq!(row(Some("expandable_segments:True")), "expandable_segments:True");
}

#[test]
fn the_table_names_long_configurations_and_spells_them_out_below() {
    let config = Config::pytorch();
    let conf = config.conf_string();
    assert!(conf.len() > 300, "{conf}");
    let path = snapshot("recorded-table.pickle", config);
    let long = "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.5";
    let out = replay(&["--capacity", "4GiB", "--conf", long, path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = String::from_utf8(out.stdout).unwrap();
    let (table, legend) = report.split_once("\n\n").expect("a legend below the table");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 5, "{report}");
    // The table's names: `recorded` for PyTorch's row and gpupool's under the same
    // configuration, `conf 1` for the long --conf.
    let conf_column: Vec<&str> = lines[1..].iter().map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(conf_column, ["recorded", "defaults", "recorded", "conf"], "{report}");
    assert!(lines[4].contains(" conf 1 "), "{report}");
    let header_width = lines[0].len();
    assert!(header_width < 200, "{header_width} columns: {report}");
    assert!(lines.iter().all(|l| l.len() <= header_width), "{report}");
    // The legend: each text once, in lines of at most 100 characters, that join back to it.
    assert!(legend.lines().all(|l| l.chars().count() <= 100), "{legend}");
    let (recorded, rest) = legend.split_once("\nconf 1: ").expect("conf 1 in the legend");
    assert_eq!(rest.trim_end(), long);
    let (name, text) = recorded.split_once(":\n").unwrap();
    assert_eq!(name, "recorded (the PYTORCH_CUDA_ALLOC_CONF of recorded-table.pickle)");
    assert_eq!(text.lines().map(str::trim).collect::<String>(), conf);

    // CSV and JSON keep the full strings (JSON: the first test).
    let out = replay(&["--csv", "--capacity", "4GiB", "--conf", long, path.to_str().unwrap()]);
    let csv = String::from_utf8(out.stdout).unwrap();
    assert!(csv.contains(&format!(",\"{long}\",sim,")), "{csv}");
    assert!(csv.contains(&format!(",\"{conf}\",recorded,")), "{csv}");
}

/// A Python value, for pickles written the way CPython writes them (protocol 2), by hand.
enum Py {
    S(&'static str),
    I(i32),
    B(bool),
    L(Vec<Py>),
    D(Vec<(&'static str, Py)>),
}

fn pickle_into(v: &Py, out: &mut Vec<u8>) {
    let text = |s: &str, out: &mut Vec<u8>| {
        out.push(b'X');
        out.extend((s.len() as u32).to_le_bytes());
        out.extend(s.as_bytes());
    };
    match v {
        Py::S(s) => text(s, out),
        Py::I(n) => {
            out.push(b'J');
            out.extend(n.to_le_bytes());
        }
        Py::B(b) => out.push(if *b { 0x88 } else { 0x89 }),
        Py::L(items) => {
            out.push(b']');
            for i in items {
                pickle_into(i, out);
                out.push(b'a');
            }
        }
        Py::D(items) => {
            out.push(b'}');
            for (k, v) in items {
                text(k, out);
                pickle_into(v, out);
                out.push(b's');
            }
        }
    }
}

/// A snapshot as PyTorch writes it, of one 2 MiB segment and a 512-byte block allocated and
/// freed in it, then the segment freed (`empty_cache`), whose `allocator_settings` hold `conf`
/// and `expandable`.
fn settings_snapshot(name: &str, conf: &'static str, expandable: bool) -> PathBuf {
    let event = |action: &'static str, size: i32| {
        Py::D(vec![("action", Py::S(action)), ("addr", Py::I(4096)), ("size", Py::I(size)), ("stream", Py::I(0))])
    };
    let root = Py::D(vec![
        ("segments", Py::L(vec![])),
        (
            "device_traces",
            Py::L(vec![Py::L(vec![
                event("segment_alloc", 2 << 20),
                event("alloc", 512),
                event("free_requested", 512),
                event("segment_free", 2 << 20),
            ])]),
        ),
        (
            "allocator_settings",
            Py::D(vec![("PYTORCH_CUDA_ALLOC_CONF", Py::S(conf)), ("expandable_segments", Py::B(expandable))]),
        ),
    ]);
    let mut bytes = vec![0x80, 2];
    pickle_into(&root, &mut bytes);
    bytes.push(b'.');
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn the_recorded_text_is_trimmed_on_both_rows_and_completed_by_the_settings() {
    // Spaces around the text: PyTorch's row and gpupool's replay of it carry the same label,
    // so the table pairs them.
    let path = settings_snapshot("recorded-padded.pickle", " max_split_size_mb:128 ", false);
    let (rows, _) = json_rows(&[path.to_str().unwrap()]);
    let text = "max_split_size_mb:128".to_string();
    assert_eq!(
        labels(&rows),
        [(text.clone(), "recorded".into()), ("defaults".into(), "sim".into()), (text, "sim".into())]
    );
    // An empty text, while the settings say the segments were expandable (PyTorch keeps the
    // last string set, which need not name a key an earlier one set): the recording ran
    // expandable segments, as gpupool's defaults do.
    let path = settings_snapshot("recorded-empty-expandable.pickle", "", true);
    let (rows, err) = json_rows(&[path.to_str().unwrap()]);
    assert_eq!(
        labels(&rows),
        [("expandable_segments:True".into(), "recorded".into()), ("defaults".into(), "sim".into())]
    );
    assert!(err.contains("the recorded configuration is that of the row \"defaults\""), "{err}");
    // The same text with the settings' false: PyTorch's defaults, a row of their own.
    let path = settings_snapshot("recorded-empty.pickle", "", false);
    let (rows, _) = json_rows(&[path.to_str().unwrap()]);
    let pytorch = "expandable_segments:False".to_string();
    assert_eq!(
        labels(&rows),
        [(pytorch.clone(), "recorded".into()), ("defaults".into(), "sim".into()), (pytorch, "sim".into())]
    );
}
