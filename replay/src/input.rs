//! Opening a trace file, whichever kind it is: a text trace or a PyTorch snapshot pickle, each
//! as it is or gzip-compressed (the traces of `replay/traces` are `.txt.gz`). The kind is
//! told from the content, not the name. The file is streamed, decompressed as it is read, and
//! what reading it may cost is bounded ([`crate::limits`]).

use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::Path;

use crate::limits::{Budget, Capped, Limits};
use crate::snapshot::{is_pickle, read_snapshot};
use crate::text::read_text;
use crate::trace::Trace;

/// Reads the traces in the file at `path`, with the default [`Limits`]: as [`load_limited`].
///
/// Errors: as [`load_limited`].
pub fn load(path: &Path, device: Option<usize>) -> Result<Vec<Trace>, String> {
    load_limited(path, device, &Limits::default())
}

/// Reads the traces in the file at `path`: one for a text trace, one per device for a
/// snapshot (only `device`'s when given; a text trace has no device and ignores it). Traces
/// are named after the file's name.
///
/// Errors: the file cannot be read or decompressed, is neither a text trace nor a snapshot,
/// does not parse (the message names the file, and the line for a text trace, the field for a
/// snapshot), holds nothing to replay, or is over `limits`.
pub fn load_limited(path: &Path, device: Option<usize>, limits: &Limits) -> Result<Vec<Trace>, String> {
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut file = BufReader::new(file);
    let gzip = file.fill_buf().map_err(|e| format!("{}: {e}", path.display()))?.starts_with(&[0x1f, 0x8b]);
    let source: Box<dyn Read> =
        if gzip { Box::new(flate2::bufread::MultiGzDecoder::new(file)) } else { Box::new(file) };
    read(&name, BufReader::with_capacity(1 << 16, Capped::new(source, limits, gzip)), device, limits)
}

/// As [`load`], from the (decompressed) contents of a file called `name`.
///
/// Errors: as [`load`].
pub fn load_bytes(name: &str, bytes: &[u8], device: Option<usize>) -> Result<Vec<Trace>, String> {
    let limits = Limits::default();
    read(name, BufReader::new(Capped::new(bytes, &limits, false)), device, &limits)
}

/// Reads from `r`, a snapshot when it starts as a pickle does, else a text trace.
fn read(name: &str, mut r: impl BufRead, device: Option<usize>, limits: &Limits) -> Result<Vec<Trace>, String> {
    // The first two bytes, however the reader hands them out.
    let mut head = Vec::with_capacity(2);
    Read::take(&mut r, 2).read_to_end(&mut head).map_err(|e| format!("{name}: {e}"))?;
    let r = Cursor::new(head.clone()).chain(r);
    let mut budget = Budget::new(limits);
    if is_pickle(&head) {
        read_snapshot(name, r, device, &mut budget)
    } else {
        Ok(vec![read_text(name, r, &mut budget)?])
    }
}
