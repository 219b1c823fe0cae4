//! The command line of `gpupool-replay`.

use std::io::Write;
use std::path::PathBuf;

use gpupool::config::{CONF_VAR, Config, parse_size};

use crate::cuda::Gpu;
use crate::input::load_limited;
use crate::limits::Limits;
use crate::report::{Row, csv, json};
use crate::run::{default_capacity, replay_sim};
use crate::setting::{Setting, grid};
use crate::suggest::mark;
use crate::table::table;
use crate::trace::Trace;

/// The text of `--help`.
pub const USAGE: &str = "\
usage: gpupool-replay [OPTIONS] TRACE...

Replays allocation traces on gpupool, once per configuration, and prints per configuration the
peak reserved and peak live bytes, their ratio, driver allocations, retries, out-of-memory
errors and nanoseconds per event (a cold pass from an empty cache, then a warm pass). Each
trace is replayed under the defaults first (gpupool's: expandable segments with large pages,
where PyTorch's are 'expandable_segments:False'; the row 'defaults'), then under each --conf
in order.

TRACE is a text trace or a PyTorch memory snapshot, either of them gzipped or not:
  - a text trace has one event a line: 'a ID SIZE STREAM' allocates SIZE bytes (as the program
    asked for them, before rounding) as allocation ID on stream STREAM, an integer id (a CUDA
    stream handle, 0 the default stream; each distinct value is replayed on a stream of its
    own); 'f ID' frees allocation ID. gpupool's repository ships two, recorded from PyTorch
    workloads, in replay/traces (its README.md says what each is);
  - a snapshot is the pickle of torch.cuda.memory._dump_snapshot(). It also gives a row of
    driver 'recorded': what PyTorch's allocator reserved over the same events, under the
    PYTORCH_CUDA_ALLOC_CONF the snapshot recorded; and a row of gpupool replaying that
    configuration on PyTorch's defaults (ordinary segments unless it says otherwise; an empty
    one is 'expandable_segments:False'), after the defaults row. 'defaults' is gpupool's
    defaults for a snapshot too, whatever the recording ran with. Expandable segments differ in
    their pages: gpupool maps 2 MiB pages for requests under 20 MiB, PyTorch 20 MiB pages in
    its large pool, so the two rows of an expandable recording may differ.

