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
//! the trace's notes.

use std::collections::HashMap;

use crate::trace::{Trace, TraceBuilder};

/// Reads a text trace. `name` names it in messages and in the report.
///
/// Errors: the first line that is not an event, naming `name`, the line number and what was
/// expected.
pub fn parse_text(name: &str, text: &str) -> Result<Trace, String> {
    let mut b = TraceBuilder::default();
    let mut live: HashMap<u64, u32> = HashMap::new();
    let (mut realloc, mut unknown_frees) = (0u64, 0u64);
    for (n, line) in text.lines().enumerate() {
        let bad = |why: &str| format!("{name}:{}: {why}: expected 'a ID SIZE STREAM' or 'f ID', found {line:?}", n + 1);
        let number = |field: &str| field.parse::<u64>().map_err(|_| bad(&format!("{field:?} is not a number")));
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [] => {}
            [first, ..] if first.starts_with('#') => {}
            ["a", id, size, stream] => {
                let (id, size, stream) = (number(id)?, number(size)?, number(stream)?);
                let size = usize::try_from(size).map_err(|_| bad("the size does not fit in memory"))?;
                if let Some(old) = live.remove(&id) {
                    realloc += 1;
                    b.free(old);
                }
                // A handle is a pointer: kept as its bits, as PyTorch's int64 stream fields are.
                live.insert(id, b.alloc(size, stream as i64));
            }
            ["f", id] => match live.remove(&number(id)?) {
                Some(block) => b.free(block),
                None => unknown_frees += 1,
            },
            _ => return Err(bad("not an event")),
        }
    }
    if realloc > 0 {
        b.note(format!("{realloc} allocations of an ID still alive: the older block was freed first"));
    }
    if unknown_frees > 0 {
        b.note(format!("{unknown_frees} frees of an ID not alive were skipped"));
    }
    Ok(b.finish(name.to_string(), None))
}
