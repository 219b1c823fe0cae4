//! A pickle writer for exactly what a snapshot holds: dicts, lists, 2-tuples, strings,
//! integers, floats and booleans, with the memo, in pickle protocol 4 as CPython's `pickle`
//! writes it (`Modules/_pickle.c`, the C pickler `pickle.dump` uses), opcode for opcode:
//!
//! - `PROTO 4`; then `FRAME` (an 8-byte length) before each frame of at least 64 KiB,
//!   committed at the first value written past that size, the last frame holding `STOP` and
//!   having no header when under 4 bytes;
//! - integers as `BININT1` (0 to 255), `BININT2` (to 65535), `BININT` (signed 32 bits), else
//!   `LONG1` with the fewest little-endian two's-complement bytes (at most 8: an `i64`);
//! - strings as `SHORT_BINUNICODE` (under 256 bytes of UTF-8) or `BINUNICODE`; floats as
//!   `BINFLOAT` (big-endian); `NEWTRUE`, `NEWFALSE`; 2-tuples as `TUPLE2`;
//! - `EMPTY_DICT` and `EMPTY_LIST`, their items in batches of 1,000 (`MARK` ... `SETITEMS` or
//!   `APPENDS`; a single item with `SETITEM` or `APPEND`), as CPython's `batch_dict_exact` and
//!   `batch_list_exact` write them (a dict of a multiple of 1,000 items ends with an empty
//!   batch);
//! - the memo: `MEMOIZE` after an object puts it at the next index; `BINGET` (index under 256)
//!   or `LONG_BINGET` refers back to it.
//!
//! The memory_viz page's own unpickler (`torch/utils/viz/MemoryViz.js`, `unpickle`) knows each
//! of these: PyTorch's snapshots are written by CPython with them. Its `MEMOIZE` numbers the
//! memo as CPython's does as long as nothing is put there by `BINPUT`, which this writer never
//! writes. Unlike CPython, which memoizes every string, dict, list and tuple, the caller chooses
//! what to memoize ([`Writer::memoize`]): the objects it refers back to.
//!
//! Written here, not with a crate: serde-pickle 1.2 (the newest) writes no memo, and no
//! reference is possible through serde's data model; deser-pickle 0.10 refers back to shared
//! values, but needs Rust 1.88 (gpupool builds with 1.85) and brings the deser framework
//! along, and neither pins its opcodes to the ones the page reads.

use std::io::{self, Write};

const MARK: u8 = b'(';
const STOP: u8 = b'.';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BINUNICODE: u8 = b'X';
const APPEND: u8 = b'a';
const EMPTY_DICT: u8 = b'}';
const APPENDS: u8 = b'e';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const EMPTY_LIST: u8 = b']';
const SETITEM: u8 = b's';
const SETITEMS: u8 = b'u';
const BINFLOAT: u8 = b'G';
const PROTO: u8 = 0x80;
const TUPLE2: u8 = 0x86;
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const LONG1: u8 = 0x8a;
const SHORT_BINUNICODE: u8 = 0x8c;
const MEMOIZE: u8 = 0x94;
const FRAME: u8 = 0x95;

/// CPython's `FRAME_SIZE_TARGET`: a frame is committed once it holds this many bytes.
const FRAME_TARGET: usize = 64 * 1024;
/// CPython's `FRAME_SIZE_MIN`: a smaller last frame is written without its header.
const FRAME_MIN: usize = 4;
/// CPython's `BATCHSIZE`: items per `SETITEMS` or `APPENDS`.
const BATCH: usize = 1000;

/// Writes one pickle, protocol 4, to `out`, a frame at a time.
pub(crate) struct Writer<W: Write> {
    out: W,
    /// The frame being written, its header not yet.
    frame: Vec<u8>,
    /// Objects memoized so far: the next `MEMOIZE` index.
    memo: u32,
}