options:
  --conf CONF         a configuration in GPUPOOL_CONF's syntax (PyTorch's
                      PYTORCH_CUDA_ALLOC_CONF), e.g. 'expandable_segments:True' or
                      'max_split_size_mb:128,roundup_power2_divisions:4': one row each;
                      '' is the defaults. The environment is not read.
  --row 'NAME=VALUE;NAME=VALUE'
                      a row set by any of gpupool's variables, as a program's environment
                      sets them: GPUPOOL_CONF and the GPUPOOL_* of its options table
                      (gpupool_print_options lists them; GPUPOOL_EXPANDABLE_RECLAIM and
                      GPUPOOL_RECORD_HISTORY change a replay), for instance
                      --row 'GPUPOOL_CONF=expandable_segments:True;GPUPOOL_EXPANDABLE_RECLAIM=1'
  --suggest           also replay a grid of configurations (each key that matters for
                      fragmentation, and gpupool's GPUPOOL_EXPANDABLE_RECLAIM), and say per
                      trace which one to use: of those that never ran out of memory, the
                      least peak reserved among those whose warm pass is within 10% of the
                      fastest; with the environment that sets it
  --no-defaults       no row of the defaults, nor of a snapshot's recorded configuration:
                      only the --conf and --row rows (at least one)
  --driver sim|cuda   sim (default): the simulated device, no GPU needed; cuda: device 0 of
                      this machine's GPU, with one CUDA stream per stream of the trace
  --capacity SIZE     the simulated device's memory, e.g. 24GiB (default: 80GiB, or twice the
                      largest peak live rounded up to a GiB when that is more): whether the
                      trace fits a GPU of that size. A row that ran out of memory gives the
                      first allocation that did (its event, from 0, and its size)
  --device N          of a snapshot, replay only device N's trace (default: every device's)
  --max-input SIZE    the most a trace file may hold once decompressed, and about the most
                      memory what is read from it may take (default 4GiB); a file over it
                      fails, saying so
  --format FORMAT     table (default), json or csv. The table names a snapshot's recorded
                      configuration 'recorded' and one of over 32 characters 'conf N', and
                      spells them out below it; json and csv write them whole
  --json, --csv       the same as --format json, --format csv
  -o, --output FILE   write the report to FILE instead of standard output
  -h, --help          this text
  -V, --version       print 'gpupool-replay VERSION' (this build's version) and exit

Exit status: 0 done (out-of-memory errors in a replay are reported, not failures); 1 a trace
could not be read or a replay failed (no GPU for --driver cuda, for one); 2 bad usage (an
unknown option, a --conf or --row that does not parse).
";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Table,
    Json,
    Csv,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum DriverChoice {
    Sim,
    Cuda,
}

struct Options {
    /// The rows to replay, the defaults first unless `--no-defaults`; each label once.
    confs: Vec<Setting>,
    /// `--suggest`: the grid too, and the suggestion.
    suggest: bool,
    /// `--no-defaults`: only the `--conf` rows, not even a snapshot's recorded configuration.
    no_defaults: bool,
    driver: DriverChoice,
    capacity: Option<usize>,
    device: Option<usize>,
    limits: Limits,
    format: Format,
    output: Option<PathBuf>,
    traces: Vec<PathBuf>,
}

/// Why the command stopped: bad usage (status 2) or a failure (status 1).
enum Stop {
    Usage(String),
    Failed(String),
    Help,
    Version,
}

fn parse_args(args: &[String]) -> Result<Options, Stop> {
    let mut o = Options {
        confs: Vec::new(),
        suggest: false,
        no_defaults: false,
        driver: DriverChoice::Sim,
        capacity: None,
        device: None,
        limits: Limits::default(),
        format: Format::Table,
        output: None,
        traces: Vec::new(),
    };
    let mut it = args.iter();
    let mut only_traces = false;
    while let Some(arg) = it.next() {
        if only_traces || !arg.starts_with('-') {
            o.traces.push(PathBuf::from(arg));
            continue;
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        if inline.is_some()
            && matches!(name, "--help" | "--version" | "--no-defaults" | "--suggest" | "--json" | "--csv")
        {
            return Err(Stop::Usage(format!("{name} takes no value")));
        }
        let mut value = || {
            inline.clone().or_else(|| it.next().cloned()).ok_or_else(|| Stop::Usage(format!("{name} needs a value")))
        };
        match name {
            "--" => only_traces = true,
            "-h" | "--help" => return Err(Stop::Help),
            "-V" | "--version" => return Err(Stop::Version),
            "--conf" => o.confs.push(Setting::conf(&value()?).map_err(Stop::Usage)?),
            "--row" => o.confs.push(Setting::row(&value()?).map_err(Stop::Usage)?),
            "--suggest" => o.suggest = true,
            "--no-defaults" => o.no_defaults = true,
            "--driver" => {
                o.driver = match value()?.as_str() {
                    "sim" => DriverChoice::Sim,
                    "cuda" => DriverChoice::Cuda,
                    other => return Err(Stop::Usage(format!("--driver {other:?}: expected sim or cuda"))),
                }
            }
            "--capacity" => {
                let v = value()?;
                o.capacity = Some(parse_size(&v).filter(|&n| n > 0).ok_or_else(|| {
                    Stop::Usage(format!("--capacity {v:?}: expected a size such as 24GiB, 512MiB or a number of bytes"))
                })?);
            }
            "--device" => {
                let v = value()?;
                o.device = Some(
                    v.parse()
                        .map_err(|_| Stop::Usage(format!("--device {v:?}: expected a device number, 0 or more")))?,
                );
            }
            "--max-input" => {
                let v = value()?;
                o.limits.max_input = parse_size(&v).filter(|&n| n > 0).map(|n| n as u64).ok_or_else(|| {
                    Stop::Usage(format!("--max-input {v:?}: expected a size such as 4GiB, 512MiB or a number of bytes"))
                })?;
            }
            "--format" => {
                o.format = match value()?.as_str() {
                    "table" => Format::Table,
                    "json" => Format::Json,
                    "csv" => Format::Csv,
                    other => return Err(Stop::Usage(format!("--format {other:?}: expected table, json or csv"))),
                }
            }
            "--json" => o.format = Format::Json,
            "--csv" => o.format = Format::Csv,
            "-o" | "--output" => o.output = Some(PathBuf::from(value()?)),
            _ => return Err(Stop::Usage(format!("unknown option {arg:?}"))),
        }
    }
    if o.traces.is_empty() {
        return Err(Stop::Usage("no trace given".into()));
    }
    if o.driver == DriverChoice::Cuda && o.capacity.is_some() {
        return Err(Stop::Usage("--capacity sizes the simulated device: it does not go with --driver cuda".into()));
    }
    if o.no_defaults && o.confs.is_empty() && !o.suggest {
        return Err(Stop::Usage("--no-defaults leaves nothing to replay: give a --conf".into()));
    }
    if !o.no_defaults {
        o.confs.insert(0, Setting::defaults());
    }
    if o.suggest {
        // After the rows asked for; a configuration one of them replays already is not
        // replayed again.
        for s in grid() {
            if !o.confs.iter().any(|c| c.config == s.config) {
                o.confs.push(s);
            }
        }
    }
    // `--conf ''` is the defaults: replayed once, where they come first.
    let mut defaults_seen = false;
    o.confs.retain(|s| s.label != "defaults" || !std::mem::replace(&mut defaults_seen, true));
    Ok(o)
}

/// The row that replays a snapshot's recorded configuration on gpupool, labelled with the
/// recorded text (as the snapshot's `recorded` row is), `expandable_segments:False` for an
/// empty one (PyTorch's defaults, which are not gpupool's). The recorded keys apply to
/// PyTorch's defaults ([`Config::pytorch_conf`]), as they did in the recording, so the row runs
/// ordinary segments unless the text says `expandable_segments:True`. None for a text trace
/// or a snapshot that recorded no configuration; and, with a line in `err` saying why, for one
/// that a row of `confs` replays already or that gpupool does not run (a key of a later
/// PyTorch, say).
fn recorded_conf(t: &Trace, confs: &[Setting], err: &mut dyn Write) -> Option<Setting> {
    let text = t.recorded.as_ref()?.conf.as_deref()?.trim();
    // The environment that sets it for gpupool: the key first, so that the recorded text's
    // own `expandable_segments` wins.
    let conf = if text.is_empty() { PYTORCH.to_string() } else { format!("{PYTORCH},{text}") };
    let label = if text.is_empty() { PYTORCH } else { text };
    let setting = match Config::pytorch_conf(text) {
        Ok(config) => Setting { label: label.to_string(), config, vars: vec![(CONF_VAR.into(), conf)] },
        Err(e) => {
            let _ = writeln!(err, "{}: no row for the recorded configuration, which gpupool does not run: {e}", t.name);
            return None;
        }
    };
    if let Some(s) = confs.iter().find(|s| s.config == setting.config) {
        let _ =
            writeln!(err, "{}: the recorded configuration is that of the row {:?}: no row of its own", t.name, s.label);
        return None;
    }
    Some(setting)
}

/// PyTorch's defaults in `GPUPOOL_CONF`: gpupool's but for its segments.
const PYTORCH: &str = "expandable_segments:False";

/// Loads the traces and replays each under every configuration; returns the rows, writing the
/// traces' notes to `err`.
fn rows(o: &Options, err: &mut dyn Write) -> Result<Vec<Row>, Stop> {
    let mut traces = Vec::new();
    for path in &o.traces {
        traces.extend(load_limited(path, o.device, &o.limits).map_err(Stop::Failed)?);
    }
    let gpu = match o.driver {
        DriverChoice::Cuda => Some(Gpu::open().map_err(|e| {
            Stop::Failed(format!("--driver cuda: {e} (leave --driver cuda out to replay on the simulated device)"))
        })?),
        DriverChoice::Sim => None,
    };
    let capacity = o.capacity.unwrap_or_else(|| default_capacity(&traces));
    let mut rows = Vec::new();
    for t in &traces {
        let _ = writeln!(
            err,
            "{}: {} events on {} stream(s), {} blocks alive before it, peak live {:.1} MiB",
            t.name,
            t.events.len(),
            t.streams.len(),
            t.initial_blocks,
            t.peak_live() as f64 / (1u64 << 20) as f64
        );
        for note in &t.notes {
            let _ = writeln!(err, "{}: {note}", t.name);
        }
        if let Some(r) = &t.recorded {
            rows.push(Row::recorded(t, r));
        }
        let mut confs = o.confs.clone();
        if !o.no_defaults {
            // After the defaults row, which is first.
            confs.splice(1..1, recorded_conf(t, &o.confs, err));
        }
        for s in &confs {
            let row = match &gpu {
                Some(gpu) => {
                    let outcome = gpu.replay(t, &s.config).map_err(|e| Stop::Failed(format!("{}: {e}", t.name)))?;
                    Row::replayed(t, s, "cuda", None, &outcome)
                }
                None => {
                    let outcome =
                        replay_sim(t, &s.config, capacity).map_err(|e| Stop::Failed(format!("{}: {e}", t.name)))?;
                    Row::replayed(t, s, "sim", Some(capacity), &outcome)
                }
            };
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Runs the command with `args` (without the program's name), the report to `out` (unless
/// `--output` names a file), messages to `err`. Returns the exit status: 0 done, 1 failed,
/// 2 bad usage.
pub fn main_with(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let result = parse_args(args).and_then(|o| {
        let mut rows = rows(&o, err)?;
        let suggestion = if o.suggest { mark(&mut rows) } else { String::new() };
        let text = match o.format {
            Format::Table if suggestion.is_empty() => table(&rows),
            Format::Table => format!("{}\n{suggestion}", table(&rows)),
            // The suggestion is in the rows (`suggested`); said on stderr too.
            Format::Json | Format::Csv => {
                let _ = err.write_all(suggestion.as_bytes());
                if o.format == Format::Json { json(&rows) } else { csv(&rows) }
            }
        };
        match &o.output {
            Some(path) => std::fs::write(path, text).map_err(|e| Stop::Failed(format!("{}: {e}", path.display()))),
            None => out.write_all(text.as_bytes()).map_err(|e| Stop::Failed(format!("writing the report: {e}"))),
        }
    });
    match result {
        Ok(()) => 0,
        Err(Stop::Help) => {
            let _ = out.write_all(USAGE.as_bytes());
            0
        }
        Err(Stop::Version) => {
            let _ = writeln!(out, "gpupool-replay {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Err(Stop::Usage(why)) => {
            let _ = writeln!(err, "gpupool-replay: {why}\n(gpupool-replay --help says how it is used)");
            2
        }
        Err(Stop::Failed(why)) => {
            let _ = writeln!(err, "gpupool-replay: {why}");
            1
        }
    }
}
