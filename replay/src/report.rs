//! The report: one row per trace and configuration (and one for what PyTorch itself did, when
//! a snapshot says), as a table for people or as JSON or CSV for scripts.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::run::Outcome;
use crate::trace::{Recorded, Trace};

/// One line of the report. Sizes are bytes; `None` where the row has no such figure (the
/// recorded row has no timings, for instance); JSON writes it as `null`, CSV as an empty field.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The trace's name (file, and device for a snapshot of several).
    pub trace: String,
    /// The configuration as given to `--conf` (`GPUPOOL_CONF`'s syntax), `defaults` for
    /// gpupool's defaults; for the recorded row, the recording's `PYTORCH_CUDA_ALLOC_CONF` when
    /// the snapshot has it (`defaults` when it is empty, `as recorded` when the snapshot does
    /// not say), and the row replaying that configuration on gpupool has the same text.
    pub configuration: String,
    /// `sim` (the simulated device), `cuda` (the GPU), or `recorded` (PyTorch's own allocator,
    /// as the snapshot's segment events show it).
    pub driver: String,
    /// The simulated device's memory; `None` on the GPU and for the recorded row.
    pub capacity_bytes: Option<usize>,
    /// Events replayed (allocations and frees, those of the blocks alive before the trace
    /// included).
    pub events: usize,
    /// Streams of the trace.
    pub streams: usize,
    /// Blocks alive before the trace began, allocated by its first events.
    pub initial_blocks: u32,
    /// The most bytes the program held at once (requested sizes, before rounding).
    pub peak_live_bytes: usize,
    /// The most bytes reserved from the driver at once (the cold pass's, for a replay).
    pub peak_reserved_bytes: usize,
    /// `peak_reserved_bytes / peak_live_bytes`: 1.00 is the floor; `None` for a trace that
    /// holds nothing.
    pub reserved_over_live: Option<f64>,
    /// The most bytes reserved over both passes.
    pub peak_reserved_warm_bytes: Option<usize>,
    /// The most bytes allocated at once (sizes rounded by the allocator's rules).
    pub peak_allocated_bytes: Option<usize>,
    /// The most segments at once.
    pub peak_segments: Option<i64>,
    /// Driver allocations (`num_device_alloc`) during the cold pass; for the recorded row, the
    /// window's `segment_alloc` and `segment_map` events.
    pub device_allocs: u64,
    /// Driver allocations during the warm pass.
    pub device_allocs_warm: Option<u64>,
    /// Cache releases and retries (`num_alloc_retries`) over both passes.
    pub alloc_retries: Option<u64>,
    /// Allocations that ran out of memory: the cold pass's; for the recorded row, the window's
    /// `oom` events.
    pub ooms: u64,
    /// Allocations that ran out of memory in the warm pass.
    pub ooms_warm: Option<u64>,
    /// Calls that locked every stream to settle gpupool's exact peaks, warm pass.
    pub peak_settles_warm: Option<i64>,
    /// Nanoseconds per event, cold pass (with the driver's calls).
    pub cold_ns_per_event: Option<f64>,
    /// Nanoseconds per event, warm pass.
    pub warm_ns_per_event: Option<f64>,
}

