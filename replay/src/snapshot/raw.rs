//! The parts of a snapshot's dict that the replay reads, taken from the decoded pickle and
//! checked: each field the wrong type, or a required one missing, is an error naming where it
//! is (`segments[3].blocks[0].size`) and what was expected. A key that is absent and a value
//! of None read the same. Only these fields are visited, so the walk is as deep as the
//! snapshot's layout, whatever the pickle nests elsewhere (frames are never visited).

use crate::pickle::{Pickled, Value};

/// A snapshot's segments, trace entries and recorded configuration; strings borrowed from the
/// pickle.
pub(super) struct Raw<'p> {
    pub segments: Vec<Segment<'p>>,
    /// Device `d`'s entries at index `d`.
    pub device_traces: Vec<Vec<Entry<'p>>>,
    /// `allocator_settings.PYTORCH_CUDA_ALLOC_CONF`, where present; with `expandable_segments:True`
    /// after it when `allocator_settings.expandable_segments` is true and the text does not
    /// name the key (PyTorch keeps the last string set, which need not name a key an earlier
    /// one set).
    pub conf: Option<String>,
}

pub(super) struct Segment<'p> {
    pub device: u64,
    pub address: u64,
    pub total_size: u64,
    pub stream: i64,
    pub blocks: Vec<Block<'p>>,
}

pub(super) struct Block<'p> {
    pub size: u64,
    pub requested_size: Option<u64>,
    pub address: Option<u64>,
    pub state: &'p str,
}

pub(super) struct Entry<'p> {
    pub action: &'p str,
    pub addr: Option<u64>,
    pub size: u64,
    pub stream: i64,
}

/// Whether a dict key is one the replay reads: the decoder keeps only the items of these keys
/// ([`crate::pickle::read`]).
pub(super) fn is_read(key: &str) -> bool {
    matches!(
        key,
        "segments"
            | "device_traces"
            | "allocator_settings"
            | "PYTORCH_CUDA_ALLOC_CONF"
            | "expandable_segments"
            | "device"
            | "address"
            | "total_size"
            | "stream"
            | "blocks"
            | "size"
            | "requested_size"
            | "state"
            | "action"
            | "addr"
    )
}

/// What the root must be, for messages.
const EXPECTED: &str = "the dict of torch.cuda.memory._snapshot(), with 'segments' and 'device_traces' (torch.cuda.memory._dump_snapshot() writes it)";

/// Reads the fields of `p`'s root.
///
/// Errors: the root is not a dict with `segments` or `device_traces`, or a field the replay
/// reads is missing or of the wrong type; the message names it.
pub(super) fn read(p: &Pickled) -> Result<Raw<'_>, String> {
    let root = p.root;
    if p.dict(root).is_none() {
        return Err(format!("expected {EXPECTED}; found {}", p.root.kind()));
    }
    let r = Fields(p);
    let (segments, traces) = (r.field(root, "segments"), r.field(root, "device_traces"));
    if segments.is_none() && traces.is_none() {
        return Err(format!("expected {EXPECTED}; found a dict without either"));
    }
    let segments = match segments {
        None => Vec::new(),
        Some(s) => r
            .list(s, &|| "segments".into())?
            .iter()
            .enumerate()
            .map(|(i, &s)| r.segment(s, i))
            .collect::<Result<_, _>>()?,
    };
    let mut device_traces = Vec::new();
    if let Some(t) = traces {
        for (d, &entries) in r.list(t, &|| "device_traces".into())?.iter().enumerate() {
            let at = |j: usize| move || format!("device_traces[{d}][{j}]");
            let entries = r.list(entries, &|| format!("device_traces[{d}]"))?;
            device_traces.push(entries.iter().enumerate().map(|(j, &e)| r.entry(e, &at(j))).collect::<Result<_, _>>()?);
        }
    }
    let conf = match r.field(root, "allocator_settings") {
        None => None,
        Some(s) => {
            r.dict(s, &|| "allocator_settings".into())?;
            match r.field(s, "PYTORCH_CUDA_ALLOC_CONF") {
                None => None,
                Some(c) => {
                    let text = r.string(c, &|| "allocator_settings.PYTORCH_CUDA_ALLOC_CONF".into())?;
                    let expandable = r.field(s, "expandable_segments") == Some(Value::Bool(true));
                    Some(match text.trim() {
                        t if !expandable || t.contains("expandable_segments") => text.to_string(),
                        "" => "expandable_segments:True".to_string(),
                        t => format!("{t},expandable_segments:True"),
                    })
                }
            }
        }
    };
    Ok(Raw { segments, device_traces, conf })
}