impl<W: Write> Writer<W> {
    /// Starts a pickle: `PROTO 4`.
    pub fn new(mut out: W) -> io::Result<Writer<W>> {
        out.write_all(&[PROTO, 4])?;
        Ok(Writer { out, frame: Vec::with_capacity(FRAME_TARGET + 1024), memo: 0 })
    }

    /// Ends the pickle (`STOP`, the last frame) and returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.frame.push(STOP);
        self.commit()?;
        Ok(self.out)
    }

    /// Where CPython starts saving an object: commits the frame once it is full.
    fn boundary(&mut self) -> io::Result<()> {
        if self.frame.len() >= FRAME_TARGET { self.commit() } else { Ok(()) }
    }

    fn commit(&mut self) -> io::Result<()> {
        if self.frame.len() >= FRAME_MIN {
            let mut header = [FRAME; 9];
            header[1..].copy_from_slice(&(self.frame.len() as u64).to_le_bytes());
            self.out.write_all(&header)?;
        }
        self.out.write_all(&self.frame)?;
        self.frame.clear();
        Ok(())
    }

    /// An integer, in the fewest bytes CPython's opcodes allow.
    pub fn int(&mut self, v: i64) -> io::Result<()> {
        self.boundary()?;
        let f = &mut self.frame;
        match v {
            0..=0xff => f.extend_from_slice(&[BININT1, v as u8]),
            0x100..=0xffff => {
                f.push(BININT2);
                f.extend_from_slice(&(v as u16).to_le_bytes());
            }
            -0x8000_0000..=0x7fff_ffff => {
                f.push(BININT);
                f.extend_from_slice(&(v as i32).to_le_bytes());
            }
            _ => {
                // CPython's `encode_long`: the bit length's bytes plus a sign bit, less a
                // redundant 0xff byte of a negative number.
                let bits = 64 - if v < 0 { (!v).leading_zeros() } else { v.leading_zeros() } as usize;
                let n = (bits / 8 + 1).min(8);
                f.extend_from_slice(&[LONG1, n as u8]);
                f.extend_from_slice(&v.to_le_bytes()[..n]);
            }
        }
        Ok(())
    }

    /// A float (`BINFLOAT`, big-endian).
    pub fn float(&mut self, v: f64) -> io::Result<()> {
        self.boundary()?;
        self.frame.push(BINFLOAT);
        self.frame.extend_from_slice(&v.to_be_bytes());
        Ok(())
    }

    /// `True` or `False`.
    pub fn bool(&mut self, v: bool) -> io::Result<()> {
        self.boundary()?;
        self.frame.push(if v { NEWTRUE } else { NEWFALSE });
        Ok(())
    }

    /// A string, not memoized.
    ///
    /// Errors: `InvalidInput` for 4 GiB or more (`BINUNICODE8`, which the page does not read).
    pub fn str(&mut self, s: &str) -> io::Result<()> {
        self.boundary()?;
        let f = &mut self.frame;
        match u8::try_from(s.len()) {
            Ok(n) => f.extend_from_slice(&[SHORT_BINUNICODE, n]),
            Err(_) => {
                let n = u32::try_from(s.len())
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a string of 4 GiB or more"))?;
                f.push(BINUNICODE);
                f.extend_from_slice(&n.to_le_bytes());
            }
        }
        f.extend_from_slice(s.as_bytes());
        Ok(())
    }

    /// The 2-tuple of the next two values written: call after them.
    pub fn tuple2(&mut self) {
        self.frame.push(TUPLE2);
    }

    /// Memoizes the object just written (a string, a dict or list once its items are written,
    /// a tuple): its memo index, for [`Writer::get`]; `None` when the memo is full (4 billion
    /// objects; nothing is written then).
    pub fn memoize(&mut self) -> Option<u32> {
        let index = self.memo;
        self.memo = self.memo.checked_add(1)?;
        self.frame.push(MEMOIZE);
        Some(index)
    }

    /// The object memoized at `index`, again.
    pub fn get(&mut self, index: u32) -> io::Result<()> {
        self.boundary()?;
        match u8::try_from(index) {
            Ok(i) => self.frame.extend_from_slice(&[BINGET, i]),
            Err(_) => {
                self.frame.push(LONG_BINGET);
                self.frame.extend_from_slice(&index.to_le_bytes());
            }
        }
        Ok(())
    }

    /// An empty dict, to memoize (or not) before its items: [`Writer::open`], each key and
    /// value after [`Writer::between`], [`Writer::close`].
    pub fn dict(&mut self) -> io::Result<()> {
        self.boundary()?;
        self.frame.push(EMPTY_DICT);
        Ok(())
    }

    /// An empty list, to memoize (or not) before its items, written as a dict's.
    pub fn list(&mut self) -> io::Result<()> {
        self.boundary()?;
        self.frame.push(EMPTY_LIST);
        Ok(())
    }

    /// Opens the items of the dict or list just written, `n` of them: a `MARK` for more than
    /// one (a single item goes without).
    pub fn open(&mut self, n: usize) {
        if n > 1 {
            self.frame.push(MARK);
        }
    }

    /// Before item `i` (of more than one) of a dict (`dict`) or list: every 1,000 items,
    /// closes the batch and opens the next.
    pub fn between(&mut self, dict: bool, i: usize) {
        if i > 0 && i % BATCH == 0 {
            self.frame.extend_from_slice(&[if dict { SETITEMS } else { APPENDS }, MARK]);
        }
    }

    /// Closes the `n` items of a dict (`dict`) or list: `SETITEM` or `APPEND` for a single
    /// one, else the last batch.
    pub fn close(&mut self, dict: bool, n: usize) {
        let (one, many) = if dict { (SETITEM, SETITEMS) } else { (APPEND, APPENDS) };
        match n {
            0 => {}
            1 => self.frame.push(one),
            _ => {
                self.frame.push(many);
                // CPython's `batch_dict_exact` ends a dict of a multiple of 1,000 items with
                // an empty batch; `batch_list_exact` does not.
                if dict && n % BATCH == 0 {
                    self.frame.extend_from_slice(&[MARK, SETITEMS]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPython's `pickle.dumps(OBJ, 4)`, where `OBJ` is the Python expression below; runs
    /// python3 (as tests/history/recording.rs does: CI has it).
    fn cpython(expr: &str) -> Vec<u8> {
        let script = format!("import pickle, sys\nsys.stdout.buffer.write(pickle.dumps({expr}, 4))");
        let out = std::process::Command::new("python3").args(["-c", &script]).output().expect("python3");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    /// A dict or list of `n` items written by `item`, memoized as CPython memoizes it.
    fn container(
        w: &mut Writer<Vec<u8>>,
        dict: bool,
        n: usize,
        mut item: impl FnMut(&mut Writer<Vec<u8>>, usize),
    ) -> u32 {
        if dict {
            w.dict().unwrap()
        } else {
            w.list().unwrap()
        }
        let memo = w.memoize().unwrap();
        w.open(n);
        for i in 0..n {
            w.between(dict, i);
            item(w, i);
        }
        w.close(dict, n);
        memo
    }

    fn string(w: &mut Writer<Vec<u8>>, s: &str) -> u32 {
        w.str(s).unwrap();
        w.memoize().unwrap()
    }

    const INTS: [i64; 19] = [
        0,
        1,
        255,
        256,
        65535,
        65536,
        -1,
        -128,
        -129,
        0x7fff_ffff,
        0x8000_0000,
        -0x8000_0000,
        -0x8000_0001,
        1 << 39,
        -(1 << 39),
        -(1 << 39) - 1,
        1 << 55,
        i64::MAX,
        i64::MIN,
    ];

    /// What CPython writes for every kind of value the snapshot has, byte for byte: integers
    /// at each width's edges, floats, booleans, a 2-tuple, short and long strings (UTF-8), a
    /// list and a dict of one item, lists of 1,001 and 12,000 items and a dict of 2,000 (their
    /// batches), empty ones, the memo referred to below and above index 256, and frames (the
    /// whole is 147 KiB: three frames).
    #[test]
    fn writes_what_cpython_writes() {
        let expr = format!(
            "{{'ints': {INTS:?}, 'floats': [0.5, -1e300], 'bools': [True, False], 'pair': (3, 2**40), \
             'long': 'é' * 200, 'one': [7], 'd1': {{'xy': 1}}, 'empty': [], 'none': {{}}, \
             'odd': list(range(1001)), 'big': [f's{{i:06d}}' for i in range(12000)], \
             'many': {{f'k{{i:05d}}': i for i in range(2000)}}}}"
        );
        // The dict, then three of its objects again: by BINGET (the lists `one` and `big`), by
        // LONG_BINGET (the last string of `big`).
        let expr = format!("(lambda d: [d, d['one'], d['big'][-1], d['big']])({expr})");
        let mut w = Writer::new(Vec::new()).unwrap();
        let mut again = [0; 3];
        container(&mut w, false, 4, |w, k| {
            if k > 0 {
                return w.get(again[k - 1]).unwrap();
            }
            container(w, true, 12, |w, i| dict_item(w, i, &mut again));
        });
        assert!(again[0] < 256 && again[1] >= 256, "{again:?}");
        let ours = w.finish().unwrap();
        let theirs = cpython(&expr);
        assert!(theirs.len() > 2 * FRAME_TARGET, "{}", theirs.len());
        if ours != theirs {
            let at = ours.iter().zip(&theirs).position(|(a, b)| a != b).unwrap_or(ours.len().min(theirs.len()));
            panic!(
                "differs from CPython's at byte {at} of {} (CPython's {}): {:?} against {:?}",
                ours.len(),
                theirs.len(),
                &ours[at.saturating_sub(8)..(at + 8).min(ours.len())],
                &theirs[at.saturating_sub(8)..(at + 8).min(theirs.len())]
            );
        }
    }

    /// Entry `i` of the test's dict; `again` gets the memo indices of `one`, of the last string
    /// of `big` and of `big`.
    fn dict_item(w: &mut Writer<Vec<u8>>, i: usize, again: &mut [u32; 3]) {
        match i {
            0 => {
                string(w, "ints");
                container(w, false, INTS.len(), |w, j| w.int(INTS[j]).unwrap());
            }
            1 => {
                string(w, "floats");
                container(w, false, 2, |w, j| w.float([0.5, -1e300][j]).unwrap());
            }
            2 => {
                string(w, "bools");
                container(w, false, 2, |w, j| w.bool(j == 0).unwrap());
            }
            3 => {
                string(w, "pair");
                w.int(3).unwrap();
                w.int(1 << 40).unwrap();
                w.tuple2();
                w.memoize();
            }
            4 => {
                string(w, "long");
                string(w, &"é".repeat(200));
            }
            5 => {
                string(w, "one");
                again[0] = container(w, false, 1, |w, _| w.int(7).unwrap());
            }
            6 => {
                string(w, "d1");
                container(w, true, 1, |w, _| {
                    string(w, "xy");
                    w.int(1).unwrap();
                });
            }
            7 => {
                string(w, "empty");
                container(w, false, 0, |_, _| {});
            }
            8 => {
                string(w, "none");
                container(w, true, 0, |_, _| {});
            }
            9 => {
                string(w, "odd");
                container(w, false, 1001, |w, j| w.int(j as i64).unwrap());
            }
            10 => {
                string(w, "big");
                let mut last = 0;
                again[2] = container(w, false, 12000, |w, j| last = string(w, &format!("s{j:06}")));
                again[1] = last;
            }
            _ => {
                string(w, "many");
                container(w, true, 2000, |w, j| {
                    string(w, &format!("k{j:05}"));
                    w.int(j as i64).unwrap();
                });
            }
        }
    }
}
