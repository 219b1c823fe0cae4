//! Options: every `GPUPOOL_*` environment variable that gpupool and the LD_PRELOAD shim read,
//! one row each of [`OPTIONS`], all read by one reader with one syntax, once, when the
//! process-wide allocator starts (the first call of the C API or of the shim). The shim reads
//! its options from the same [`Config`] ([`Allocator::config`](crate::Allocator::config)).
//!
//! The syntax, the same for every row:
//! - An empty value, or one of spaces only, counts as unset: the default applies. Spaces
//!   around a value are ignored.
//! - A size is a whole number with an optional unit: `K`, `M`, `G`, `T` or `KiB`, `MiB`,
//!   `GiB`, `TiB` (also `KB`..`TB`, all powers of 1024) or `B`, any case, spaces allowed before
//!   the unit: `4096`, `512K`, `16 GiB`. A bare number counts bytes, except in
//!   `GPUPOOL_MAX_SPLIT_SIZE_MB`, where it counts MiB as PyTorch's `max_split_size_mb` does.
//! - A count is a whole number within the row's range.
//! - A boolean is `1`/`0`, `true`/`false`, `yes`/`no` or `on`/`off`, any case.
//! - A word is one of the row's words, any case.
//! - A value that is not valid UTF-8, or does not parse, is [`Error::InvalidValue`] naming the
//!   variable, the value and what is expected; it is never replaced by the default.
//!
//! The options (the README's list of environment variables is this list, and a unit test
//! checks that both match [`OPTIONS`]):
//!
//! | variable | kind | default | meaning |
//! |---|---|---|---|
//! | `GPUPOOL_DRIVER` | `cuda` or `sim` | `cuda` | `cuda`: the CUDA driver API (libcuda.so.1, loaded at run time); `sim`: the simulated device (no GPU needed). Never chosen silently: without a driver, calls return `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` and print nothing. |
//! | `GPUPOOL_SIM_CAPACITY` | size, at least 1 | `16GiB` | bytes per simulated device |
//! | `GPUPOOL_SIM_DEVICES` | count, 1 to 64 | `1` | number of simulated devices |
//! | `GPUPOOL_MAX_SPLIT_SIZE_MB` | size (a bare number counts MiB), at least 21MiB | unlimited | PyTorch's `max_split_size_mb`: cached blocks of at least this size are never split, and serve only requests of about their size |
//! | `GPUPOOL_PRELOAD_MODE` | `safe` or `stream` | `safe` | LD_PRELOAD shim: `safe` (a `cudaFree`d block waits for a device synchronisation) or `stream` (reused at once, in stream order) |
//! | `GPUPOOL_PRELOAD_SYNC_BYTES` | size | `256MiB` | LD_PRELOAD shim, safe mode: deferred bytes on a device that trigger the synchronisation (0: at every free) |
//! | `GPUPOOL_PRELOAD_STATS` | boolean | `off` | LD_PRELOAD shim: at exit, print what was intercepted, these options and the memory summary of each device used (stderr) |
//!
//! A new option is a row of [`OPTIONS`] and a field of [`Config`]. Keys of another syntax
//! (PyTorch's `key:value` configuration string) fit as a second table of [`Opt`] rows named by
//! key, each value read with [`Opt::parse_text`] and stored with the same setters.

use std::ffi::{OsStr, OsString};
use std::fmt::Write;

use crate::error::Error;

/// Which driver the process-wide allocator uses (`GPUPOOL_DRIVER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverKind {
    /// The CUDA driver API (`libcuda.so.1`).
    Cuda,
    /// The simulated device: host memory, no GPU needed.
    Sim,
}

/// When the LD_PRELOAD shim lets a block freed through `cudaFree`/`cuMemFree` be reused
/// (`GPUPOOL_PRELOAD_MODE`; the shim's crate docs say why).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreloadMode {
    /// After a device synchronisation that follows the free (the default).
    Safe,
    /// At once, in stream order, as PyTorch's caching allocator does (one-stream programs).
    Stream,
}

