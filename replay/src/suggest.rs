//! `--suggest`: of the configurations a trace was replayed under, the one to use. Those that
//! ran out of memory in either pass are out; of the rest, the one with the least peak
//! reserved (over both passes) among those whose warm pass is within [`SLOWER_AT_MOST`] of the
//! fastest's; ties go to fewer driver allocations, then to the row that came first (the
//! defaults, then the simpler).

use std::fmt::Write as _;

use crate::report::Row;
use crate::table::mib;

/// How much slower than the fastest a configuration's warm pass may be: 10%.
pub const SLOWER_AT_MOST: f64 = 1.10;

/// The index in `rows` of the configuration to suggest for `trace`, among its replayed rows
/// (not the recorded one); None when every one ran out of memory.
pub fn choose(rows: &[Row], trace: &str) -> Option<usize> {
    let fits = |r: &Row| r.trace == trace && r.driver != "recorded" && r.ooms == 0 && r.ooms_warm == Some(0);
    let warm = |r: &Row| r.warm_ns_per_event.unwrap_or(f64::INFINITY);
    let fastest = rows.iter().filter(|r| fits(r)).map(warm).fold(f64::INFINITY, f64::min);
    rows.iter()
        .enumerate()
        .filter(|(_, r)| fits(r) && warm(r) <= fastest * SLOWER_AT_MOST)
        .min_by_key(|(i, r)| (r.peak_reserved_warm_bytes.unwrap_or(r.peak_reserved_bytes), r.device_allocs, *i))
        .map(|(i, _)| i)
}

/// Marks the suggested row of each trace of `rows`; returns what to tell the user, a paragraph
/// per trace: the configuration, its figures against the defaults' and the fastest's, and the
/// environment that sets it for gpupool (and for PyTorch, when it uses only PyTorch's keys).
pub fn mark(rows: &mut [Row]) -> String {
    let mut traces: Vec<String> = Vec::new();
    for r in rows.iter() {
        if !traces.contains(&r.trace) {
            traces.push(r.trace.clone());
        }
    }
    let mut out = String::new();
    for t in &traces {
        let tried = rows.iter().filter(|r| &r.trace == t && r.driver != "recorded").count();
        let Some(i) = choose(rows, t) else {
            let _ =
                writeln!(out, "suggested for {t}: none: each of the {tried} configurations tried ran out of memory");
            continue;
        };
        rows[i].suggested = true;
        let r = &rows[i];
        let reserved = |r: &Row| r.peak_reserved_warm_bytes.unwrap_or(r.peak_reserved_bytes);
        let _ = writeln!(out, "suggested for {t}, of {tried} configurations: {}", r.configuration);
        let mut figures = format!("  peak reserved {} MiB", mib(reserved(r)));
        if let Some(d) = rows.iter().find(|d| &d.trace == t && d.driver != "recorded" && d.configuration == "defaults")
        {
            let oom = if d.ooms > 0 || d.ooms_warm.unwrap_or(0) > 0 { ", out of memory" } else { "" };
            let _ = write!(figures, " (the defaults: {} MiB{oom})", mib(reserved(d)));
        }
        let fastest = rows
            .iter()
            .filter(|f| &f.trace == t && f.driver != "recorded" && f.ooms == 0 && f.ooms_warm == Some(0))
            .filter_map(|f| f.warm_ns_per_event)
            .fold(f64::INFINITY, f64::min);
        let _ = writeln!(
            out,
            "{figures}; warm pass {:.0} ns/event (the fastest that fits: {fastest:.0})",
            r.warm_ns_per_event.unwrap_or(0.0)
        );
        let env = r.environment.as_deref().unwrap_or("");
        if env.is_empty() {
            let _ = writeln!(out, "  gpupool: nothing to set (the defaults)");
        } else {
            let _ = writeln!(out, "  gpupool: {env}");
        }
        if let Some(py) = pytorch(env) {
            let _ = writeln!(out, "  PyTorch: {py}");
        }
    }
    out
}

/// The PyTorch environment of a gpupool environment that sets at most `GPUPOOL_CONF`: the
/// same keys, with `expandable_segments:True` first unless they name it, since gpupool's
/// segments are expandable by default and PyTorch's are not. The same rules but for the page
/// size of expandable segments: PyTorch maps 20 MiB pages in its large pool where gpupool maps
/// 2 MiB pages for requests under 20 MiB (`GPUPOOL_EXPANDABLE_LARGE_PAGES`).
fn pytorch(env: &str) -> Option<String> {
    let value = if env.is_empty() { "" } else { env.strip_prefix("GPUPOOL_CONF=")? };
    if value.contains(" GPUPOOL_") {
        return None;
    }
    let value = match value {
        v if v.contains("expandable_segments:") => v.to_string(),
        "" => "expandable_segments:True".to_string(),
        v => format!("expandable_segments:True,{v}"),
    };
    Some(format!("PYTORCH_CUDA_ALLOC_CONF={value}"))
}
