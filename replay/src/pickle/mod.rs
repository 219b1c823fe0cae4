//! A pickle reader of the replay's own, for PyTorch's memory snapshots: CPython's pickle
//! machine (`Lib/pickle.py`, `_Unpickler`) over a stream, building plain data only.
//!
//! Why not serde-pickle: PyTorch's snapshots share objects (the action and state strings, the
//! keys, the frame dicts and frame lists are each one Python object referred to from many
//! places), which the pickler writes once and refers to again through its memo (`BINGET` of a
//! `MEMOIZE`d object). serde-pickle 1.2 resolves memo references by cloning or moving values
//! and, for objects held inside shared ones, fails or (with `replace_recursive_structures`)
//! reads them as None (birkenfeld/serde-pickle#24); it also recurses (a deeply nested pickle
//! overflows the stack) and needs the whole file in memory.
//!
//! Here every list, tuple and dict lives once in an arena ([`Pickled`]) and a [`Value`] names
//! it by its index, as the pickle's memo does: a shared object is read once and referred to
//! any number of times, a recursive one is just an index to itself, nothing recurses, and
//! dropping the arena is flat. Memory is charged to a [`Budget`] as objects are made.
//!
//! Opcodes: every one of protocols 0 to 5 but the persistent ids (`PERSID`, `BINPERSID`) and
//! out-of-band buffers (`NEXT_BUFFER`), which need the unpickler's caller and which no snapshot
//! has: those fail, naming the opcode. Nothing is ever called: a global, or an object built by
//! `REDUCE`, `NEWOBJ`, `INST`, `OBJ` or `BUILD`, is [`Value::Other`], as are bytes, sets,
//! integers beyond 64 bits and strings longer than [`MAX_KEPT_STRING`], which the replay never
//! reads: their contents are skipped.
//!
//! `input.rs`: the bytes of a pickle as its opcodes read them (arguments, lengths, counted
//! strings, text lines); `ops.rs`: the machine, one opcode at a time on a stack with marks;
//! this file: the arena, the values and the reader.

mod input;
mod ops;

use std::collections::HashMap;
use std::io::BufRead;

use crate::limits::Budget;

/// Strings longer than this (bytes of UTF-8) are skipped, read as [`Value::Other`]: no string
/// that the replay reads (an action, a block state, a key, a configuration) comes near.
pub const MAX_KEPT_STRING: usize = 1 << 20;

/// A value of the pickle: a scalar, or the index of a string or container in [`Pickled`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Value {
    /// Python's None.
    #[default]
    None,
    /// A bool.
    Bool(bool),
    /// An int that fits in 64 bits.
    Int(i64),
    /// A float.
    Float(f64),
    /// A str: [`Pickled::str`].
    Str(u32),
    /// A list: [`Pickled::items`].
    List(u32),
    /// A tuple (kept with the lists): [`Pickled::items`].
    Tuple(u32),
    /// A dict: [`Pickled::dict`].
    Dict(u32),
    /// Something the replay does not read, named for messages ("bytes", "a set"...).
    Other(&'static str),
}

impl Value {
    /// What the value is, for messages: "None", "an integer", "a list"...
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "a bool",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::Str(_) => "a string",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Dict(_) => "a dict",
            Value::Other(what) => what,
        }
    }
}

/// A decoded pickle: its root, and the strings and containers its values name.
#[derive(Debug, Default)]
pub struct Pickled {
    /// The object the pickle holds (what `pickle.load` returns).
    pub root: Value,
    strings: Vec<Box<str>>,
    /// Lists and tuples.
    lists: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
}

impl Pickled {
    /// The text of `v` when it is a string.
    pub fn str(&self, v: Value) -> Option<&str> {
        match v {
            Value::Str(i) => Some(&self.strings[i as usize]),
            _ => None,
        }
    }

    /// The items of `v` when it is a list or a tuple.
    pub fn items(&self, v: Value) -> Option<&[Value]> {
        match v {
            Value::List(i) | Value::Tuple(i) => Some(&self.lists[i as usize]),
            _ => None,
        }
    }

    /// The (key, value) pairs of `v` when it is a dict, in the order they were set (a key set
    /// twice is there twice: [`Pickled::get`] takes the later one, as Python's dict does).
    pub fn dict(&self, v: Value) -> Option<&[(Value, Value)]> {
        match v {
            Value::Dict(i) => Some(&self.dicts[i as usize]),
            _ => None,
        }
    }

    /// The value of the string key `key` in dict `d`: None when `d` has no such key (or is not
    /// a dict).
    pub fn get(&self, d: Value, key: &str) -> Option<Value> {
        self.dict(d)?.iter().rev().find(|(k, _)| self.str(*k) == Some(key)).map(|&(_, v)| v)
    }
}

/// The memo: objects by the number the pickle gave them. Dense as CPython writes it (each
/// object numbered by the memo's size), with a map for numbers out of that order.
#[derive(Default)]
struct Memo {
    dense: Vec<Value>,
    sparse: HashMap<u32, Value>,
}

impl Memo {
    fn put(&mut self, i: u32, v: Value, budget: &mut Budget) -> Result<(), String> {
        let at = i as usize;
        if at < self.dense.len() {
            self.dense[at] = v;
        } else if at == self.dense.len() {
            budget.charge(16)?;
            self.dense.push(v);
            while let Some(v) = self.sparse.remove(&(self.dense.len() as u32)) {
                self.dense.push(v);
            }
        } else {
            budget.charge(48)?;
            self.sparse.insert(i, v);
        }
        Ok(())
    }

    fn get(&self, i: u32) -> Option<Value> {
        self.dense.get(i as usize).or_else(|| self.sparse.get(&i)).copied()
    }

    /// The number `MEMOIZE` gives: the memo's size, as `len(self.memo)` in CPython.
    fn len(&self) -> u32 {
        (self.dense.len() + self.sparse.len()) as u32
    }
}

/// Reads one pickle from `r` (up to its `STOP`; what follows is not read). Of each dict, only
/// the items whose key is not a string or is a string that `keep_key` keeps are kept: the
/// caller will never look the others up, and a snapshot's entries hold more of those (times,
/// frames, metadata) than of the fields the replay reads.
///
/// Errors: the bytes are not a pickle (an unknown opcode, a `MARK` missing, a memo number not
/// set...; the message gives the byte's offset), the input ends early or fails, or the
/// objects would take more memory than `budget` has.
pub fn read(r: impl BufRead, budget: &mut Budget, keep_key: fn(&str) -> bool) -> Result<Pickled, String> {
    let mut m = ops::Machine::new(r, budget, keep_key);
    let root = m.run()?;
    Ok(m.finish(root))
}