/// The options of an allocator, one field per row of [`OPTIONS`]. [`Config::default`] holds
/// every row's default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The driver [`Allocator::from_config`](crate::Allocator::from_config) starts.
    pub driver: DriverKind,
    /// Simulated devices (with [`DriverKind::Sim`]).
    pub sim_devices: i32,
    /// Bytes per simulated device.
    pub sim_capacity: usize,
    /// PyTorch's `max_split_size`, in bytes; `usize::MAX` (PyTorch's default) for none.
    pub max_split_size: usize,
    /// PyTorch's `expandable_segments`: segments are address ranges whose pages are mapped on
    /// demand (CUDA's virtual memory calls), when the device supports them.
    pub expandable_segments: bool,
    /// The LD_PRELOAD shim's reuse rule for `cudaFree`/`cuMemFree`.
    pub preload_mode: PreloadMode,
    /// The LD_PRELOAD shim, safe mode: a device's deferred bytes that make the shim synchronise
    /// the device and release them.
    pub preload_sync_bytes: usize,
    /// The LD_PRELOAD shim writes its counts, the options and the memory summaries to stderr
    /// at exit.
    pub preload_stats: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            driver: DriverKind::Cuda,
            sim_devices: 1,
            sim_capacity: 16 << 30,
            max_split_size: usize::MAX,
            expandable_segments: false,
            preload_mode: PreloadMode::Safe,
            preload_sync_bytes: 256 << 20,
            preload_stats: false,
        }
    }
}

/// What an option's value is, and so how its text is read (the module docs give the syntax).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A size in bytes, at least `min`; a number without a unit counts `unit` bytes.
    Size { unit: usize, min: usize },
    /// A whole number from `min` to `max`.
    Count { min: i64, max: i64 },
    /// On or off.
    Bool,
    /// One of these words (lower case; matched in any case).
    Word(&'static [&'static str]),
}

/// An option's value, as [`Kind`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value {
    /// Bytes (`usize::MAX`: unlimited).
    Size(usize),
    /// A count.
    Count(i64),
    /// A boolean.
    Bool(bool),
    /// One of the row's words, as the row spells it.
    Word(&'static str),
}

/// One option: a row of [`OPTIONS`].
pub struct Opt {
    /// The environment variable.
    pub name: &'static str,
    /// How its value is read.
    pub kind: Kind,
    /// The value when the variable is unset or empty.
    pub default: Value,
    /// What it does, one line (the meaning column of the list).
    pub doc: &'static str,
    set: fn(&mut Config, Value),
    get: fn(&Config) -> Value,
}

const MIB: usize = 1 << 20;

