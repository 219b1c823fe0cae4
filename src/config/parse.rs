//! The value parsers of the options: how a [`Kind`] reads a value's text (sizes with their
//! units, counts, booleans, words, the history settings), writes it back, and says what it
//! expects; and [`Opt::read`], the one reader of an environment value, which every row of
//! [`OPTIONS`](super::OPTIONS) goes through.

use std::ffi::OsStr;

use super::MIB;
use super::blank;
use super::options::{Kind, Opt, Value};
use crate::error::Error;
use crate::history::{HistoryContext, HistorySettings, HistoryStacks};

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
            Kind::History => parse_history(text).map(Value::History),
            // Kept for the process: the value lives with the Config, which holds `&'static str`s
            // (module `options`, `Value::Path`); see `keep`.
            Kind::Path => (!text.ends_with('/')).then(|| Value::Path(Some(keep(text)))),
        }
    }

    /// What a value of this kind must look like, for error messages.
    pub fn expected(&self) -> String {
        match *self {
            Kind::Size { unit, min } => {
                let counts = unit_name(unit);
                let min = if min == 0 { String::new() } else { format!(", at least {}", show_size(min, unit)) };
                // The largest, in the unit a bare number counts: past it, refused, never clamped.
                let max = format!("at most {} {counts}", usize::MAX / unit);
                format!(
                    "a size such as 4096, 512K or 16GiB (a bare number counts {counts}; units K, M, G, T or \
                     KiB, MiB, GiB, TiB are powers of 1024){min}, {max}"
                )
            }
            Kind::Count { min, max } => format!("a whole number from {min} to {max}"),
            Kind::Bool => "a boolean: 1/0, true/false, yes/no or on/off".to_string(),
            Kind::Word(words) => words.join(" or "),
            Kind::History => "off, or the events kept per device with an optional context and frames: 100000, \
                              100000:alloc or 100000:all:python (contexts none, state, alloc, all; frames all, \
                              python, native; all when left out)"
                .to_string(),
            Kind::Path => "a file's path (not a folder's: it ends with /)".to_string(),
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
            (_, Value::History(None)) => "off".to_string(),
            (_, Value::History(Some(h))) if h.stacks == HistoryStacks::All => {
                format!("{}:{}", h.max_entries, h.context.name())
            }
            (_, Value::History(Some(h))) => format!("{}:{}:{}", h.max_entries, h.context.name(), h.stacks.name()),
            // Unset: empty, which reads back as unset.
            (_, Value::Path(p)) => p.unwrap_or_default().to_string(),
        }
    }
}

/// Reads history settings: `off`, or `<max_entries>[:<context>[:<stacks>]]` (see
/// [`Kind::History`]).
fn parse_history(text: &str) -> Option<Option<HistorySettings>> {
    if text.eq_ignore_ascii_case("off") {
        return Some(None);
    }
    let mut parts = text.split(':');
    let n = parts.next()?;
    let context = match parts.next() {
        Some(c) => {
            let c = c.trim_matches(' ');
            [HistoryContext::None, HistoryContext::State, HistoryContext::Alloc, HistoryContext::All]
                .into_iter()
                .find(|h| h.name().eq_ignore_ascii_case(c))?
        }
        None => HistoryContext::All,
    };
    let stacks = match parts.next() {
        Some(s) => {
            let s = s.trim_matches(' ');
            [HistoryStacks::All, HistoryStacks::Python, HistoryStacks::Native]
                .into_iter()
                .find(|h| h.name().eq_ignore_ascii_case(s))?
        }
        None => HistoryStacks::All,
    };
    if parts.next().is_some() {
        return None;
    }
    let max_entries = n.trim_matches(' ').parse().ok()?;
    Some(Some(HistorySettings { max_entries, context, stacks }))
}

impl Opt {
    /// The one reader of a value: `text` from `origin` (the variable, or later a key of
    /// another syntax), trimmed. `Ok(None)` when it is empty (unset).
    ///
    /// Errors: [`Error::InvalidValue`] naming `origin`, the value and what is expected.
    pub fn parse_text(&self, origin: &str, text: &str) -> Result<Option<Value>, Error> {
        if let Some(found) = blank::stray(text) {
            let place = "around a value and before a size's unit";
            return Err(Error::InvalidValue(format!(
                "{origin}={text:?} is not valid: {}",
                blank::message(found, place)
            )));
        }
        let t = text.trim_matches(' ');
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
}

/// The unit a bare number counts.
pub(super) fn unit_name(unit: usize) -> String {
    match unit {
        1 => "bytes".to_string(),
        MIB => "MiB".to_string(),
        u => format!("units of {u} bytes"),
    }
}

/// `n` bytes in the largest unit that divides them ("16GiB"), or bare when `unit` is bytes
/// and none does; `unlimited` for `usize::MAX`.
pub(super) fn show_size(n: usize, unit: usize) -> String {
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

/// Parses "4096", "512K", "64MiB", "16 GiB" (case-insensitive; every unit a power of 1024;
/// ASCII spaces around it and before the unit) to bytes; `None` when it does not parse or is
/// past `usize::MAX`.
pub fn parse_size(text: &str) -> Option<usize> {
    parse_size_in(text, 1)
}

/// As [`parse_size`], a number without a unit counting `unit` bytes.
fn parse_size_in(text: &str, unit: usize) -> Option<usize> {
    let t = text.trim_matches(' ');
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: usize = digits.parse().ok()?;
    let scale = match suffix.trim_start_matches(' ').to_ascii_lowercase().as_str() {
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

/// `text` as a string that lives as long as the process, each distinct one made once and held
/// in a list that a static reaches: a path option is one string for the process's life, and a
/// `Config` made again (tests make thousands) neither grows memory nor leaks it in
/// LeakSanitizer's sense.
fn keep(text: &str) -> &'static str {
    static KEPT: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&s) = kept.iter().find(|&&s| s == text) {
        return s;
    }
    let s: &'static str = String::from(text).leak();
    kept.push(s);
    s
}
