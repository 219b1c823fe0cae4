//! `--suggest`'s rule, on rows whose figures are set by hand: of the configurations that never
//! ran out of memory, the least peak reserved among those whose warm pass is within 10% of the
//! fastest's; ties to fewer driver allocations, then to the row first.

use gpupool_replay::report::Row;
use gpupool_replay::run::Outcome;
use gpupool_replay::setting::Setting;
use gpupool_replay::suggest::{choose, mark};
use gpupool_replay::{Recorded, Trace};

fn row(trace: &str, conf: &str, reserved: usize, warm_ns: f64, ooms: u64) -> Row {
    let t = Trace { name: trace.into(), ..Trace::default() };
    let o = Outcome {
        peak_reserved: reserved,
        peak_reserved_warm: reserved,
        peak_allocated: 0,
        peak_segments: 0,
        device_allocs: 1,
        device_allocs_warm: 0,
        alloc_retries: 0,
        ooms,
        ooms_warm: 0,
        first_oom: None,
        peak_settles_warm: 0,
        cold_ns_per_event: 0.0,
        warm_ns_per_event: warm_ns,
    };
    let setting = if conf == "defaults" { Setting::defaults() } else { Setting::conf(conf).unwrap() };
    Row::replayed(&t, &setting, "sim", Some(1 << 30), &o)
}

#[test]
fn the_least_reserved_within_ten_percent_of_the_fastest() {
    let rows = vec![
        row("t", "defaults", 300, 100.0, 0),
        // The least reserved, but 11% slower than the fastest.
        row("t", "expandable_segments:True", 100, 111.0, 0),
        // Less than the defaults, and 10% slower: in.
        row("t", "max_split_size_mb:128", 200, 110.0, 0),
        // Less still, and fast, but out of memory.
        row("t", "roundup_power2_divisions:4", 50, 90.0, 1),
    ];
    assert_eq!(choose(&rows, "t"), Some(2));
    assert_eq!(choose(&rows, "other"), None);
    // A tie in bytes goes to fewer driver allocations, then to the first row.
    let mut tie = vec![row("t", "defaults", 200, 100.0, 0), row("t", "max_split_size_mb:128", 200, 100.0, 0)];
    assert_eq!(choose(&tie, "t"), Some(0));
    tie[0].device_allocs = 2;
    assert_eq!(choose(&tie, "t"), Some(1));
}

#[test]
fn each_trace_gets_its_own_and_the_recorded_row_is_never_chosen() {
    let recorded = Recorded { peak_reserved: 1, device_allocs: 0, ooms: 0, conf: Some(String::new()) };
    let mut rows = vec![
        Row::recorded(&Trace { name: "a".into(), ..Trace::default() }, &recorded),
        row("a", "defaults", 300, 100.0, 0),
        row("a", "expandable_segments:True", 200, 105.0, 0),
        row("b", "defaults", 300, 100.0, 1),
        row("b", "expandable_segments:True", 200, 500.0, 1),
    ];
    let said = mark(&mut rows);
    let marked: Vec<bool> = rows.iter().map(|r| r.suggested).collect();
    assert_eq!(marked, [false, false, true, false, false]);
    assert!(said.contains("suggested for a, of 2 configurations: expandable_segments:True\n"), "{said}");
    assert!(said.contains("  gpupool: GPUPOOL_CONF=expandable_segments:True\n"), "{said}");
    assert!(said.contains("  PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n"), "{said}");
    assert!(said.contains("suggested for b: none: each of the 2 configurations tried ran out of memory"), "{said}");
}