/// Every option gpupool and the LD_PRELOAD shim read from the environment, in the order they
/// are read and printed. The module docs' list is made from it.
pub static OPTIONS: [Opt; 7] = [
    Opt {
        name: "GPUPOOL_DRIVER",
        kind: Kind::Word(&["cuda", "sim"]),
        default: Value::Word("cuda"),
        doc: "`cuda`: the CUDA driver API (libcuda.so.1, loaded at run time); `sim`: the simulated device (no GPU \
              needed). Never chosen silently: without a driver, calls return `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` and \
              print nothing.",
        set: |c, v| c.driver = if v == Value::Word("sim") { DriverKind::Sim } else { DriverKind::Cuda },
        get: |c| Value::Word(if c.driver == DriverKind::Sim { "sim" } else { "cuda" }),
    },
    Opt {
        name: "GPUPOOL_SIM_CAPACITY",
        kind: Kind::Size { unit: 1, min: 1 },
        default: Value::Size(16 << 30),
        doc: "bytes per simulated device",
        set: |c, v| c.sim_capacity = v.size(),
        get: |c| Value::Size(c.sim_capacity),
    },
    Opt {
        name: "GPUPOOL_SIM_DEVICES",
        kind: Kind::Count { min: 1, max: 64 },
        default: Value::Count(1),
        doc: "number of simulated devices",
        // The range check makes the count fit an i32.
        set: |c, v| c.sim_devices = v.count() as i32,
        get: |c| Value::Count(c.sim_devices.into()),
    },
    Opt {
        name: "GPUPOOL_MAX_SPLIT_SIZE_MB",
        // PyTorch: "max_split_size_mb too small, must be > 20", counted in whole MiB.
        kind: Kind::Size { unit: MIB, min: 21 * MIB },
        default: Value::Size(usize::MAX),
        doc: "PyTorch's `max_split_size_mb`: cached blocks of at least this size are never split, and serve only \
              requests of about their size",
        set: |c, v| c.max_split_size = v.size(),
        get: |c| Value::Size(c.max_split_size),
    },
    Opt {
        name: "GPUPOOL_PRELOAD_MODE",
        kind: Kind::Word(&["safe", "stream"]),
        default: Value::Word("safe"),
        doc: "LD_PRELOAD shim: `safe` (a `cudaFree`d block waits for a device synchronisation) or `stream` (reused \
              at once, in stream order)",
        set: |c, v| c.preload_mode = if v == Value::Word("stream") { PreloadMode::Stream } else { PreloadMode::Safe },
        get: |c| Value::Word(if c.preload_mode == PreloadMode::Stream { "stream" } else { "safe" }),
    },
    Opt {
        name: "GPUPOOL_PRELOAD_SYNC_BYTES",
        kind: Kind::Size { unit: 1, min: 0 },
        default: Value::Size(256 * MIB),
        doc: "LD_PRELOAD shim, safe mode: deferred bytes on a device that trigger the synchronisation (0: at every \
              free)",
        set: |c, v| c.preload_sync_bytes = v.size(),
        get: |c| Value::Size(c.preload_sync_bytes),
    },
    Opt {
        name: "GPUPOOL_PRELOAD_STATS",
        kind: Kind::Bool,
        default: Value::Bool(false),
        doc: "LD_PRELOAD shim: at exit, print what was intercepted, these options and the memory summary of each \
              device used (stderr)",
        set: |c, v| c.preload_stats = v == Value::Bool(true),
        get: |c| Value::Bool(c.preload_stats),
    },
];

impl Value {
    fn size(self) -> usize {
        match self {
            Value::Size(n) => n,
            _ => unreachable!("a size option's setter got {self:?}"),
        }
    }

    fn count(self) -> i64 {
        match self {
            Value::Count(n) => n,
            _ => unreachable!("a count option's setter got {self:?}"),
        }
    }
}