fn ratio(reserved: usize, live: usize) -> Option<f64> {
    (live > 0).then(|| reserved as f64 / live as f64)
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl Row {
    /// The row of a replay of `trace` under `configuration` on `driver`.
    pub fn replayed(trace: &Trace, configuration: &str, driver: &str, capacity: Option<usize>, o: &Outcome) -> Row {
        let live = trace.peak_live();
        Row {
            trace: trace.name.clone(),
            configuration: configuration.to_string(),
            driver: driver.to_string(),
            capacity_bytes: capacity,
            events: trace.events.len(),
            streams: trace.streams.len(),
            initial_blocks: trace.initial_blocks,
            peak_live_bytes: live,
            peak_reserved_bytes: o.peak_reserved,
            reserved_over_live: ratio(o.peak_reserved, live),
            peak_reserved_warm_bytes: Some(o.peak_reserved_warm),
            peak_allocated_bytes: Some(o.peak_allocated),
            peak_segments: Some(o.peak_segments),
            device_allocs: count(o.device_allocs),
            device_allocs_warm: Some(count(o.device_allocs_warm)),
            alloc_retries: Some(count(o.alloc_retries)),
            ooms: o.ooms,
            ooms_warm: Some(o.ooms_warm),
            peak_settles_warm: Some(o.peak_settles_warm),
            cold_ns_per_event: Some(o.cold_ns_per_event),
            warm_ns_per_event: Some(o.warm_ns_per_event),
        }
    }

    /// The row of what the allocator that recorded `trace` did.
    pub fn recorded(trace: &Trace, r: &Recorded) -> Row {
        let live = trace.peak_live();
        Row {
            trace: trace.name.clone(),
            configuration: match r.conf.as_deref() {
                None => "as recorded".into(),
                Some(c) if c.trim().is_empty() => "defaults".into(),
                Some(c) => c.to_string(),
            },
            driver: "recorded".into(),
            capacity_bytes: None,
            events: trace.events.len(),
            streams: trace.streams.len(),
            initial_blocks: trace.initial_blocks,
            peak_live_bytes: live,
            peak_reserved_bytes: r.peak_reserved,
            reserved_over_live: ratio(r.peak_reserved, live),
            peak_reserved_warm_bytes: None,
            peak_allocated_bytes: None,
            peak_segments: None,
            device_allocs: r.device_allocs,
            device_allocs_warm: None,
            alloc_retries: None,
            ooms: r.ooms,
            ooms_warm: None,
            peak_settles_warm: None,
            cold_ns_per_event: None,
            warm_ns_per_event: None,
        }
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

fn or_dash<T>(v: Option<T>, f: impl FnOnce(T) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

/// A configuration longer than this many characters is named by a label in the table and
/// printed in full below it: a snapshot's configuration string, which names every key, would
/// make every line of the table hundreds of columns wide.
const CONF_WIDTH: usize = 32;

/// The legend's lines are cut (at commas) to this many characters.
const LEGEND_WIDTH: usize = 100;

/// The name each configuration of `rows` takes in the table, and the legend that gives each
/// name's full text: a snapshot's recorded configuration is `recorded` (`recorded 1`,
/// `recorded 2`... when the traces recorded several), whatever its length, so that the row of
/// PyTorch under it and the row of gpupool replaying it read as one configuration; any other
/// configuration longer than [`CONF_WIDTH`] characters is `conf 1`, `conf 2`...
fn conf_labels(rows: &[Row]) -> (HashMap<&str, String>, Vec<String>) {
    let mut recorded: Vec<(&str, &str)> = Vec::new();
    for r in rows.iter().filter(|r| r.driver == "recorded") {
        let c = r.configuration.as_str();
        if !matches!(c, "defaults" | "as recorded") && !recorded.iter().any(|&(k, _)| k == c) {
            recorded.push((c, &r.trace));
        }
    }
    let (mut labels, mut legend) = (HashMap::new(), Vec::new());
    for (i, &(conf, trace)) in recorded.iter().enumerate() {
        let label = if recorded.len() == 1 { "recorded".to_string() } else { format!("recorded {}", i + 1) };
        legend_entry(&mut legend, &format!("{label} (the PYTORCH_CUDA_ALLOC_CONF of {trace})"), conf);
        labels.insert(conf, label);
    }
    let mut long = 0;
    for r in rows {
        let c = r.configuration.as_str();
        if c.chars().count() > CONF_WIDTH && !labels.contains_key(c) {
            long += 1;
            let label = format!("conf {long}");
            legend_entry(&mut legend, &label, c);
            labels.insert(c, label);
        }
    }
    (labels, legend)
}

/// Adds `name: text` to `legend`: on one line where it fits in [`LEGEND_WIDTH`], else the name
/// on a line and the text below it, indented, cut after commas.
fn legend_entry(legend: &mut Vec<String>, name: &str, text: &str) {
    if name.chars().count() + 2 + text.chars().count() <= LEGEND_WIDTH {
        legend.push(format!("{name}: {text}"));
        return;
    }
    legend.push(format!("{name}:"));
    let mut line = String::from("  ");
    for piece in text.split_inclusive(',') {
        if line.chars().count() + piece.chars().count() > LEGEND_WIDTH && line.len() > 2 {
            legend.push(std::mem::replace(&mut line, String::from("  ")));
        }
        line.push_str(piece);
    }
    legend.push(line);
}

/// The rows as a table with aligned columns, sizes in MiB, one line each; a configuration too
/// long for its column, or recorded by a snapshot, is named by a label that a legend below the
/// table spells out ([`conf_labels`]).
pub fn table(rows: &[Row]) -> String {
    let (labels, legend) = conf_labels(rows);
    let header = [
        "trace",
        "configuration",
        "driver",
        "events",
        "peak live MiB",
        "peak reserved MiB",
        "reserved/live",
        "driver allocs",
        "retries",
        "OOMs",
        "cold ns/event",
        "warm ns/event",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.trace.clone(),
                labels.get(r.configuration.as_str()).unwrap_or(&r.configuration).clone(),
                r.driver.clone(),
                r.events.to_string(),
                mib(r.peak_live_bytes),
                mib(r.peak_reserved_bytes),
                or_dash(r.reserved_over_live, |x| format!("{x:.3}")),
                r.device_allocs.to_string(),
                or_dash(r.alloc_retries, |x| x.to_string()),
                r.ooms.to_string(),
                or_dash(r.cold_ns_per_event, |x| format!("{x:.0}")),
                or_dash(r.warm_ns_per_event, |x| format!("{x:.0}")),
            ]
        })
        .collect();
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |fields: &[String]| {
        let mut s = String::new();
        for (i, (f, w)) in fields.iter().zip(&width).enumerate() {
            // Names to the left, figures to the right.
            if i < 3 {
                let _ = write!(s, "{f:<w$}  ");
            } else {
                let _ = write!(s, "{f:>w$}  ");
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&header.map(String::from));
    for row in &cells {
        line(row);
    }
    if !legend.is_empty() {
        out.push('\n');
        for l in legend {
            out.push_str(&l);
            out.push('\n');
        }
    }
    out
}

/// The rows as a JSON array of objects, one per row, with the fields of [`Row`].
pub fn json(rows: &[Row]) -> String {
    let mut s = serde_json::to_string_pretty(rows).expect("rows serialise");
    s.push('\n');
    s
}

/// The rows as CSV: a header of [`Row`]'s field names, then one line per row; strings quoted
/// where they hold a comma or a quote.
pub fn csv(rows: &[Row]) -> String {
    let mut out = String::new();
    let values: Vec<serde_json::Map<String, serde_json::Value>> = rows
        .iter()
        .map(|r| match serde_json::to_value(r).expect("rows serialise") {
            serde_json::Value::Object(m) => m,
            _ => unreachable!("a struct serialises as an object"),
        })
        .collect();
    let Some(first) = values.first() else {
        return out;
    };
    let keys: Vec<&String> = first.keys().collect();
    out.push_str(&keys.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(","));
    out.push('\n');
    for m in &values {
        let fields: Vec<String> = keys
            .iter()
            .map(|k| match &m[k.as_str()] {
                serde_json::Value::Null => String::new(),
                serde_json::Value::String(s) if s.contains([',', '"', '\n']) => {
                    format!("\"{}\"", s.replace('"', "\"\""))
                }
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            })
            .collect();
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}
