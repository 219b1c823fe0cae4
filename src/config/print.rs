//! Printing the options: [`Config::options_text`] (every option with its value in force, what
//! the LD_PRELOAD shim's report shows) and [`options_markdown`], the markdown table of
//! [`OPTIONS`] that the module docs and the documentation hold.

use std::fmt::Write;

use super::options::{Kind, OPTIONS, Value};
use super::parse::{show_size, unit_name};
use super::{CONF_VAR, Config};

/// The kind column of `GPUPOOL_CONF`'s row.
const CONF_KIND: &str = "PyTorch's configuration string, `key:value,key:value`";
/// The meaning column of `GPUPOOL_CONF`'s row.
const CONF_DOC: &str = "the allocator's settings, as `PYTORCH_CUDA_ALLOC_CONF` holds them for PyTorch 2.11's native \
                        backend (the keys are listed below); an unknown key or a bad value is an error naming it";

impl Kind {
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
            Kind::History => "`off` or `<max_entries>[:<context>[:<stacks>]]`".to_string(),
        }
    }
}

impl Config {
    /// Every option with its value in this config, one line each, `(default)` after a value
    /// that is the default (mimalloc's `mi_options_print`); `GPUPOOL_CONF` last, with every
    /// key ([`Config::conf_string`]):
    ///
    /// ```text
    /// GPUPOOL_DRIVER=sim
    /// GPUPOOL_SIM_CAPACITY=16GiB (default)
    /// GPUPOOL_CONF=backend:native,large_segment_size_mb:20,...
    /// ```
    pub fn options_text(&self) -> String {
        let mut out = String::new();
        for opt in &OPTIONS {
            let v = opt.get(self);
            let default = if v == opt.default { " (default)" } else { "" };
            let _ = writeln!(out, "{}={}{default}", opt.name, opt.kind.show(v));
        }
        let conf = self.conf_string();
        let default = if conf == Config::default().conf_string() { " (default)" } else { "" };
        let _ = writeln!(out, "{CONF_VAR}={conf}{default}");
        out
    }
}

/// The list of options as a markdown table, made from [`OPTIONS`]: the module docs and the
/// list of environment variables in docs/configuration.md are this text.
pub fn options_markdown() -> String {
    let mut out = String::from("| variable | kind | default | meaning |\n|---|---|---|---|\n");
    for opt in &OPTIONS {
        let d = opt.kind.show(opt.default);
        let d = if opt.default == Value::Size(usize::MAX) { d } else { format!("`{d}`") };
        let _ = writeln!(out, "| `{}` | {} | {d} | {} |", opt.name, opt.kind.describe(), opt.doc);
    }
    let _ = writeln!(out, "| `{CONF_VAR}` | {CONF_KIND} | empty | {CONF_DOC} |");
    out
}
