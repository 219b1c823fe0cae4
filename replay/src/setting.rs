//! The configurations a trace is replayed under, one row of the report each: `--conf` (a
//! `GPUPOOL_CONF`), `--row` (any of gpupool's variables, `GPUPOOL_CONF` and every `GPUPOOL_*`
//! of its options table, read by [`Config::from_lookup`] as a process reads its environment),
//! and the grid that `--suggest` tries. Each knows the variables that set it, for the command
//! line the report gives.

use gpupool::config::{CONF_VAR as CONF, Config, OPTIONS};

/// Options of the table that choose the device: `--driver` and `--capacity` do, for a replay.
const DEVICE_OPTIONS: [&str; 3] = ["GPUPOOL_DRIVER", "GPUPOOL_SIM_CAPACITY", "GPUPOOL_SIM_DEVICES"];

/// One configuration to replay under.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    /// Its name in the report: `defaults`; the `--conf` text; for a `--row`, its
    /// `GPUPOOL_CONF` text followed by ` + NAME=VALUE` for each other variable.
    pub label: String,
    /// The configuration.
    pub config: Config,
    /// The variables that set it, `GPUPOOL_CONF` first; none for the defaults.
    pub vars: Vec<(String, String)>,
}

impl Setting {
    /// gpupool's defaults: expandable segments with large pages, where PyTorch's are ordinary
    /// segments (`expandable_segments:False`).
    pub fn defaults() -> Setting {
        Setting { label: "defaults".into(), config: Config::default(), vars: Vec::new() }
    }

    /// A `--conf`: `text` in `GPUPOOL_CONF`'s syntax (PyTorch's `PYTORCH_CUDA_ALLOC_CONF`);
    /// `''` is the defaults.
    ///
    /// Errors: gpupool's parser's message (the key and value at fault, and what is expected),
    /// after the option as given.
    pub fn conf(text: &str) -> Result<Setting, String> {
        Setting::vars(vec![(CONF.into(), text.into())]).map_err(|e| format!("--conf {text:?}: {e}"))
    }

    /// A `--row`: `NAME=VALUE` pairs separated by `;`, each `NAME` `GPUPOOL_CONF` or a
    /// `GPUPOOL_*` variable of gpupool's options table (`gpupool_print_options` lists them),
    /// e.g. `GPUPOOL_CONF=expandable_segments:True;GPUPOOL_EXPANDABLE_RECLAIM=1`.
    ///
    /// Errors: a pair without `=`, a name given twice, a name that is not one of gpupool's
    /// variables or that chooses the device (`--driver` and `--capacity` do), or a value
    /// that does not parse (gpupool's message, naming the variable).
    pub fn row(text: &str) -> Result<Setting, String> {
        let mut vars: Vec<(String, String)> = Vec::new();
        for pair in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("--row {text:?}: {pair:?} is not NAME=VALUE (pairs are separated by ';')"))?;
            let name = name.trim();
            if name != CONF && !OPTIONS.iter().any(|o| o.name == name) {
                let known: Vec<&str> = OPTIONS.iter().map(|o| o.name).filter(|n| !DEVICE_OPTIONS.contains(n)).collect();
                return Err(format!(
                    "--row {text:?}: {name:?} is not one of gpupool's variables ({CONF}, {})",
                    known.join(", ")
                ));
            }
            if DEVICE_OPTIONS.contains(&name) {
                return Err(format!(
                    "--row {text:?}: {name} chooses the device, which --driver and --capacity do here"
                ));
            }
            if vars.iter().any(|(n, _)| n == name) {
                return Err(format!("--row {text:?}: {name} is given twice"));
            }
            vars.push((name.to_string(), value.trim().to_string()));
        }
        // GPUPOOL_CONF first, as the label and the command line give it.
        vars.sort_by_key(|(n, _)| n != CONF);
        Setting::vars(vars).map_err(|e| format!("--row {text:?}: {e}"))
    }

    /// The setting of `vars`, read as gpupool reads its environment; the defaults when every
    /// variable is empty.
    fn vars(vars: Vec<(String, String)>) -> Result<Setting, String> {
        let vars: Vec<(String, String)> = vars.into_iter().filter(|(_, v)| !v.is_empty()).collect();
        let config = Config::from_lookup(|name| vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()))
            .map_err(|e| e.to_string())?;
        let mut label: Vec<String> = Vec::new();
        for (name, value) in &vars {
            label.push(if name == CONF { value.clone() } else { format!("{name}={value}") });
        }
        let label = if label.is_empty() { "defaults".to_string() } else { label.join(" + ") };
        Ok(Setting { label, config, vars })
    }

    /// The environment that sets it for a program that uses gpupool, as a shell would take
    /// it (`GPUPOOL_CONF=expandable_segments:True GPUPOOL_EXPANDABLE_RECLAIM=1`); empty for
    /// the defaults.
    pub fn environment(&self) -> String {
        let words: Vec<String> = self.vars.iter().map(|(n, v)| format!("{n}={}", shell_word(v))).collect();
        words.join(" ")
    }
}

/// `value` as one shell word: as it is when it holds only characters no shell treats
/// specially, else in single quotes.
fn shell_word(value: &str) -> String {
    if !value.is_empty() && value.chars().all(|c| c.is_ascii_alphanumeric() || "_.:,=/+-".contains(c)) {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', "'\\''"))
    }
}

/// What `--suggest` replays: the defaults (expandable segments with large pages), then each
/// key that matters for fragmentation changed alone (PyTorch's ordinary segments,
/// `expandable_segments:False`; gpupool's `GPUPOOL_EXPANDABLE_RECLAIM`; 2 MiB pages for large
/// requests; `roundup_power2_divisions`; and on ordinary segments, where they act,
/// `max_split_size_mb`, `garbage_collection_threshold` with the `per_process_memory_fraction`
/// it needs, and `large_segment_size_mb`), and pairs of them.
pub const GRID: [&str; 11] = [
    "GPUPOOL_CONF=expandable_segments:False",
    "GPUPOOL_EXPANDABLE_RECLAIM=1",
    "GPUPOOL_EXPANDABLE_LARGE_PAGES=0",
    "GPUPOOL_CONF=roundup_power2_divisions:4",
    "GPUPOOL_CONF=expandable_segments:False,max_split_size_mb:128",
    "GPUPOOL_CONF=expandable_segments:False,max_split_size_mb:512",
    "GPUPOOL_CONF=expandable_segments:False,garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
    "GPUPOOL_CONF=expandable_segments:False,large_segment_size_mb:12",
    "GPUPOOL_CONF=expandable_segments:False,large_segment_size_mb:64",
    "GPUPOOL_CONF=expandable_segments:False,max_split_size_mb:128,roundup_power2_divisions:4",
    "GPUPOOL_CONF=roundup_power2_divisions:4;GPUPOOL_EXPANDABLE_RECLAIM=1",
];

/// The settings of [`GRID`], after the defaults.
pub fn grid() -> Vec<Setting> {
    let mut all = vec![Setting::defaults()];
    all.extend(GRID.iter().map(|row| Setting::row(row).expect("the grid's rows parse")));
    all
}
