//! A user's metadata on trace events (PyTorch `torch.cuda.memory._set_memory_metadata`,
//! `TraceEntry::user_metadata_`, PR #165490): a string the calling thread sets, carried by
//! every event of the trace that thread records from then on, until it sets another or clears
//! it; and the payload of an `annotate` event (PyTorch `_annotate_memory`, PR #190575).
//!
//! As PyTorch keeps it: one string per thread, which each event copies (here an `Arc<str>`
//! shared by the events of one setting, so that an event costs a reference count, and the
//! string lives as long as the newest event that carries it: nothing is interned for the life
//! of the process). PyTorch accepts any string and serialises a dict to compact JSON
//! (`json.dumps(separators=(",", ":"))`); gpupool takes the string as the program gives it,
//! with three checks ([`check`]): UTF-8 (the pickle writes a Unicode string), at most
//! [`MAX_METADATA_BYTES`], and, when it starts with `{` or `[` (a JSON object or array, what
//! the memory viewer shows as key-value pairs), valid JSON.

use std::cell::RefCell;
use std::sync::Arc;

use crate::error::Error;

/// The longest metadata accepted, in bytes of UTF-8: 64 KiB. Every event of the trace refers
/// to its thread's string, so that the pickle writes each distinct string once; the limit
/// bounds what one setting can add to a snapshot and to the host memory a trace holds. The C
/// header's is `GPUPOOL_MEMORY_METADATA_MAX`.
/// cbindgen:ignore
pub const MAX_METADATA_BYTES: usize = 64 * 1024;

thread_local! {
    /// The calling thread's metadata; `None` when unset or cleared.
    static CURRENT: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// Checks `bytes` as metadata: UTF-8, at most [`MAX_METADATA_BYTES`], and valid JSON (RFC
/// 8259: any depth of nesting, any `\u` escape) when its first character other than JSON's white
/// space (space, tab, line feed, carriage return) is `{` or `[`; text that starts with other
/// white space (a no-break space) is a label, as any text. Returns it as a string.
///
/// Errors: [`Error::InvalidValue`] naming the problem: the byte offset of the first byte that
/// is not UTF-8, the length and the limit, or serde_json's message with the line and column.
pub fn check(bytes: &[u8]) -> Result<&str, Error> {
    if bytes.len() > MAX_METADATA_BYTES {
        return Err(Error::InvalidValue(format!(
            "the metadata is {} bytes, more than the {MAX_METADATA_BYTES} bytes allowed",
            bytes.len()
        )));
    }
    let s = std::str::from_utf8(bytes).map_err(|e| {
        Error::InvalidValue(format!("the metadata is not UTF-8: byte {} starts an invalid sequence", e.valid_up_to()))
    })?;
    // JSON's own white space only (RFC 8259): a label after a no-break space is a label.
    if s.trim_start_matches([' ', '\t', '\n', '\r']).starts_with(['{', '[']) {
        // Skipped, not built: serde_json skips a value iteratively (no recursion limit, at most
        // one byte of state a level, 64 KiB here) and takes any `\u` escape, a lone surrogate's
        // too, as RFC 8259's grammar and Python's `json` do; a `Value` stopped at 128 levels.
        serde_json::from_str::<serde::de::IgnoredAny>(s).map_err(|e| {
            Error::InvalidValue(format!("the metadata starts as JSON ('{{' or '[') but is not valid JSON: {e}"))
        })?;
    }
    Ok(s)
}

/// Sets the calling thread's metadata (PyTorch `_set_memory_metadata`): every event the thread
/// records from now on carries it; `""` clears it. Checked as [`check`] says; on an error the
/// thread's metadata is left as it was.
pub fn set(metadata: &str) -> Result<(), Error> {
    let s = check(metadata.as_bytes())?;
    let value = (!s.is_empty()).then(|| Arc::<str>::from(s));
    CURRENT.with(|c| *c.borrow_mut() = value);
    Ok(())
}

/// The calling thread's metadata, `""` when none (PyTorch `_get_memory_metadata`).
pub fn get() -> String {
    CURRENT.with(|c| c.borrow().as_deref().unwrap_or("").to_string())
}

/// The calling thread's metadata for an event; `None` when none, or when the thread is
/// exiting (its thread-local storage destroyed).
#[inline]
pub(crate) fn current() -> Option<Arc<str>> {
    CURRENT.try_with(|c| c.try_borrow().ok().and_then(|m| m.clone())).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_each_rule() {
        assert!(check(b"forward").is_ok(), "a plain label, as PyTorch takes");
        assert!(check(br#" {"step": 3, "phase": ["a"]}"#).is_ok());
        let e = check(br#"{"step": 3"#).unwrap_err().to_string();
        assert!(e.contains("not valid JSON") && e.contains("column"), "{e}");
        let e = check(b"ok\xffno").unwrap_err().to_string();
        assert!(e.contains("not UTF-8") && e.contains("byte 2"), "{e}");
        let big = vec![b'a'; MAX_METADATA_BYTES + 1];
        let e = check(&big).unwrap_err().to_string();
        assert!(e.contains(&format!("{}", MAX_METADATA_BYTES + 1)), "{e}");
        assert!(check(&big[1..]).is_ok(), "the limit itself is allowed");
    }

    #[test]
    fn per_thread_and_cleared_by_empty() {
        set("a").unwrap();
        assert_eq!(get(), "a");
        std::thread::spawn(|| assert_eq!(get(), "")).join().unwrap();
        assert!(set("[").is_err());
        assert_eq!(get(), "a", "a refused setting leaves the old one");
        set("").unwrap();
        assert!(current().is_none());
    }
}