impl Kind {
    /// Reads `text` (trimmed, not empty) as this kind; `None` when it does not parse or is out
    /// of range.
    pub fn parse(&self, text: &str) -> Option<Value> {
        match *self {
            Kind::Size { unit, min } => parse_size_in(text, unit).filter(|&n| n >= min).map(Value::Size),
            Kind::Count { min, max } => text.parse().ok().filter(|n| (min..=max).contains(n)).map(Value::Count),
            Kind::Bool => match text.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Some(Value::Bool(true)),
                "0" | "false" | "no" | "off" => Some(Value::Bool(false)),
                _ => None,
            },
            Kind::Word(words) => words.iter().find(|w| w.eq_ignore_ascii_case(text)).map(|&w| Value::Word(w)),
        }
    }

    /// What a value of this kind must look like, for error messages.
    pub fn expected(&self) -> String {
        match *self {
            Kind::Size { unit, min } => {
                let counts = unit_name(unit);
                let min = if min == 0 { String::new() } else { format!(", at least {}", show_size(min, unit)) };
                format!(
                    "a size such as 4096, 512K or 16GiB (a bare number counts {counts}; units K, M, G, T or \
                     KiB, MiB, GiB, TiB are powers of 1024){min}"
                )
            }
            Kind::Count { min, max } => format!("a whole number from {min} to {max}"),
            Kind::Bool => "a boolean: 1/0, true/false, yes/no or on/off".to_string(),
            Kind::Word(words) => words.join(" or "),
        }
    }

    /// `value` written so that [`Kind::parse`] reads it back (`unlimited` for the size
    /// `usize::MAX`, which cannot be written).
    pub fn show(&self, value: Value) -> String {
        match (*self, value) {
            (Kind::Size { unit, .. }, Value::Size(n)) => show_size(n, unit),
            (_, Value::Size(n)) => n.to_string(),
            (_, Value::Count(n)) => n.to_string(),
            (_, Value::Bool(b)) => (if b { "on" } else { "off" }).to_string(),
            (_, Value::Word(w)) => w.to_string(),
        }
    }

    /// The kind column of the list.
    fn describe(&self) -> String {
        match *self {
            Kind::Size { unit, min } => {
                let bare =
                    if unit == 1 { String::new() } else { format!(" (a bare number counts {})", unit_name(unit)) };
                let min = if min == 0 { String::new() } else { format!(", at least {}", show_size(min, unit)) };
                format!("size{bare}{min}")
            }
            Kind::Count { min, max } => format!("count, {min} to {max}"),
            Kind::Bool => "boolean".to_string(),
            Kind::Word(words) => words.iter().map(|w| format!("`{w}`")).collect::<Vec<_>>().join(" or "),
        }
    }
}

impl Opt {
    /// The one reader of a value: `text` from `origin` (the variable, or later a key of
    /// another syntax), trimmed. `Ok(None)` when it is empty (unset).
    ///
    /// Errors: [`Error::InvalidValue`] naming `origin`, the value and what is expected.
    pub fn parse_text(&self, origin: &str, text: &str) -> Result<Option<Value>, Error> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(None);
        }
        self.kind.parse(t).map(Some).ok_or_else(|| {
            Error::InvalidValue(format!("{origin}={text:?} is not valid: expected {}", self.kind.expected()))
        })
    }

    /// Reads this option's environment value `raw` (as `std::env::var_os` gives it); `Ok(None)`
    /// when unset or empty.
    ///
    /// Errors: [`Error::InvalidValue`] naming the variable when `raw` is not valid UTF-8 or
    /// does not parse.
    pub fn read(&self, raw: Option<&OsStr>) -> Result<Option<Value>, Error> {
        let Some(raw) = raw else { return Ok(None) };
        let origin = format!("environment variable {}", self.name);
        match raw.to_str() {
            Some(text) => self.parse_text(&origin, text),
            None => Err(Error::InvalidValue(format!(
                "{origin}={raw:?} is not valid UTF-8: expected {}",
                self.kind.expected()
            ))),
        }
    }

    /// This option's value in `config`.
    pub fn get(&self, config: &Config) -> Value {
        (self.get)(config)
    }

    /// Sets this option in `config`. `value` must be one [`Opt::parse_text`] of this row gave,
    /// or [`Opt::default`].
    pub fn set(&self, config: &mut Config, value: Value) {
        (self.set)(config, value)
    }
}

impl Config {
    /// Reads every option from the environment (`std::env::var_os`).
    ///
    /// Errors: [`Error::InvalidValue`] naming the first variable, in [`OPTIONS`] order, whose
    /// value is not valid UTF-8 or does not parse.
    pub fn from_env() -> Result<Config, Error> {
        Config::from_lookup(|name| std::env::var_os(name))
    }

    /// Reads every option through `get` (the environment, or a test's table), as
    /// [`Config::from_env`] does.
    pub fn from_lookup<V: Into<OsString>>(get: impl Fn(&str) -> Option<V>) -> Result<Config, Error> {
        let mut c = Config::default();
        for opt in &OPTIONS {
            let raw = get(opt.name).map(Into::into);
            if let Some(v) = opt.read(raw.as_deref())? {
                opt.set(&mut c, v);
            }
        }
        Ok(c)
    }

