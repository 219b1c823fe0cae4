//! The text format of the traces in `replay/traces`, one event a line:
//!
//! ```text
//! a ID SIZE STREAM     allocate SIZE bytes (as requested, before rounding) on STREAM
//! f ID                 free the allocation ID
//! ```
//!
//! `STREAM` is a CUDA stream handle as an integer (0: the legacy default stream). Blank lines
//! and lines starting with `#` are skipped; any other line is an error naming it. IDs are
//! never reused by the recorder; a trace that allocates an ID still alive is read as if the
//! older block had been freed first, and a free of an ID not alive is skipped, each counted in
//! the trace's notes. The file is read a line at a time; a line longer than [`MAX_LINE`] is an
//! error, and so is a file without events.

use std::collections::HashMap;
use std::io::{BufRead, Read};

use crate::limits::{Budget, Limits, show_size};
use crate::trace::{Trace, TraceBuilder};

/// The longest line read: an event takes under 80 characters; a longer line is no trace's.
pub const MAX_LINE: u64 = 64 << 10;

/// Reads a text trace. `name` names it in messages and in the report.
///
/// Errors: as [`read_text`], with the default [`Limits`].
pub fn parse_text(name: &str, text: &str) -> Result<Trace, String> {
    read_text(name, text.as_bytes(), &mut Budget::new(&Limits::default()))
}

/// Reads a text trace from `r`, a line at a time, its events charged to `budget`.
///
/// Errors: the first line that is not an event, naming `name`, the line number and what was
/// expected; a line longer than [`MAX_LINE`] or not UTF-8; a trace without events (nothing
/// to replay); reading failed; the budget is spent.
pub fn read_text(name: &str, mut r: impl BufRead, budget: &mut Budget) -> Result<Trace, String> {
    let mut b = TraceBuilder::new(budget);
    let mut live: HashMap<u64, u32> = HashMap::new();
    let (mut realloc, mut unknown_frees, mut events) = (0u64, 0u64, 0u64);
    let mut bytes = Vec::new();
    let mut n = 0u64;
    loop {
        bytes.clear();
        let got = Read::take(&mut r, MAX_LINE + 1).read_until(b'\n', &mut bytes).map_err(|e| format!("{name}: {e}"))?;
        if got == 0 {
            break;
        }
        n += 1;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
        } else if got as u64 > MAX_LINE {
            return Err(format!(
                "{name}:{n}: a line longer than {}: not a text trace (expected lines 'a ID SIZE STREAM' or 'f ID')",
                show_size(MAX_LINE)
            ));
        }
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        let line = std::str::from_utf8(&bytes).map_err(|_| match n {
            1 => format!("{name}: neither a text trace (it is not UTF-8 text) nor a PyTorch snapshot (not a pickle)"),
            _ => format!("{name}:{n}: not UTF-8 text"),
        })?;
        let bad = |why: &str| format!("{name}:{n}: {why}: expected 'a ID SIZE STREAM' or 'f ID', found {line:?}");
        let number = |field: &str| field.parse::<u64>().map_err(|_| bad(&format!("{field:?} is not a number")));
        let at = |e: String| format!("{name}:{n}: {e}");
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [] => {}
            [first, ..] if first.starts_with('#') => {}
            ["a", id, size, stream] => {
                let (id, size, stream) = (number(id)?, number(size)?, number(stream)?);
                let size = usize::try_from(size).map_err(|_| bad("the size does not fit in memory"))?;
                if let Some(old) = live.remove(&id) {
                    realloc += 1;
                    b.free(old).map_err(at)?;
                }
                // A handle is a pointer: kept as its bits, as PyTorch's int64 stream fields are.
                live.insert(id, b.alloc(size, stream as i64).map_err(at)?);
                events += 1;
            }
            ["f", id] => match live.remove(&number(id)?) {
                Some(block) => {
                    b.free(block).map_err(at)?;
                    events += 1;
                }
                None => unknown_frees += 1,
            },
            _ => return Err(bad("not an event")),
        }
    }
    if events == 0 {
        return Err(format!(
            "{name}: no events in it ({n} lines): nothing to replay (expected lines 'a ID SIZE STREAM' or 'f ID')"
        ));
    }
    if realloc > 0 {
        b.note(format!("{realloc} allocations of an ID still alive: the older block was freed first"));
    }
    if unknown_frees > 0 {
        b.note(format!("{unknown_frees} frees of an ID not alive were skipped"));
    }
    Ok(b.finish(name.to_string(), None))
}
