//! Printing the options: [`Config::options_text`] (every option with its value in force, what
//! the LD_PRELOAD shim's report shows), [`options_markdown`], the markdown table of
//! [`OPTIONS`] that the module docs and the documentation hold, and [`options_c_comment`], the
//! same list as the opening comment of `include/gpupool.h` holds it.

use std::fmt::Write;

use super::options::{Kind, OPTIONS, Value};
use super::parse::{show_size, unit_name};
use super::{CONF_VAR, Config};

/// The kind column of `GPUPOOL_CONF`'s row.
const CONF_KIND: &str = "PyTorch's configuration string, `key:value,key:value`";
/// The meaning column of `GPUPOOL_CONF`'s row, around where its keys are listed.
const CONF_DOC: [&str; 2] = [
    "the allocator's settings, as `PYTORCH_CUDA_ALLOC_CONF` holds them for PyTorch 2.11's native backend",
    "; an unknown key or a bad value is an error naming it",
];
/// Where `GPUPOOL_CONF`'s keys are listed, as the markdown table says it (the module docs and
/// docs/configuration.md list them after the table).
const CONF_KEYS_MARKDOWN: &str = " (the keys are listed below)";
/// The same, as the header says it.
const CONF_KEYS_C: &str = " (docs/configuration.md lists the keys; `gpupool_set_config` sets them at run time)";
/// The width of a line of [`options_c_comment`], ` * ` included, as cbindgen's doc comments.
const C_WIDTH: usize = 96;

/// One row of the list: the variable, its kind, its default (markdown), its meaning.
struct Row {
    name: &'static str,
    kind: String,
    default: String,
    doc: String,
}

/// Every row of the list: [`OPTIONS`] in order, then `GPUPOOL_CONF`, whose meaning says where its
/// keys are listed (`keys`).
fn rows(keys: &str) -> Vec<Row> {
    let mut rows: Vec<Row> = OPTIONS
        .iter()
        .map(|opt| {
            let d = opt.kind.show(opt.default);
            let default = match opt.default {
                Value::Size(usize::MAX) => d,
                Value::Path(None) => "unset".to_string(),
                _ => format!("`{d}`"),
            };
            Row { name: opt.name, kind: opt.kind.describe(), default, doc: opt.doc.to_string() }
        })
        .collect();
    let doc = format!("{}{keys}{}", CONF_DOC[0], CONF_DOC[1]);
    rows.push(Row { name: CONF_VAR, kind: CONF_KIND.to_string(), default: "empty".to_string(), doc });
    rows
}

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
            Kind::Path => "a file's path".to_string(),
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
    for row in rows(CONF_KEYS_MARKDOWN) {
        let _ = writeln!(out, "| `{}` | {} | {} | {} |", row.name, row.kind, row.default, row.doc);
    }
    out
}

/// The list of options as the opening comment of `include/gpupool.h` holds it (cbindgen.toml's
/// `header`; tests/house/header.rs checks both), made from [`OPTIONS`]: one item per variable,
/// `GPUPOOL_CONF` last, ` * - GPUPOOL_X (kind; default d): meaning`, wrapped at 96 columns with
/// the continuation lines indented under the name.
pub fn options_c_comment() -> String {
    let mut out = String::new();
    for row in rows(CONF_KEYS_C) {
        let item = format!("{} ({}; default {}): {}", row.name, row.kind, row.default, row.doc);
        let mut line = String::from(" * -");
        for (i, word) in item.split_whitespace().enumerate() {
            if i > 0 && line.len() + 1 + word.len() > C_WIDTH {
                out.push_str(&line);
                out.push('\n');
                line = String::from(" *  ");
            }
            line.push(' ');
            line.push_str(word);
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}