    /// Every option with its value in this config, one line each, `(default)` after a value
    /// that is the default (mimalloc's `mi_options_print`):
    ///
    /// ```text
    /// GPUPOOL_DRIVER=sim
    /// GPUPOOL_SIM_CAPACITY=16GiB (default)
    /// ```
    pub fn options_text(&self) -> String {
        let mut out = String::new();
        for opt in &OPTIONS {
            let v = opt.get(self);
            let default = if v == opt.default { " (default)" } else { "" };
            let _ = writeln!(out, "{}={}{default}", opt.name, opt.kind.show(v));
        }
        out
    }
}

/// The list of options as a markdown table, made from [`OPTIONS`]: the module docs and the
/// README's list of environment variables are this text.
pub fn options_markdown() -> String {
    let mut out = String::from("| variable | kind | default | meaning |\n|---|---|---|---|\n");
    for opt in &OPTIONS {
        let d = opt.kind.show(opt.default);
        let d = if opt.default == Value::Size(usize::MAX) { d } else { format!("`{d}`") };
        let _ = writeln!(out, "| `{}` | {} | {d} | {} |", opt.name, opt.kind.describe(), opt.doc);
    }
    out
}

/// The unit a bare number counts.
fn unit_name(unit: usize) -> String {
    match unit {
        1 => "bytes".to_string(),
        MIB => "MiB".to_string(),
        u => format!("units of {u} bytes"),
    }
}

/// `n` bytes in the largest unit that divides them ("16GiB"), or bare when `unit` is bytes
/// and none does; `unlimited` for `usize::MAX`.
fn show_size(n: usize, unit: usize) -> String {
    if n == usize::MAX {
        return "unlimited".to_string();
    }
    for (shift, name) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n != 0 && n % (1 << shift) == 0 {
            return format!("{}{name}", n >> shift);
        }
    }
    if unit == 1 { n.to_string() } else { format!("{n}B") }
}

/// Parses "4096", "512K", "64MiB", "16 GiB" (case-insensitive; every unit a power of 1024) to
/// bytes; `None` when it does not parse or overflows.
pub fn parse_size(text: &str) -> Option<usize> {
    parse_size_in(text, 1)
}

