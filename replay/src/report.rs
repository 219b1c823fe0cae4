//! The report: one row per trace and configuration (and one for what PyTorch itself did, when
//! a snapshot says), for JSON or CSV for scripts, or a table for people ([`crate::table`]).

use serde::Serialize;

use crate::run::Outcome;
use crate::setting::Setting;
use crate::trace::{Recorded, Trace};

/// One line of the report. Sizes are bytes; `None` where the row has no such figure (the
/// recorded row has no timings, for instance); JSON writes it as `null`, CSV as an empty field.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The trace's name (file, and device for a snapshot of several).
    pub trace: String,
    /// The configuration as given to `--conf` (`GPUPOOL_CONF`'s syntax), a `--row`'s label
    /// ([`Setting::label`]), `defaults` for gpupool's defaults; for the recorded row, the recording's `PYTORCH_CUDA_ALLOC_CONF` when
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
    /// The first allocation that ran out of memory in the cold pass: its index in the
    /// replayed events, from 0 (the blocks alive before a snapshot's trace, allocated first,
    /// count); `None` when none did. With `--capacity`, where a device of that size would
    /// have failed the program.
    pub first_oom_event: Option<usize>,
    /// The bytes that allocation asked for.
    pub first_oom_bytes: Option<usize>,
    /// The environment that sets the row's configuration for a program using gpupool
    /// (`GPUPOOL_CONF=...` and any other `GPUPOOL_*` variable; empty for the defaults);
    /// `None` for the recorded row.
    pub environment: Option<String>,
    /// Whether `--suggest` chose this row's configuration for its trace.
    pub suggested: bool,
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
    /// The row of a replay of `trace` under `setting` on `driver`.
    pub fn replayed(trace: &Trace, setting: &Setting, driver: &str, capacity: Option<usize>, o: &Outcome) -> Row {
        let live = trace.peak_live();
        Row {
            trace: trace.name.clone(),
            configuration: setting.label.clone(),
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
            first_oom_event: o.first_oom.map(|f| f.event),
            first_oom_bytes: o.first_oom.map(|f| f.size),
            environment: Some(setting.environment()),
            suggested: false,
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
                // PyTorch's defaults, in the key where gpupool's differ.
                Some(c) if c.trim().is_empty() => "expandable_segments:False".into(),
                // Trimmed, as the row replaying it is labelled (`cli::recorded_conf`).
                Some(c) => c.trim().to_string(),
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
            first_oom_event: None,
            first_oom_bytes: None,
            environment: None,
            suggested: false,
            peak_settles_warm: None,
            cold_ns_per_event: None,
            warm_ns_per_event: None,
        }
    }
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
