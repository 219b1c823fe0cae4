//! The pickle machine: one opcode at a time, as CPython's `_Unpickler.load` runs them, on a
//! stack of [`Value`]s with marks, building containers in the arena of [`Pickled`].

use std::io::BufRead;

use super::input::{Input, bad, long, text_int, unquote};
use super::{MAX_KEPT_STRING, Memo, Pickled, Value};
use crate::limits::Budget;

/// What one value costs on the stack or in a container, and a container's own cost.
const VALUE: u64 = 16;
const CONTAINER: u64 = 24;

pub(super) struct Machine<'b, R> {
    i: Input<R>,
    stack: Vec<Value>,
    /// The most values the stack has held: what its memory was charged for.
    stack_high: usize,
    /// The stack's length at each `MARK` not yet popped.
    marks: Vec<usize>,
    memo: Memo,
    out: Pickled,
    /// Whether a dict item with the string key of each string (by index) is kept.
    key_kept: Vec<bool>,
    keep_key: fn(&str) -> bool,
    budget: &'b mut Budget,
}

impl<'b, R: BufRead> Machine<'b, R> {
    pub(super) fn new(r: R, budget: &'b mut Budget, keep_key: fn(&str) -> bool) -> Machine<'b, R> {
        Machine {
            i: Input::new(r),
            stack: Vec::new(),
            stack_high: 0,
            marks: Vec::new(),
            memo: Memo::default(),
            out: Pickled::default(),
            key_kept: Vec::new(),
            keep_key,
            budget,
        }
    }

    pub(super) fn finish(mut self, root: Value) -> Pickled {
        self.out.root = root;
        self.out
    }

    fn push(&mut self, v: Value) -> Result<(), String> {
        // The stack's memory: charged as it grows past its highest yet.
        if self.stack.len() == self.stack_high {
            self.budget.charge(VALUE)?;
            self.stack_high += 1;
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self, at: u64) -> Result<Value, String> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return Err(bad(at, "an opcode takes a value from an empty stack"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self, at: u64) -> Result<Value, String> {
        match self.stack.last() {
            Some(&v) if self.stack.len() > self.marks.last().copied().unwrap_or(0) => Ok(v),
            _ => Err(bad(at, "an opcode needs a value on an empty stack")),
        }
    }

    /// The values since the last mark, which is popped.
    fn pop_mark(&mut self, at: u64) -> Result<Vec<Value>, String> {
        let mark = self.marks.pop().ok_or_else(|| bad(at, "no MARK for an opcode that needs one"))?;
        Ok(self.stack.split_off(mark))
    }

    fn string(&mut self, bytes: Option<Vec<u8>>, at: u64) -> Result<Value, String> {
        let Some(bytes) = bytes else {
            return Ok(Value::Other("a string too long to keep"));
        };
        let s = String::from_utf8(bytes).map_err(|_| bad(at, "a string that is not UTF-8"))?;
        let i = index(self.out.strings.len(), at)?;
        self.key_kept.push((self.keep_key)(&s));
        self.out.strings.push(s.into_boxed_str());
        Ok(Value::Str(i))
    }

    fn new_list(&mut self, items: Vec<Value>, tuple: bool, at: u64) -> Result<Value, String> {
        self.budget.charge(CONTAINER + VALUE * items.len() as u64)?;
        let i = index(self.out.lists.len(), at)?;
        self.out.lists.push(items);
        Ok(if tuple { Value::Tuple(i) } else { Value::List(i) })
    }

    fn new_dict(&mut self, items: Vec<Value>, at: u64) -> Result<Value, String> {
        self.budget.charge(CONTAINER)?;
        let i = index(self.out.dicts.len(), at)?;
        self.out.dicts.push(Vec::new());
        self.set_items(Value::Dict(i), items, at)?;
        Ok(Value::Dict(i))
    }

    /// `APPEND`, `APPENDS`: to a list; to an object (whose `append` is never called), dropped.
    fn append(&mut self, target: Value, items: Vec<Value>, at: u64) -> Result<(), String> {
        match target {
            Value::List(i) => {
                self.budget.charge(VALUE * items.len() as u64)?;
                self.out.lists[i as usize].extend(items);
            }
            Value::Other(_) => {}
            other => return Err(bad(at, format!("APPEND to {}", other.kind()))),
        }
        Ok(())
    }

    /// `SETITEM`, `SETITEMS`: `items` are keys and values in turn.
    fn set_items(&mut self, target: Value, items: Vec<Value>, at: u64) -> Result<(), String> {
        if items.len() % 2 != 0 {
            return Err(bad(at, "a dict's items are an odd number of values"));
        }
        match target {
            Value::Dict(i) => {
                let kept = |k: &Value| !matches!(*k, Value::Str(s) if !self.key_kept[s as usize]);
                let items: Vec<_> = items.chunks_exact(2).map(|kv| (kv[0], kv[1])).filter(|(k, _)| kept(k)).collect();
                self.budget.charge(2 * VALUE * items.len() as u64)?;
                self.out.dicts[i as usize].extend(items);
            }
            Value::Other(_) => {}
            other => return Err(bad(at, format!("SETITEM on {}", other.kind()))),
        }
        Ok(())
    }

    /// The value under the mark: what `APPENDS`, `SETITEMS` and `ADDITEMS` add to.
    fn under_mark(&mut self, at: u64) -> Result<(Value, Vec<Value>), String> {
        let items = self.pop_mark(at)?;
        let target = self.top(at)?;
        Ok((target, items))
    }

    fn memo_get(&self, i: u32, at: u64) -> Result<Value, String> {
        self.memo.get(i).ok_or_else(|| bad(at, format!("memo {i} was never set")))
    }

    fn memo_put(&mut self, i: u32, at: u64) -> Result<(), String> {
        let v = self.top(at)?;
        self.memo.put(i, v, self.budget)
    }

    /// Runs the opcodes up to `STOP`; returns the object it returns.
    pub(super) fn run(&mut self) -> Result<Value, String> {
        loop {
            let at = self.i.pos;
            let op = self.i.byte()?;
            let v = match op {
                b'.' => return self.pop(at),
                b'(' => {
                    self.marks.push(self.stack.len());
                    continue;
                }
                b'0' => {
                    // POP: the top value, or the mark when none is above it.
                    if self.stack.len() > self.marks.last().copied().unwrap_or(0) {
                        self.stack.pop();
                    } else {
                        self.pop_mark(at)?;
                    }
                    continue;
                }
                b'1' => {
                    self.pop_mark(at)?;
                    continue;
                }
                b'2' => self.top(at)?,
                b'N' => Value::None,
                0x88 => Value::Bool(true),
                0x89 => Value::Bool(false),
                b'J' => Value::Int(i32::from_le_bytes(self.i.array()?).into()),
                b'K' => Value::Int(self.i.byte()?.into()),
                b'M' => Value::Int(u16::from_le_bytes(self.i.array()?).into()),
                0x8a => {
                    let n = self.i.byte()?;
                    long(self.i.bytes(n.into(), 8, self.budget)?)
                }
                0x8b => {
                    let n = self.i.i32_len(at)?;
                    long(self.i.bytes(n, 8, self.budget)?)
                }
                b'I' | b'L' => text_int(&self.i.line(at)?, op == b'I').ok_or_else(|| bad(at, "not an integer"))?,
                b'F' => Value::Float(self.i.line(at)?.trim().parse().map_err(|_| bad(at, "not a float"))?),
                b'G' => Value::Float(f64::from_be_bytes(self.i.array()?)),
                b'X' => {
                    let n = self.i.u32()?.into();
                    let b = self.i.bytes(n, MAX_KEPT_STRING, self.budget)?;
                    self.string(b, at)?
                }
                0x8c => {
                    let n = self.i.byte()?.into();
                    let b = self.i.bytes(n, MAX_KEPT_STRING, self.budget)?;
                    self.string(b, at)?
                }
                0x8d => {
                    let n = self.i.u64()?;
                    let b = self.i.bytes(n, MAX_KEPT_STRING, self.budget)?;
                    self.string(b, at)?
                }
                // Python 2's str, which Python 3 reads as str (ASCII).
                b'T' | b'U' => {
                    let n = if op == b'T' { self.i.i32_len(at)? } else { self.i.byte()?.into() };
                    let b = self.i.bytes(n, MAX_KEPT_STRING, self.budget)?;
                    self.string(b, at)?
                }
                // The text forms: kept when they hold no escapes, which are not decoded here.
                b'S' | b'V' => {
                    let line = self.i.line(at)?;
                    let text = if op == b'S' { unquote(line.trim()) } else { Some(line.as_str()) };
                    match text.filter(|t| !t.contains('\\')) {
                        Some(t) => self.string(Some(t.as_bytes().to_vec()), at)?,
                        None => Value::Other("a string with escapes"),
                    }
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => self.i.u32()?.into(),
                        b'C' => self.i.byte()?.into(),
                        _ => self.i.u64()?,
                    };
                    self.i.bytes(n, 0, self.budget)?;
                    Value::Other("bytes")
                }
                b']' => self.new_list(Vec::new(), false, at)?,
                b')' => self.new_list(Vec::new(), true, at)?,
                b'}' => self.new_dict(Vec::new(), at)?,
                b'l' => {
                    let items = self.pop_mark(at)?;
                    self.new_list(items, false, at)?
                }
                b't' => {
                    let items = self.pop_mark(at)?;
                    self.new_list(items, true, at)?
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop(at)?);
                    }
                    items.reverse();
                    self.new_list(items, true, at)?
                }
                b'd' => {
                    let items = self.pop_mark(at)?;
                    self.new_dict(items, at)?
                }
                b'a' => {
                    let item = self.pop(at)?;
                    let target = self.top(at)?;
                    self.append(target, vec![item], at)?;
                    continue;
                }
                b'e' => {
                    let (target, items) = self.under_mark(at)?;
                    self.append(target, items, at)?;
                    continue;
                }
                b's' => {
                    let value = self.pop(at)?;
                    let key = self.pop(at)?;
                    let target = self.top(at)?;
                    self.set_items(target, vec![key, value], at)?;
                    continue;
                }
                b'u' => {
                    let (target, items) = self.under_mark(at)?;
                    self.set_items(target, items, at)?;
                    continue;
                }
                // Sets: their items are not kept.
                0x8f => Value::Other("a set"),
                0x90 => {
                    self.under_mark(at)?;
                    continue;
                }
                0x91 => {
                    self.pop_mark(at)?;
                    Value::Other("a set")
                }
                b'g' => {
                    let n =
                        self.i.line(at)?.trim().parse().map_err(|_| bad(at, "GET of a memo number that is not one"))?;
                    self.memo_get(n, at)?
                }
                b'h' => {
                    let n = self.i.byte()?.into();
                    self.memo_get(n, at)?
                }
                b'j' => {
                    let n = self.i.u32()?;
                    self.memo_get(n, at)?
                }
                b'p' | b'q' | b'r' | 0x94 => {
                    let n = match op {
                        b'p' => self
                            .i
                            .line(at)?
                            .trim()
                            .parse()
                            .map_err(|_| bad(at, "PUT of a memo number that is not one"))?,
                        b'q' => self.i.byte()?.into(),
                        b'r' => self.i.u32()?,
                        _ => self.memo.len(),
                    };
                    self.memo_put(n, at)?;
                    continue;
                }
                0x80 => {
                    let p = self.i.byte()?;
                    if p > 5 {
                        return Err(bad(at, format!("protocol {p}, above 5, the highest there is")));
                    }
                    continue;
                }
                0x95 => {
                    // FRAME: a length the stream does not need.
                    self.i.u64()?;
                    continue;
                }
                0x98 => continue,
                // Globals and objects: never looked up or called.
                b'c' => {
                    self.i.line(at)?;
                    self.i.line(at)?;
                    Value::Other("a global")
                }
                0x93 => {
                    self.pop(at)?;
                    self.pop(at)?;
                    Value::Other("a global")
                }
                0x82 => {
                    self.i.byte()?;
                    Value::Other("a global")
                }
                0x83 => {
                    self.i.array::<2>()?;
                    Value::Other("a global")
                }
                0x84 => {
                    self.i.array::<4>()?;
                    Value::Other("a global")
                }
                b'R' | 0x81 | 0x92 => {
                    for _ in 0..if op == 0x92 { 3 } else { 2 } {
                        self.pop(at)?;
                    }
                    Value::Other("an object")
                }
                b'i' => {
                    self.i.line(at)?;
                    self.i.line(at)?;
                    self.pop_mark(at)?;
                    Value::Other("an object")
                }
                b'o' => {
                    self.pop_mark(at)?;
                    Value::Other("an object")
                }
                b'b' => {
                    // BUILD: the state is set on the object below it, which stays.
                    self.pop(at)?;
                    self.top(at)?;
                    continue;
                }
                b'P' | b'Q' | 0x97 => {
                    let name = match op {
                        b'P' => "PERSID",
                        b'Q' => "BINPERSID",
                        _ => "NEXT_BUFFER",
                    };
                    return Err(bad(at, format!("{name}, which needs the unpickler's caller: not a snapshot")));
                }
                other => return Err(bad(at, format!("unknown opcode 0x{other:02x}"))),
            };
            self.push(v)?;
        }
    }
}

/// An arena index for the `len`th object.
fn index(len: usize, at: u64) -> Result<u32, String> {
    u32::try_from(len).map_err(|_| format!("not a pickle the replay reads, at byte {at}: over 2^32 objects of a kind"))
}
