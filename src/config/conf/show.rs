//! Printing `GPUPOOL_CONF` back: [`Config::conf_string`] (every key with its value, in
//! PyTorch's syntax) and [`conf_keys_markdown`], the markdown table of [`CONF_KEYS`] that the
//! module docs of `config` and the documentation hold.

use std::fmt::Write;

use super::keys::CONF_KEYS;
use crate::config::Config;

impl Config {
    /// Every key of `GPUPOOL_CONF` with its value in this config, in PyTorch's syntax and
    /// [`CONF_KEYS`] order: `backend:native,large_segment_size_mb:20,...`. [`Config::with_conf`]
    /// reads it back to the same settings. A size that is not a whole number of MiB (possible
    /// only through the Rust API) is shown rounded down; `pinned_reserve_segment_size_mb` is left
    /// out while unset, and `garbage_collection_threshold` while off: PyTorch refuses their
    /// defaults (0) as values.
    pub fn conf_string(&self) -> String {
        let mut out = String::new();
        for k in &CONF_KEYS {
            if let Some(v) = (k.show)(self) {
                if !out.is_empty() {
                    out.push(',');
                }
                let _ = write!(out, "{}:{v}", k.key);
            }
        }
        out
    }
}

/// The list of `GPUPOOL_CONF` keys as a markdown table, made from [`CONF_KEYS`]: the module
/// docs of `config` and docs/configuration.md hold this text.
pub fn conf_keys_markdown() -> String {
    let mut out = String::from("| key | value | default | meaning |\n|---|---|---|---|\n");
    for k in &CONF_KEYS {
        let also = if k.also.is_empty() {
            String::new()
        } else {
            format!(" (also {})", k.also.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", "))
        };
        let _ = writeln!(out, "| `{}`{also} | {} | {} | {} |", k.key, k.value, k.default, k.doc);
    }
    out
}
