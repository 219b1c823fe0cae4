//! The report as a table for people: aligned columns, sizes in MiB, long configurations
//! named by a label and spelled out in a legend below.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::report::Row;

pub(crate) fn mib(bytes: usize) -> String {
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
/// table spells out (`conf_labels`).
pub fn table(rows: &[Row]) -> String {
    let (labels, legend) = conf_labels(rows);
    let oom_column = rows.iter().any(|r| r.first_oom_event.is_some());
    let mut header = vec![
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
    if oom_column {
        header.insert(10, "first OOM (cold)");
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut cells = vec![
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
            ];
            if oom_column {
                let first = r.first_oom_event.zip(r.first_oom_bytes);
                cells.insert(10, or_dash(first, |(e, b)| format!("event {e}: {} MiB", mib(b))));
            }
            cells
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
    line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>());
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