/// As [`parse_size`], a number without a unit counting `unit` bytes.
fn parse_size_in(text: &str, unit: usize) -> Option<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: usize = digits.parse().ok()?;
    let scale = match suffix.trim().to_ascii_lowercase().as_str() {
        "" => unit,
        "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStringExt;

    use super::*;

    fn table(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn one(name: &str, value: &str) -> Result<Config, Error> {
        Config::from_lookup(table(&[(name, value)]))
    }

    fn opt(name: &str) -> &'static Opt {
        OPTIONS.iter().find(|o| o.name == name).unwrap()
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64MiB"), Some(64 << 20));
        assert_eq!(parse_size("16 GiB"), Some(16 << 30));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }

    #[test]
    fn options_parse_and_bad_values_are_named() {
        let c = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "sim"), ("GPUPOOL_SIM_DEVICES", "2")])).unwrap();
        assert_eq!((c.driver, c.sim_devices), (DriverKind::Sim, 2));
        let c = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "64")])).unwrap();
        assert_eq!(c.max_split_size, 64 << 20);
        let e = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "opencl")])).unwrap_err();
        assert!(e.message().contains("GPUPOOL_DRIVER"), "{e}");
        let e = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "20")])).unwrap_err();
        assert!(e.message().contains("at least 21MiB"), "{e}");
    }

    #[test]
    fn the_defaults_are_the_tables() {
        let c = Config::default();
        for o in &OPTIONS {
            assert_eq!(o.get(&c), o.default, "{}", o.name);
        }
        assert_eq!(Config::from_lookup(|_| None::<String>).unwrap(), c);
    }

    #[test]
    fn every_size_option_takes_every_suffix() {
        let sizes: Vec<&Opt> = OPTIONS.iter().filter(|o| matches!(o.kind, Kind::Size { .. })).collect();
        assert_eq!(sizes.len(), 3);
        let cases = [
            ("64M", 64 << 20),
            ("64MiB", 64 << 20),
            ("64mb", 64 << 20),
            ("65536K", 64 << 20),
            ("65536 KiB", 64 << 20),
            ("1G", 1 << 30),
            ("1gib", 1 << 30),
            ("1T", 1 << 40),
            ("1TiB", 1 << 40),
            (" 2 GiB ", 2 << 30),
            ("67108864B", 64 << 20),
        ];
        for o in sizes {
            for (text, bytes) in cases {
                let c = one(o.name, text).unwrap_or_else(|e| panic!("{}={text:?}: {e}", o.name));
                assert_eq!(o.get(&c), Value::Size(bytes), "{}={text:?}", o.name);
            }
            for bad in ["12X", "1.5G", "-1", "G", "1 G B", "99999999999T"] {
                let e = one(o.name, bad).unwrap_err();
                assert!(e.message().contains(o.name) && e.message().contains("a size"), "{e}");
            }
        }
        // The case that used to be refused: the shim's size in the size syntax.
        assert_eq!(one("GPUPOOL_PRELOAD_SYNC_BYTES", "256MiB").unwrap().preload_sync_bytes, 256 << 20);
        // A bare number counts bytes, except in the option PyTorch counts in MiB.
        assert_eq!(one("GPUPOOL_SIM_CAPACITY", "4096").unwrap().sim_capacity, 4096);
        assert_eq!(one("GPUPOOL_PRELOAD_SYNC_BYTES", "0").unwrap().preload_sync_bytes, 0);
        assert_eq!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "21").unwrap().max_split_size, 21 << 20);
        assert!(one("GPUPOOL_SIM_CAPACITY", "0").is_err());
        assert!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "20MiB").is_err());
        assert!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "99999999999999999").is_err());
    }

    #[test]
    fn empty_means_unset_for_every_option() {
        for o in &OPTIONS {
            for empty in ["", "  ", "\t"] {
                assert_eq!(one(o.name, empty), Ok(Config::default()), "{}={empty:?}", o.name);
            }
        }
    }

    #[test]
    fn words_and_booleans_ignore_case() {
        assert_eq!(one("GPUPOOL_DRIVER", "SIM").unwrap().driver, DriverKind::Sim);
        assert_eq!(one("GPUPOOL_DRIVER", " Cuda ").unwrap().driver, DriverKind::Cuda);
        assert_eq!(one("GPUPOOL_PRELOAD_MODE", "Stream").unwrap().preload_mode, PreloadMode::Stream);
        assert_eq!(one("GPUPOOL_PRELOAD_MODE", "SAFE").unwrap().preload_mode, PreloadMode::Safe);
        for yes in ["1", "true", "TRUE", "yes", "Yes", "on", "ON"] {
            assert!(one("GPUPOOL_PRELOAD_STATS", yes).unwrap().preload_stats, "{yes}");
        }
        for no in ["0", "false", "False", "no", "NO", "off", "Off"] {
            assert!(!one("GPUPOOL_PRELOAD_STATS", no).unwrap().preload_stats, "{no}");
        }
        for bad in ["2", "y", "enabled"] {
            let e = one("GPUPOOL_PRELOAD_STATS", bad).unwrap_err();
            assert!(e.message().contains("GPUPOOL_PRELOAD_STATS") && e.message().contains("on/off"), "{e}");
        }
    }

    #[test]
    fn counts_keep_their_range() {
        assert_eq!(one("GPUPOOL_SIM_DEVICES", "64").unwrap().sim_devices, 64);
        for bad in ["0", "65", "-1", "two", "1K"] {
            let e = one("GPUPOOL_SIM_DEVICES", bad).unwrap_err();
            assert!(e.message().contains("from 1 to 64"), "{e}");
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_is_an_error_naming_the_variable() {
        for o in &OPTIONS {
            let default = o.kind.show(o.default);
            let mut bytes = if default == "unlimited" { b"64".to_vec() } else { default.into_bytes() };
            bytes.push(0xff);
            let raw = OsString::from_vec(bytes);
            let e = Config::from_lookup(|n| (n == o.name).then(|| raw.clone())).unwrap_err();
            assert!(matches!(e, Error::InvalidValue(_)));
            assert!(e.message().contains(o.name) && e.message().contains("not valid UTF-8"), "{e}");
            assert!(e.message().contains("\\xFF"), "the value is shown: {e}");
        }
    }

    #[test]
    fn bad_values_name_the_variable_the_value_and_what_is_expected() {
        let cases = [
            ("GPUPOOL_DRIVER", "opencl", "cuda or sim"),
            ("GPUPOOL_SIM_CAPACITY", "16Q", "a size"),
            ("GPUPOOL_SIM_DEVICES", "0", "from 1 to 64"),
            ("GPUPOOL_MAX_SPLIT_SIZE_MB", "4", "at least 21MiB"),
            ("GPUPOOL_PRELOAD_MODE", "fast", "safe or stream"),
            ("GPUPOOL_PRELOAD_SYNC_BYTES", "lots", "a size"),
            ("GPUPOOL_PRELOAD_STATS", "maybe", "a boolean"),
        ];
        assert_eq!(cases.len(), OPTIONS.len());
        for (name, value, want) in cases {
            let e = one(name, value).unwrap_err();
            let m = e.message();
            assert!(matches!(e, Error::InvalidValue(_)));
            assert!(m.contains(name) && m.contains(&format!("{value:?}")) && m.contains(want), "{m}");
        }
    }

    #[test]
    fn options_text_shows_every_option_with_its_value() {
        let c = Config::from_lookup(table(&[
            ("GPUPOOL_DRIVER", "sim"),
            ("GPUPOOL_SIM_CAPACITY", "64M"),
            ("GPUPOOL_PRELOAD_STATS", "yes"),
        ]))
        .unwrap();
        let text = c.options_text();
        assert_eq!(
            text,
            "GPUPOOL_DRIVER=sim\n\
             GPUPOOL_SIM_CAPACITY=64MiB\n\
             GPUPOOL_SIM_DEVICES=1 (default)\n\
             GPUPOOL_MAX_SPLIT_SIZE_MB=unlimited (default)\n\
             GPUPOOL_PRELOAD_MODE=safe (default)\n\
             GPUPOOL_PRELOAD_SYNC_BYTES=256MiB (default)\n\
             GPUPOOL_PRELOAD_STATS=on\n"
        );
        // Every shown value reads back to itself.
        for o in &OPTIONS {
            for v in [o.default, o.get(&c)] {
                if v != Value::Size(usize::MAX) {
                    assert_eq!(o.parse_text(o.name, &o.kind.show(v)), Ok(Some(v)), "{}", o.name);
                }
            }
        }
        assert_eq!(opt("GPUPOOL_SIM_CAPACITY").kind.show(Value::Size(1000)), "1000");
        assert_eq!(opt("GPUPOOL_MAX_SPLIT_SIZE_MB").kind.show(Value::Size(1000)), "1000B");
    }

    #[test]
    fn the_module_docs_and_the_readme_hold_the_table() {
        let table = options_markdown();
        let docs: String = table.lines().map(|l| format!("//! {l}\n")).collect();
        assert!(include_str!("config.rs").contains(&docs), "src/config.rs's module docs must hold:\n{docs}");
        assert!(include_str!("../README.md").contains(&table), "README.md must hold:\n{table}");
    }
}
