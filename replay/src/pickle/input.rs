//! The bytes of a pickle, as its opcodes read them: fixed-size arguments, lengths, counted
//! strings, text lines (each error names the offset); and the values of the arguments that
//! are numbers or quoted text.

use std::io::{BufRead, ErrorKind, Read};

use super::Value;
use crate::limits::Budget;

/// The longest line a text opcode (`INT`, `GLOBAL`, `GET`...) may have.
const MAX_LINE: u64 = 4096;

/// The message of a pickle that is not valid at offset `at`.
pub(super) fn bad(at: u64, why: impl std::fmt::Display) -> String {
    format!("not a valid pickle at byte {at}: {why}")
}

pub(super) struct Input<R> {
    r: R,
    /// Bytes consumed so far: the offset of the next one.
    pub(super) pos: u64,
}

impl<R: BufRead> Input<R> {
    pub(super) fn new(r: R) -> Input<R> {
        Input { r, pos: 0 }
    }

    pub(super) fn io(&self, e: std::io::Error) -> String {
        if e.kind() == ErrorKind::UnexpectedEof {
            format!("the pickle ends early, at byte {} (a file cut short?)", self.pos)
        } else {
            format!("reading it failed at byte {}: {e}", self.pos)
        }
    }

    pub(super) fn byte(&mut self) -> Result<u8, String> {
        let b = match self.r.fill_buf() {
            Ok([b, ..]) => *b,
            Ok([]) => return Err(self.io(ErrorKind::UnexpectedEof.into())),
            Err(e) => return Err(self.io(e)),
        };
        self.r.consume(1);
        self.pos += 1;
        Ok(b)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0; N];
        self.r.read_exact(&mut a).map_err(|e| self.io(e))?;
        self.pos += N as u64;
        Ok(a)
    }

    pub(super) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(super) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length of 4 bytes that must not be negative (`BINSTRING`, `LONG4`).
    pub(super) fn i32_len(&mut self, at: u64) -> Result<u64, String> {
        let n = i32::from_le_bytes(self.array()?);
        u64::try_from(n).map_err(|_| bad(at, format!("a negative length, {n}")))
    }

    /// `n` bytes, when they are at most `keep`; else they are read and dropped (None).
    pub(super) fn bytes(&mut self, n: u64, keep: usize, budget: &mut Budget) -> Result<Option<Vec<u8>>, String> {
        if n > keep as u64 {
            let skipped =
                std::io::copy(&mut Read::take(&mut self.r, n), &mut std::io::sink()).map_err(|e| self.io(e))?;
            self.pos += skipped;
            if skipped < n {
                return Err(self.io(ErrorKind::UnexpectedEof.into()));
            }
            return Ok(None);
        }
        budget.charge(n + 16)?;
        let mut v = vec![0; n as usize];
        self.r.read_exact(&mut v).map_err(|e| self.io(e))?;
        self.pos += n;
        Ok(Some(v))
    }

    /// A text opcode's argument: the bytes up to the newline, which is dropped.
    pub(super) fn line(&mut self, at: u64) -> Result<String, String> {
        let mut v = Vec::new();
        Read::take(&mut self.r, MAX_LINE + 1).read_until(b'\n', &mut v).map_err(|e| self.io(e))?;
        self.pos += v.len() as u64;
        if v.pop() != Some(b'\n') {
            return Err(if v.len() as u64 >= MAX_LINE {
                bad(at, format!("a text argument longer than {MAX_LINE} bytes"))
            } else {
                self.io(ErrorKind::UnexpectedEof.into())
            });
        }
        String::from_utf8(v).map_err(|_| bad(at, "a text argument that is not UTF-8"))
    }
}

/// `LONG1`, `LONG4`: little-endian two's complement; beyond 8 bytes (dropped), not kept.
pub(super) fn long(bytes: Option<Vec<u8>>) -> Value {
    let Some(b) = bytes else {
        return Value::Other("an integer of more than 64 bits");
    };
    let mut a = if b.last().is_some_and(|&x| x & 0x80 != 0) { [0xff; 8] } else { [0; 8] };
    a[..b.len()].copy_from_slice(&b);
    Value::Int(i64::from_le_bytes(a))
}

/// `INT` (`I01`/`I00` are Python 2's True and False) and `LONG` (`123L`).
pub(super) fn text_int(line: &str, int: bool) -> Option<Value> {
    match (int, line) {
        (true, "01") => return Some(Value::Bool(true)),
        (true, "00") => return Some(Value::Bool(false)),
        _ => {}
    }
    let digits = line.trim().trim_end_matches('L');
    if let Ok(n) = digits.parse() {
        return Some(Value::Int(n));
    }
    let unsigned = digits.strip_prefix('-').unwrap_or(digits);
    (!unsigned.is_empty() && unsigned.bytes().all(|c| c.is_ascii_digit()))
        .then_some(Value::Other("an integer of more than 64 bits"))
}

/// The text of a `STRING` argument, Python's repr of a str: in single or double quotes.
pub(super) fn unquote(s: &str) -> Option<&str> {
    ['\'', '"'].into_iter().find_map(|q| s.strip_prefix(q)?.strip_suffix(q))
}
