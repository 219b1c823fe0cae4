//! The configuration string's syntax: PyTorch's tokenizer (`ConfigTokenizer`,
//! `c10/core/AllocatorConfig.h`), the `key:value` and `key:[a:b,...]` entries it makes, and
//! [`Raw`], a value as written with its readers (whole numbers, decimals, `True`/`False`).
//! What the keys mean is in `keys`.

use crate::config::blank;

/// A whole number, digits only (PyTorch reads it with `std::stoull`, which also takes a sign
/// and ignores what follows the digits).
pub(super) fn count(text: &str) -> Option<usize> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A value as written: one word, or a list of `a:b` items.
#[derive(Debug)]
pub(super) enum Raw {
    Word(String),
    List(Vec<(String, String)>),
}

impl Raw {
    pub(super) fn word(&self) -> Result<&str, String> {
        match self {
            Raw::Word(w) => Ok(w),
            Raw::List(_) => Err("a single value, not a list".into()),
        }
    }

    pub(super) fn count(&self) -> Result<usize, String> {
        count(self.word()?).ok_or_else(|| "a whole number (digits only)".into())
    }

    /// A decimal number, as Rust reads an `f64` (PyTorch `std::stod`, without what it ignores).
    pub(super) fn number(&self) -> Result<f64, String> {
        self.word()?.parse().map_err(|_| "a decimal number".into())
    }

    /// `True` or `False`, exactly (PyTorch `ConfigTokenizer::toBool`).
    pub(super) fn boolean(&self) -> Result<bool, String> {
        match self.word()? {
            "True" => Ok(true),
            "False" => Ok(false),
            _ => Err("True or False (exactly so written)".into()),
        }
    }
}

impl std::fmt::Display for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Raw::Word(w) => f.write_str(w),
            Raw::List(items) => {
                f.write_str("[")?;
                for (i, (a, b)) in items.iter().enumerate() {
                    write!(f, "{}{a}:{b}", if i == 0 { "" } else { "," })?;
                }
                f.write_str("]")
            }
        }
    }
}

/// PyTorch's `ConfigTokenizer`: `,`, `:`, `[` and `]` stand alone, the ASCII space is
/// dropped, everything else runs together into words. (PyTorch drops every byte that C's
/// `isspace` takes: tab, newline, vertical tab, form feed and carriage return too; gpupool
/// refuses those before it gets here, see `config::blank`.)
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for ch in text.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            out.push(ch.to_string());
        } else if ch != ' ' {
            word.push(ch);
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

fn is_sep(t: &str) -> bool {
    matches!(t, "," | ":" | "[" | "]")
}

/// The entries of a configuration string, in order; a message saying what is wrong when it is
/// not of the form `key:value,key:[a:b,...],...`.
pub(super) fn entries(text: &str) -> Result<Vec<(String, Raw)>, String> {
    if let Some(found) = blank::stray(text) {
        return Err(blank::message(
            found,
            "between tokens (PyTorch's tokenizer drops tab, newline, carriage return, vertical tab and form feed too; gpupool refuses them)",
        ));
    }
    let toks = tokens(text);
    let mut it = toks.into_iter();
    let mut out = Vec::new();
    let end = |t: Option<&String>| t.map_or("the end".to_string(), |t| format!("{t:?}"));
    while let Some(key) = it.next() {
        if is_sep(&key) {
            return Err(format!("expected a key, found {key:?}"));
        }
        match it.next() {
            Some(c) if c == ":" => {}
            t => return Err(format!("expected ':' after the key {key}, found {}", end(t.as_ref()))),
        }
        let value = match it.next() {
            Some(t) if t == "[" => {
                let mut items = Vec::new();
                loop {
                    let a = match it.next() {
                        Some(t) if t == "]" => break,
                        Some(t) if !is_sep(&t) => t,
                        t => {
                            return Err(format!(
                                "{key}: expected an item or ']' in the list, found {}",
                                end(t.as_ref())
                            ));
                        }
                    };
                    match it.next() {
                        Some(c) if c == ":" => {}
                        t => {
                            return Err(format!(
                                "{key}: expected ':' after {a} in the list, found {}",
                                end(t.as_ref())
                            ));
                        }
                    }
                    let b = match it.next() {
                        Some(t) if !is_sep(&t) => t,
                        t => {
                            return Err(format!(
                                "{key}: expected a value after {a}: in the list, found {}",
                                end(t.as_ref())
                            ));
                        }
                    };
                    let next = it.next();
                    match next.as_deref() {
                        Some(",") => items.push((a, b)),
                        Some("]") => {
                            items.push((a, b));
                            break;
                        }
                        _ => {
                            return Err(format!(
                                "{key}: expected ',' or ']' after {a}:{b}, found {}",
                                end(next.as_ref())
                            ));
                        }
                    }
                }
                Raw::List(items)
            }
            Some(t) if !is_sep(&t) => Raw::Word(t),
            t => return Err(format!("expected a value after {key}:, found {}", end(t.as_ref()))),
        };
        out.push((key, value));
        match it.next() {
            None => {}
            Some(t) if t == "," => {}
            Some(t) => {
                return Err(format!(
                    "expected ',' after {}:{}, found {t:?}",
                    out[out.len() - 1].0,
                    out[out.len() - 1].1
                ));
            }
        }
    }
    Ok(out)
}