/// Reading typed fields out of the pickle, with where they are for the messages.
struct Fields<'p>(&'p Pickled);

type At<'a> = &'a dyn Fn() -> String;

impl<'p> Fields<'p> {
    /// The value of `key` in dict `d`; None when absent or None.
    fn field(&self, d: Value, key: &str) -> Option<Value> {
        self.0.get(d, key).filter(|v| *v != Value::None)
    }

    fn wrong(&self, v: Value, at: At, expected: &str) -> String {
        format!("{} is {}, expected {expected}", at(), v.kind())
    }

    fn dict(&self, v: Value, at: At) -> Result<(), String> {
        self.0.dict(v).map(|_| ()).ok_or_else(|| self.wrong(v, at, "a dict"))
    }

    fn list(&self, v: Value, at: At) -> Result<&'p [Value], String> {
        self.0.items(v).ok_or_else(|| self.wrong(v, at, "a list"))
    }

    fn string(&self, v: Value, at: At) -> Result<&'p str, String> {
        self.0.str(v).ok_or_else(|| self.wrong(v, at, "a string"))
    }

    fn int(&self, v: Value, at: At) -> Result<i64, String> {
        match v {
            Value::Int(n) => Ok(n),
            _ => Err(self.wrong(v, at, "an integer")),
        }
    }

    fn uint(&self, v: Value, at: At) -> Result<u64, String> {
        match v {
            Value::Int(n) if n >= 0 => Ok(n as u64),
            Value::Int(n) => Err(format!("{} is {n}, expected an integer of 0 or more", at())),
            _ => Err(self.wrong(v, at, "an integer of 0 or more")),
        }
    }

    /// A CUDA device ordinal, an `int` (PyTorch's `DeviceIndex` is narrower still).
    fn device(&self, v: Value, at: At) -> Result<u64, String> {
        match self.uint(v, at)? {
            d if d <= i32::MAX as u64 => Ok(d),
            d => Err(format!("{} is {d}, expected a device number (a CUDA device ordinal, below 2^31)", at())),
        }
    }

    /// Field `key` of dict `d` (at `at`), read by `read`: None when absent.
    fn opt<T>(
        &self,
        d: Value,
        key: &str,
        at: At,
        read: impl Fn(&Self, Value, At) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        match self.field(d, key) {
            None => Ok(None),
            Some(v) => read(self, v, &|| format!("{}.{key}", at())).map(Some),
        }
    }

    /// As [`Fields::opt`], for a field that must be there.
    fn req<T>(
        &self,
        d: Value,
        key: &str,
        at: At,
        read: impl Fn(&Self, Value, At) -> Result<T, String>,
    ) -> Result<T, String> {
        self.opt(d, key, at, read)?.ok_or_else(|| format!("{} has no '{key}'", at()))
    }

    fn segment(&self, s: Value, i: usize) -> Result<Segment<'p>, String> {
        let at = || format!("segments[{i}]");
        self.dict(s, &at)?;
        let blocks = match self.opt(s, "blocks", &at, Self::list)? {
            None => Vec::new(),
            Some(b) => b
                .iter()
                .enumerate()
                .map(|(j, &b)| self.block(b, &|| format!("segments[{i}].blocks[{j}]")))
                .collect::<Result<_, _>>()?,
        };
        Ok(Segment {
            device: self.opt(s, "device", &at, Self::device)?.unwrap_or(0),
            address: self.req(s, "address", &at, Self::uint)?,
            total_size: self.req(s, "total_size", &at, Self::uint)?,
            stream: self.opt(s, "stream", &at, Self::int)?.unwrap_or(0),
            blocks,
        })
    }

    fn block(&self, b: Value, at: At) -> Result<Block<'p>, String> {
        self.dict(b, at)?;
        Ok(Block {
            size: self.req(b, "size", at, Self::uint)?,
            requested_size: self.opt(b, "requested_size", at, Self::uint)?,
            address: self.opt(b, "address", at, Self::uint)?,
            state: self.req(b, "state", at, Self::string)?,
        })
    }

    fn entry(&self, e: Value, at: At) -> Result<Entry<'p>, String> {
        self.dict(e, at)?;
        Ok(Entry {
            action: self.req(e, "action", at, Self::string)?,
            addr: self.opt(e, "addr", at, Self::uint)?,
            size: self.opt(e, "size", at, Self::uint)?.unwrap_or(0),
            stream: self.opt(e, "stream", at, Self::int)?.unwrap_or(0),
        })
    }
}
