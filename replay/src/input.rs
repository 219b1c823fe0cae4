//! Opening a trace file, whichever kind it is: a text trace or a PyTorch snapshot pickle, each
//! as it is or gzip-compressed (the traces of `replay/traces` are `.txt.gz`). The kind is
//! told from the content, not the name.

use std::io::Read;
use std::path::Path;

use crate::snapshot::{is_pickle, read_snapshot};
use crate::text::parse_text;
use crate::trace::Trace;

/// Reads the traces in the file at `path`: one for a text trace, one per device for a
/// snapshot (only `device`'s when given; a text trace has no device and ignores it). Traces
/// are named after the file's name.
///
/// Errors: the file cannot be read or decompressed, is neither a text trace nor a snapshot, or
/// does not parse (the message names the file, and the line for a text trace).
pub fn load(path: &Path, device: Option<usize>) -> Result<Vec<Trace>, String> {
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        flate2::read::MultiGzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| format!("{}: not a valid gzip file ({e})", path.display()))?;
        out
    } else {
        raw
    };
    load_bytes(&name, &bytes, device)
}

/// As [`load`], from the (decompressed) contents of a file called `name`.
///
/// Errors: as [`load`].
pub fn load_bytes(name: &str, bytes: &[u8], device: Option<usize>) -> Result<Vec<Trace>, String> {
    if is_pickle(bytes) {
        return read_snapshot(name, bytes, device);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| {
        format!("{name}: neither a text trace (it is not UTF-8 text) nor a PyTorch snapshot (not a pickle)")
    })?;
    Ok(vec![parse_text(name, text)?])
}
