//! What reading one trace file may cost: the input files are downloaded, shared, and may be
//! hostile (a gzip bomb, a pickle of a billion empty lists), so reading is bounded in time and
//! memory by one size, `--max-input` (default [`DEFAULT_MAX_INPUT`]):
//!
//! - at most that many bytes are read from a file once decompressed ([`Capped`]): a larger one
//!   fails at that point, whatever it holds, having read nothing more;
//! - what is decoded from it and kept (a pickle's objects, a trace's events) is counted as it
//!   is made, at about what it takes in memory, and may take at most that much again
//!   ([`Budget`]). A real snapshot's objects take about 2 to 4 times its pickle's size; a
//!   text trace's events about the text's size.
//!
//! So reading a file takes at most about twice the limit in memory, and time in proportion to
//! the limit; the input itself is streamed, never held whole.

use std::io::{self, Read};

/// The default of `--max-input`: 4 GiB.
pub const DEFAULT_MAX_INPUT: u64 = 4 << 30;

/// The bounds on reading one file (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes read from one file once decompressed, and the most memory (about) that
    /// what is decoded from it may take.
    pub max_input: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_input: DEFAULT_MAX_INPUT }
    }
}

/// A size for messages: `4 GiB`, `512 MiB`, `1000 bytes`.
pub fn show_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} bytes")
}

/// The memory that decoding one file may still take, charged as objects are made.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: u64,
}

impl Budget {
    /// A budget of `limits.max_input` bytes.
    pub fn new(limits: &Limits) -> Budget {
        Budget { limit: limits.max_input, used: 0 }
    }

    /// Counts `bytes` more.
    ///
    /// Errors: the total is over the limit; the message says what the limit is and how to
    /// raise it.
    pub fn charge(&mut self, bytes: u64) -> Result<(), String> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.limit {
            return Err(format!(
                "what it holds takes more than {} of memory once decoded (--max-input raises the limit)",
                show_size(self.limit)
            ));
        }
        Ok(())
    }
}

/// A reader that gives at most `limit` bytes: past them, reading fails with a message saying
/// so (the file is larger than the limit, not merely cut short).
pub struct Capped<R> {
    inner: R,
    left: u64,
    limit: u64,
    /// Whether `inner` decompresses gzip: its errors then say that the file is not valid gzip.
    gzip: bool,
}

impl<R: Read> Capped<R> {
    /// `inner` capped at `limits.max_input` bytes; `gzip` when it is a gzip decoder.
    pub fn new(inner: R, limits: &Limits, gzip: bool) -> Capped<R> {
        Capped { inner, left: limits.max_input, limit: limits.max_input, gzip }
    }
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // One byte more than is left: whether there is any tells a file of exactly the limit
        // from a larger one.
        let want = buf.len().min(usize::try_from(self.left.saturating_add(1)).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want]).map_err(|e| {
            if self.gzip { io::Error::new(e.kind(), format!("not a valid gzip file ({e})")) } else { e }
        })?;
        if n as u64 > self.left {
            let what = if self.gzip { "once decompressed" } else { "long" };
            return Err(io::Error::other(format!(
                "more than {} {what} (--max-input raises the limit)",
                show_size(self.limit)
            )));
        }
        self.left -= n as u64;
        Ok(n)
    }
}
