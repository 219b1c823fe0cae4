//! `GPUPOOL_CONF`: PyTorch's allocator configuration string (`PYTORCH_ALLOC_CONF`, formerly
//! `PYTORCH_CUDA_ALLOC_CONF`), read as PyTorch 2.11 reads it for its native CUDA backend
//! (`c10/core/AllocatorConfig.{h,cpp}`: `ConfigTokenizer`, `AcceleratorAllocatorConfig::parseArgs`;
//! `c10/cuda/CUDAAllocatorConfig.{h,cpp}`: `CUDAAllocatorConfig::parseArgs`). Every key of
//! [`CONF_KEYS`] is a field of [`Config`].
//!
//! The syntax, PyTorch's:
//! - `key:value` entries separated by `,`; a list value is `[a:b,c:d,...]`. Spaces and other
//!   white space are ignored wherever they are, as PyTorch's tokenizer drops them. An empty
//!   string sets nothing. A `,` after the last entry, or after the last item of a list, is
//!   allowed, as in PyTorch.
//! - Keys are matched exactly (case counts), as are the booleans `True` and `False`.
//! - A key given twice: each occurrence is applied in order, so the last one wins; for
//!   `roundup_power2_divisions` each occurrence changes only the intervals it names (PyTorch
//!   keeps one table and writes into it).
//! - `large_segment_size_mb` is read before every other key wherever it stands, and sets the
//!   default of `max_non_split_rounding_mb` and the floor of both `*_mb` limits (PyTorch 2.11
//!   reads it in a first pass for that reason).
//!
//! What PyTorch 2.11 lets through and gpupool refuses, each an [`Error::InvalidValue`] naming the
//! key and the value (PyTorch reads numbers with `std::stoull`/`std::stod`, which stop at the
//! first character that does not fit, and it never checks that a separator is the one it
//! expects):
//! - a number with anything after it (`64MB`, `0.5x`), a sign (`-1` wraps to a huge number in
//!   PyTorch), or a fraction where a whole number is expected (`30.5`);
//! - a separator other than the one expected (`max_split_size_mb,64`, `max_split_size_mb:64:65`,
//!   `[256:1;512:2]`).

use std::fmt::Write;

use super::Config;
use crate::error::Error;

const MIB: usize = 1 << 20;

/// The environment variable that holds the configuration string.
pub const CONF_VAR: &str = "GPUPOOL_CONF";

/// Power-of-two size intervals of `roundup_power2_divisions`: interval `i` holds the sizes
/// from `2^i` MiB up to `2^(i+1)` MiB (the first also every smaller size, the last every larger
/// one), 1 MiB to 64 GiB (PyTorch `kRoundUpPowerOfTwoIntervals`).
/// cbindgen:ignore
pub const ROUNDUP_INTERVALS: usize = 16;

/// `large_segment_size_mb` must be more than this many MiB (PyTorch: `kMinLargeAlloc / kMB`).
const MIN_LARGE_SEGMENT_MB: usize = 10;
/// The largest count of MiB that fits `usize` in bytes; PyTorch clamps the `*_mb` values to it.
const MAX_MB: usize = usize::MAX / MIB;
/// `pinned_num_register_threads` at most (PyTorch `pinned_max_register_threads`).
const MAX_REGISTER_THREADS: usize = 128;

/// One key of `GPUPOOL_CONF`: a row of [`CONF_KEYS`].
pub struct ConfKey {
    /// The key, as PyTorch spells it.
    pub key: &'static str,
    /// Other spellings PyTorch's CUDA build accepts for the same key (its ROCm names).
    pub also: &'static [&'static str],
    /// What the value must be (the list's value column).
    pub value: &'static str,
    /// The default, as written in the string.
    pub default: &'static str,
    /// What it does in PyTorch, and in gpupool where that differs (the meaning column).
    pub doc: &'static str,
    apply: fn(&mut Config, &Raw) -> Result<(), String>,
    show: fn(&Config) -> Option<String>,
}

/// Every key of PyTorch 2.11's native CUDA backend, in the order the configuration string
/// shows them ([`Config::conf_string`]).
pub static CONF_KEYS: [ConfKey; 14] = [
    ConfKey {
        key: "backend",
        also: &[],
        value: "`native`",
        default: "native",
        doc: "The allocator behind PyTorch. gpupool is PyTorch's native caching allocator; `cudaMallocAsync` is \
              an error.",
        apply: |_, v| match v.word()? {
            "native" => Ok(()),
            "cudaMallocAsync" => Err("native: gpupool is PyTorch's native caching allocator, it has no \
                                      cudaMallocAsync backend"
                .into()),
            _ => Err("native (PyTorch's options are native and cudaMallocAsync)".into()),
        },
        show: |_| Some("native".into()),
    },
    ConfKey {
        key: "large_segment_size_mb",
        also: &[],
        value: "whole MiB, more than 10",
        default: "20",
        doc: "Size of the segments that requests over 1 MiB and under 10 MiB are carved from (PyTorch \
              `get_allocation_size`; `kLargeBuffer` before 2.11). Also the default of \
              `max_non_split_rounding_mb` and the floor of both `*_mb` limits.",
        apply: |c, v| {
            let mb = v.count()?;
            if mb <= MIN_LARGE_SEGMENT_MB {
                return Err(format!("a whole number of MiB more than {MIN_LARGE_SEGMENT_MB}"));
            }
            c.large_segment_size = mb.min(MAX_MB) * MIB;
            Ok(())
        },
        show: |c| Some((c.large_segment_size / MIB).to_string()),
    },
    ConfKey {
        key: "max_split_size_mb",
        also: &[],
        value: "whole MiB, at least `large_segment_size_mb`",
        default: "unlimited (17592186044415, the largest)",
        doc: "Cached blocks of at least this size are never split, and serve only requests of about their size \
              (PyTorch `max_split_size`). The largest value, 17592186044415, means unlimited.",
        apply: |c, v| {
            let mb = mb_at_least_large_segment(c, v)?;
            c.max_split_size = if mb >= MAX_MB { usize::MAX } else { mb * MIB };
            Ok(())
        },
        show: |c| Some(if c.max_split_size == usize::MAX { MAX_MB } else { c.max_split_size / MIB }.to_string()),
    },
    ConfKey {
        key: "max_non_split_rounding_mb",
        also: &[],
        value: "whole MiB, at least `large_segment_size_mb`",
        default: "`large_segment_size_mb` (20)",
        doc: "A request of at least `max_split_size_mb` takes a cached block only if the block is less than this \
              much larger (PyTorch `get_free_block`).",
        apply: |c, v| {
            let mb = mb_at_least_large_segment(c, v)?;
            c.max_non_split_rounding = mb.min(MAX_MB) * MIB;
            Ok(())
        },
        show: |c| Some((c.max_non_split_rounding / MIB).to_string()),
    },
    ConfKey {
        key: "roundup_power2_divisions",
        also: &[],
        value: "a power of two, or a list `[MiB:divisions,...,>:divisions]`",
        default: "0 in every interval",
        doc: "Requests are rounded up to one of this many equal steps between two powers of two, instead of to \
              512 bytes (PyTorch `round_size`, `roundup_power2_next_division`); 0 or 1 leaves the 512-byte rounding. \
              A list sets it per interval: `MiB` a power of two naming the sizes from that many MiB to twice as \
              many (the first also sets every interval below it), `>` every interval after the last one named; \
              each divisions 0 or a power of two.",
        apply: apply_roundup,
        show: |c| Some(show_roundup(&c.roundup_power2_divisions)),
    },
    ConfKey {
        key: "garbage_collection_threshold",
        also: &[],
        value: "a number over 0 and under 1",
        default: "off (0, which cannot be written)",
        doc: "With a memory fraction set (`per_process_memory_fraction` or `gpupool_set_memory_fraction`): once \
              reserved memory passes this fraction of the memory allowed, a request that finds no cached block first \
              releases whole free segments of the large pool, the longest unused first, until reserved memory is \
              back under it (PyTorch `garbage_collect_cached_blocks`; gpupool gathers every stream's segments and \
              ages a block by the blocks its stream freed since). Left out of the configuration string while off.",
        apply: |c, v| {
            let x = v.number()?;
            if !(x > 0.0 && x < 1.0) {
                return Err("a number over 0 and under 1".into());
            }
            c.garbage_collection_threshold = x;
            Ok(())
        },
        show: |c| (c.garbage_collection_threshold > 0.0).then(|| c.garbage_collection_threshold.to_string()),
    },
    ConfKey {
        key: "expandable_segments",
        also: &[],
        value: "`True` or `False`",
        default: "False",
        doc: "Segments that grow by mapping more memory into one reserved address range (PyTorch \
              `ExpandableSegment`).",
        apply: |c, v| v.boolean().map(|b| c.expandable_segments = b),
        show: |c| Some(show_bool(c.expandable_segments)),
    },
    ConfKey {
        key: "release_lock_on_cudamalloc",
        also: &["release_lock_on_hipmalloc"],
        value: "`True` or `False`",
        default: "False",
        doc: "PyTorch releases its device lock across `cudaMalloc`. Accepted and changes nothing: gpupool holds \
              one lock per stream across `cuMemAlloc`, which blocks only that stream's callers.",
        apply: |c, v| v.boolean().map(|b| c.release_lock_on_cudamalloc = b),
        show: |c| Some(show_bool(c.release_lock_on_cudamalloc)),
    },
    ConfKey {
        key: "per_process_memory_fraction",
        also: &[],
        value: "a number from 0 to 1",
        default: "1",
        doc: "Each device, when it starts, reserves at most this fraction of its total memory, as \
              `gpupool_set_memory_fraction` sets it (PyTorch `setMemoryFraction`).",
        apply: |c, v| {
            let x = v.number()?;
            if !(0.0..=1.0).contains(&x) {
                return Err("a number from 0 to 1".into());
            }
            c.per_process_memory_fraction = x;
            Ok(())
        },
        show: |c| Some(c.per_process_memory_fraction.to_string()),
    },
    ConfKey {
        key: "graph_capture_record_stream_reuse",
        also: &[],
        value: "`True` or `False`",
        default: "False",
        doc: "PyTorch: during CUDA graph capture, blocks freed after `record_stream` may be reused within the \
              graph. Accepted and changes nothing: gpupool has no graph capture.",
        apply: |c, v| v.boolean().map(|b| c.graph_capture_record_stream_reuse = b),
        show: |c| Some(show_bool(c.graph_capture_record_stream_reuse)),
    },
    ConfKey {
        key: "pinned_use_cuda_host_register",
        also: &["pinned_use_hip_host_register"],
        value: "`True` or `False`",
        default: "False",
        doc: "Pinned host memory (`gpupool_host_malloc`): `malloc` then `cuMemHostRegister` instead of \
              `cuMemHostAlloc` for new blocks.",
        apply: |c, v| v.boolean().map(|b| c.pinned_use_cuda_host_register = b),
        show: |c| Some(show_bool(c.pinned_use_cuda_host_register)),
    },
    ConfKey {
        key: "pinned_num_register_threads",
        also: &[],
        value: "a power of two, at most 128",
        default: "1",
        doc: "Pinned host memory: threads that touch (page in) a new block before `cuMemHostRegister` with \
              `pinned_use_cuda_host_register` (PyTorch's bound, `pinned_max_register_threads`, is 128 and no key).",
        apply: |c, v| {
            let n = v.count()?;
            if !n.is_power_of_two() || n > MAX_REGISTER_THREADS {
                return Err(format!("a power of two, at most {MAX_REGISTER_THREADS}"));
            }
            c.pinned_num_register_threads = n;
            Ok(())
        },
        show: |c| Some(c.pinned_num_register_threads.to_string()),
    },
    ConfKey {
        key: "pinned_use_background_threads",
        also: &[],
        value: "`True` or `False`",
        default: "False",
        doc: "Pinned host memory: a background thread polls the events of freed blocks every 100 µs, and \
              allocations no longer poll them on the hit path.",
        apply: |c, v| v.boolean().map(|b| c.pinned_use_background_threads = b),
        show: |c| Some(show_bool(c.pinned_use_background_threads)),
    },
    ConfKey {
        key: "pinned_reserve_segment_size_mb",
        also: &[],
        value: "whole MiB, at least 1",
        default: "none (0, which cannot be written)",
        doc: "Pinned host memory: one segment of this size pinned at the first miss and carved (4 KiB aligned) \
              for new blocks while it has room; never released. Left out of the configuration string while unset.",
        apply: |c, v| {
            let mb = v.count()?;
            match mb.checked_mul(MIB) {
                Some(bytes) if mb > 0 => {
                    c.pinned_reserve_segment_size = bytes;
                    Ok(())
                }
                _ => Err(format!("a whole number of MiB from 1 to {MAX_MB}")),
            }
        },
        show: |c| (c.pinned_reserve_segment_size > 0).then(|| (c.pinned_reserve_segment_size / MIB).to_string()),
    },
];

fn show_bool(b: bool) -> String {
    (if b { "True" } else { "False" }).to_string()
}

/// The `*_mb` limits: a whole number of MiB, at least `large_segment_size_mb` (PyTorch
/// `parseMaxSplitSize`, `parseMaxNonSplitRoundingSize`), clamped to [`MAX_MB`].
fn mb_at_least_large_segment(c: &Config, v: &Raw) -> Result<usize, String> {
    let floor = c.large_segment_size / MIB;
    let mb = v.count()?;
    if mb < floor {
        return Err(format!("a whole number of MiB, at least large_segment_size_mb ({floor})"));
    }
    Ok(mb.min(MAX_MB))
}

/// PyTorch `parseRoundUpPower2Divisions`: a single power of two sets every interval; a list
/// writes the intervals it names into the table as it stands.
fn apply_roundup(c: &mut Config, v: &Raw) -> Result<(), String> {
    let table = &mut c.roundup_power2_divisions;
    let items = match v {
        Raw::Word(w) => {
            let d = count(w).filter(|d| d.is_power_of_two()).ok_or("a power of two, or a list [MiB:divisions,...]")?;
            *table = [d; ROUNDUP_INTERVALS];
            return Ok(());
        }
        Raw::List(items) => items,
    };
    // Checked first, so that a bad item leaves the table as it was.
    let mut parsed = Vec::with_capacity(items.len());
    for (bound, divisions) in items {
        let d = count(divisions)
            .filter(|d| *d == 0 || d.is_power_of_two())
            .ok_or_else(|| format!("divisions 0 or a power of two, not {divisions:?} (in {bound}:{divisions})"))?;
        let interval = if bound == ">" {
            None
        } else {
            let mb = count(bound)
                .filter(|b| b.is_power_of_two())
                .ok_or_else(|| format!("an interval that is a power of two (MiB) or >, not {bound:?}"))?;
            Some((mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1))
        };
        parsed.push((interval, d));
    }
    // The first interval named also sets every interval below it; `>` sets every interval
    // after the last one named (after the first interval when none was named).
    let mut first = true;
    let mut last = 0;
    for (interval, d) in parsed {
        match interval {
            None => table[last + 1..].fill(d),
            Some(i) => {
                if first {
                    table[..i].fill(d);
                    first = false;
                }
                table[i] = d;
                last = i;
            }
        }
    }
    Ok(())
}

/// `roundup_power2_divisions` written so that [`apply_roundup`] reads back the same table from
/// PyTorch's reset state (every interval 0): one number when every interval has the same
/// nonzero divisions, else a list: the first item ends the leading run (it fills the
/// intervals below it), the middle intervals one by one, `>` the trailing run.
fn show_roundup(t: &[usize; ROUNDUP_INTERVALS]) -> String {
    let last = ROUNDUP_INTERVALS - 1;
    if t.iter().all(|&d| d == t[0]) {
        return if t[0] != 0 { t[0].to_string() } else { "[1:0,>:0]".to_string() };
    }
    let lead = t.iter().position(|&d| d != t[0]).unwrap_or(ROUNDUP_INTERVALS) - 1;
    let trail = (0..=last).rev().find(|&i| t[i] != t[last]).map_or(0, |i| i + 1);
    debug_assert!(lead < trail && trail <= last);
    let mut out = String::from("[");
    let _ = write!(out, "{}:{}", 1usize << lead, t[lead]);
    for (i, d) in t.iter().enumerate().take(trail).skip(lead + 1) {
        let _ = write!(out, ",{}:{d}", 1usize << i);
    }
    // Not all equal: the leading run ends before the trailing one starts, so `>` fills
    // exactly the trailing run.
    let _ = write!(out, ",>:{}", t[last]);
    out.push(']');
    out
}

/// A whole number, digits only (PyTorch reads it with `std::stoull`, which also takes a sign
/// and ignores what follows the digits).
fn count(text: &str) -> Option<usize> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A value as written: one word, or a list of `a:b` items.
#[derive(Debug)]
enum Raw {
    Word(String),
    List(Vec<(String, String)>),
}

impl Raw {
    fn word(&self) -> Result<&str, String> {
        match self {
            Raw::Word(w) => Ok(w),
            Raw::List(_) => Err("a single value, not a list".into()),
        }
    }

    fn count(&self) -> Result<usize, String> {
        count(self.word()?).ok_or_else(|| "a whole number (digits only)".into())
    }

    /// A decimal number, as Rust reads an `f64` (PyTorch `std::stod`, without what it ignores).
    fn number(&self) -> Result<f64, String> {
        self.word()?.parse().map_err(|_| "a decimal number".into())
    }

    /// `True` or `False`, exactly (PyTorch `ConfigTokenizer::toBool`).
    fn boolean(&self) -> Result<bool, String> {
        match self.word()? {
            "True" => Ok(true),
            "False" => Ok(false),
            _ => Err("True or False (exactly so written)".into()),
        }
    }
}

impl std::fmt::Display for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Raw::Word(w) => f.write_str(w),
            Raw::List(items) => {
                f.write_str("[")?;
                for (i, (a, b)) in items.iter().enumerate() {
                    write!(f, "{}{a}:{b}", if i == 0 { "" } else { "," })?;
                }
                f.write_str("]")
            }
        }
    }
}

/// PyTorch's `ConfigTokenizer`: `,`, `:`, `[` and `]` stand alone, white space is dropped,
/// everything else runs together into words.
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for ch in text.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            out.push(ch.to_string());
        } else if !ch.is_whitespace() {
            word.push(ch);
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

fn is_sep(t: &str) -> bool {
    matches!(t, "," | ":" | "[" | "]")
}

/// The entries of a configuration string, in order; a message saying what is wrong when it is
/// not of the form `key:value,key:[a:b,...],...`.
fn entries(text: &str) -> Result<Vec<(String, Raw)>, String> {
    let toks = tokens(text);
    let mut it = toks.into_iter();
    let mut out = Vec::new();
    let end = |t: Option<&String>| t.map_or("the end".to_string(), |t| format!("{t:?}"));
    while let Some(key) = it.next() {
        if is_sep(&key) {
            return Err(format!("expected a key, found {key:?}"));
        }
        match it.next() {
            Some(c) if c == ":" => {}
            t => return Err(format!("expected ':' after the key {key}, found {}", end(t.as_ref()))),
        }
        let value = match it.next() {
            Some(t) if t == "[" => {
                let mut items = Vec::new();
                loop {
                    let a = match it.next() {
                        Some(t) if t == "]" => break,
                        Some(t) if !is_sep(&t) => t,
                        t => {
                            return Err(format!(
                                "{key}: expected an item or ']' in the list, found {}",
                                end(t.as_ref())
                            ));
                        }
                    };
                    match it.next() {
                        Some(c) if c == ":" => {}
                        t => {
                            return Err(format!(
                                "{key}: expected ':' after {a} in the list, found {}",
                                end(t.as_ref())
                            ));
                        }
                    }
                    let b = match it.next() {
                        Some(t) if !is_sep(&t) => t,
                        t => {
                            return Err(format!(
                                "{key}: expected a value after {a}: in the list, found {}",
                                end(t.as_ref())
                            ));
                        }
                    };
                    let next = it.next();
                    match next.as_deref() {
                        Some(",") => items.push((a, b)),
                        Some("]") => {
                            items.push((a, b));
                            break;
                        }
                        _ => {
                            return Err(format!(
                                "{key}: expected ',' or ']' after {a}:{b}, found {}",
                                end(next.as_ref())
                            ));
                        }
                    }
                }
                Raw::List(items)
            }
            Some(t) if !is_sep(&t) => Raw::Word(t),
            t => return Err(format!("expected a value after {key}:, found {}", end(t.as_ref()))),
        };
        out.push((key, value));
        match it.next() {
            None => {}
            Some(t) if t == "," => {}
            Some(t) => {
                return Err(format!(
                    "expected ',' after {}:{}, found {t:?}",
                    out[out.len() - 1].0,
                    out[out.len() - 1].1
                ));
            }
        }
    }
    Ok(out)
}

fn find_key(key: &str) -> Option<&'static ConfKey> {
    CONF_KEYS.iter().find(|k| k.key == key || k.also.contains(&key))
}

/// Which keys a string set, for the check of the deprecated `GPUPOOL_MAX_SPLIT_SIZE_MB`.
pub(super) struct Seen {
    pub max_split_size: bool,
}

impl Config {
    /// Every key of `GPUPOOL_CONF` back at its default (PyTorch's, [`CONF_KEYS`]).
    fn reset_conf(&mut self) {
        let d = Config::default();
        self.max_split_size = d.max_split_size;
        self.max_non_split_rounding = d.max_non_split_rounding;
        self.large_segment_size = d.large_segment_size;
        self.roundup_power2_divisions = d.roundup_power2_divisions;
        self.garbage_collection_threshold = d.garbage_collection_threshold;
        self.expandable_segments = d.expandable_segments;
        self.release_lock_on_cudamalloc = d.release_lock_on_cudamalloc;
        self.per_process_memory_fraction = d.per_process_memory_fraction;
        self.graph_capture_record_stream_reuse = d.graph_capture_record_stream_reuse;
        self.pinned_use_cuda_host_register = d.pinned_use_cuda_host_register;
        self.pinned_num_register_threads = d.pinned_num_register_threads;
        self.pinned_use_background_threads = d.pinned_use_background_threads;
        self.pinned_reserve_segment_size = d.pinned_reserve_segment_size;
    }

    /// Applies the configuration string `text` (from `origin`, for messages) to a config
    /// whose keys are at their defaults; on error `self` may be half changed.
    pub(super) fn apply_conf(&mut self, origin: &str, text: &str) -> Result<Seen, Error> {
        let entries = entries(text).map_err(|why| Error::InvalidValue(format!("{origin}: {why}")))?;
        let bad = |key: &str, value: &Raw, expected: String| {
            Error::InvalidValue(format!("{origin}: {key}:{value} is not valid: expected {expected}"))
        };
        for (key, value) in &entries {
            if find_key(key).is_none() {
                let known: Vec<&str> = CONF_KEYS.iter().map(|k| k.key).collect();
                return Err(Error::InvalidValue(format!(
                    "{origin}: unknown key {key:?} (with the value {value}); the keys are {}",
                    known.join(", ")
                )));
            }
        }
        // PyTorch reads large_segment_size_mb first, wherever it stands, since it sets the
        // default and the floor of the other limits.
        let large = find_key("large_segment_size_mb").expect("in the table");
        for (key, value) in entries.iter().filter(|(k, _)| k == large.key) {
            (large.apply)(self, value).map_err(|e| bad(key, value, e))?;
        }
        self.max_non_split_rounding = self.large_segment_size;
        let mut seen = Seen { max_split_size: false };
        for (key, value) in entries.iter().filter(|(k, _)| k != large.key) {
            let row = find_key(key).expect("checked above");
            (row.apply)(self, value).map_err(|e| bad(key, value, e))?;
            seen.max_split_size |= row.key == "max_split_size_mb";
        }
        Ok(seen)
    }

    /// This config with its `GPUPOOL_CONF` keys set from `conf` alone: every key the string
    /// does not name takes PyTorch's default, whatever this config had (what
    /// `gpupool_set_config` installs). The other options are kept.
    ///
    /// Errors: [`Error::InvalidValue`] naming the key and the value (or the place the string
    /// stops making sense) and what is expected; `self` is never changed.
    pub fn with_conf(&self, conf: &str) -> Result<Config, Error> {
        let mut c = self.clone();
        c.reset_conf();
        c.apply_conf(CONF_VAR, conf)?;
        Ok(c)
    }

    /// Every key of `GPUPOOL_CONF` with its value in this config, in PyTorch's syntax and
    /// [`CONF_KEYS`] order: `backend:native,large_segment_size_mb:20,...`. [`Config::with_conf`]
    /// reads it back to the same settings. A size that is not a whole number of MiB (possible
    /// only through the Rust API) is shown rounded down; `pinned_reserve_segment_size_mb` is left
    /// out while unset, and `garbage_collection_threshold` while off: PyTorch refuses their
    /// defaults (0) as values.
    pub fn conf_string(&self) -> String {
        let mut out = String::new();
        for k in &CONF_KEYS {
            if let Some(v) = (k.show)(self) {
                if !out.is_empty() {
                    out.push(',');
                }
                let _ = write!(out, "{}:{v}", k.key);
            }
        }
        out
    }
}

/// The list of `GPUPOOL_CONF` keys as a markdown table, made from [`CONF_KEYS`]: the module
/// docs of `config` and the README hold this text.
pub fn conf_keys_markdown() -> String {
    let mut out = String::from("| key | value | default | meaning |\n|---|---|---|---|\n");
    for k in &CONF_KEYS {
        let also = if k.also.is_empty() {
            String::new()
        } else {
            format!(" (also {})", k.also.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", "))
        };
        let _ = writeln!(out, "| `{}`{also} | {} | {} | {} |", k.key, k.value, k.default, k.doc);
    }
    out
}

#[cfg(test)]
mod tests {
    //! The expected figures are those PyTorch 2.11.0 itself gives: each string was passed to
    //! `c10::CachingAllocator::setAllocatorSettings` of the 2.11.0 wheel's `libc10.so` and
    //! `libc10_cuda.so` (in a fresh process), and the settings read back.

    use super::*;

    fn conf(s: &str) -> Result<Config, Error> {
        Config::default().with_conf(s)
    }

    fn ok(s: &str) -> Config {
        conf(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    /// `s` is refused with a message naming each of `words`.
    fn refused(s: &str, words: &[&str]) {
        let e = conf(s).expect_err(s);
        assert!(matches!(e, Error::InvalidValue(_)), "{s:?}: {e:?}");
        for w in words {
            assert!(e.message().contains(w), "{s:?}: the message should name {w:?}: {e}");
        }
        assert!(e.message().starts_with("GPUPOOL_CONF: "), "{e}");
    }

    fn divisions(s: &str) -> [usize; ROUNDUP_INTERVALS] {
        ok(&format!("roundup_power2_divisions:{s}")).roundup_power2_divisions
    }

    #[test]
    fn an_empty_string_sets_every_default() {
        for s in ["", "   ", "\t\n"] {
            assert_eq!(ok(s), Config::default());
        }
        let d = Config::default();
        assert_eq!(
            (d.max_split_size, d.max_non_split_rounding, d.large_segment_size),
            (usize::MAX, 20 * MIB, 20 * MIB)
        );
        assert_eq!(d.roundup_power2_divisions, [0; ROUNDUP_INTERVALS]);
        assert_eq!((d.garbage_collection_threshold, d.per_process_memory_fraction), (0.0, 1.0));
        assert_eq!((d.pinned_num_register_threads, d.pinned_reserve_segment_size), (1, 0));
    }

    #[test]
    fn every_key_sets_its_field() {
        type Check = fn(&Config) -> bool;
        let cases: [(&str, Check); 14] = [
            ("backend:native", |c| *c == Config::default()),
            ("large_segment_size_mb:64", |c| c.large_segment_size == 64 * MIB && c.max_non_split_rounding == 64 * MIB),
            ("max_split_size_mb:64", |c| c.max_split_size == 64 * MIB),
            ("max_non_split_rounding_mb:30", |c| c.max_non_split_rounding == 30 * MIB),
            ("roundup_power2_divisions:4", |c| c.roundup_power2_divisions == [4; ROUNDUP_INTERVALS]),
            ("garbage_collection_threshold:0.5", |c| c.garbage_collection_threshold == 0.5),
            ("expandable_segments:True", |c| c.expandable_segments),
            ("release_lock_on_cudamalloc:True", |c| c.release_lock_on_cudamalloc),
            ("per_process_memory_fraction:0.5", |c| c.per_process_memory_fraction == 0.5),
            ("graph_capture_record_stream_reuse:True", |c| c.graph_capture_record_stream_reuse),
            ("pinned_use_cuda_host_register:True", |c| c.pinned_use_cuda_host_register),
            ("pinned_num_register_threads:8", |c| c.pinned_num_register_threads == 8),
            ("pinned_use_background_threads:True", |c| c.pinned_use_background_threads),
            ("pinned_reserve_segment_size_mb:64", |c| c.pinned_reserve_segment_size == 64 * MIB),
        ];
        for (s, check) in cases {
            assert!(check(&ok(s)), "{s}");
        }
        let named: Vec<&str> = cases.iter().map(|(s, _)| s.split(':').next().unwrap()).collect();
        let keys: Vec<&str> = CONF_KEYS.iter().map(|k| k.key).collect();
        assert_eq!(named, keys, "one case per key, in the table's order");
        // PyTorch's ROCm spellings of two keys, which its CUDA build accepts too.
        assert!(ok("release_lock_on_hipmalloc:True").release_lock_on_cudamalloc);
        assert!(ok("pinned_use_hip_host_register:True").pinned_use_cuda_host_register);
        // False is read too, not only the absence of True.
        assert!(!ok("expandable_segments:True,expandable_segments:False").expandable_segments);
    }

    #[test]
    fn several_keys_with_spaces_anywhere() {
        let c = ok(" max_split_size_mb : 64 , expandable_segments : True ");
        assert_eq!((c.max_split_size, c.expandable_segments), (64 * MIB, true));
        let c = ok("max_split _size_mb:6 4,\tgarbage_collection_threshold:0.25");
        assert_eq!((c.max_split_size, c.garbage_collection_threshold), (64 * MIB, 0.25));
        // A comma after the last entry is allowed (PyTorch's loop ends there).
        assert_eq!(ok("max_split_size_mb:64,").max_split_size, 64 * MIB);
        assert_eq!(ok("max_split_size_mb:064").max_split_size, 64 * MIB);
    }

    #[test]
    fn a_key_given_twice_takes_the_last_value() {
        assert_eq!(ok("max_split_size_mb:64,max_split_size_mb:128").max_split_size, 128 * MIB);
        assert_eq!(ok("large_segment_size_mb:30,large_segment_size_mb:40").max_non_split_rounding, 40 * MIB);
        // roundup_power2_divisions writes into one table: a later list changes only what it names.
        assert_eq!(divisions("4,roundup_power2_divisions:[256:2]"), [2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4]);
    }

    #[test]
    fn large_segment_size_is_read_first_and_floors_both_limits() {
        // Order does not matter: PyTorch reads large_segment_size_mb in a pass of its own.
        for s in ["large_segment_size_mb:64,max_split_size_mb:30", "max_split_size_mb:30,large_segment_size_mb:64"] {
            refused(s, &["max_split_size_mb:30", "at least large_segment_size_mb (64)"]);
        }
        refused(
            "large_segment_size_mb:30,max_non_split_rounding_mb:25",
            &["max_non_split_rounding_mb:25", "at least large_segment_size_mb (30)"],
        );
        let c = ok("large_segment_size_mb:11,max_split_size_mb:11,max_non_split_rounding_mb:11");
        assert_eq!((c.large_segment_size, c.max_split_size, c.max_non_split_rounding), (11 * MIB, 11 * MIB, 11 * MIB));
        // An explicit max_non_split_rounding_mb wins over the default large_segment_size_mb gives it.
        let c = ok("max_non_split_rounding_mb:64,large_segment_size_mb:30");
        assert_eq!((c.large_segment_size, c.max_non_split_rounding), (30 * MIB, 64 * MIB));
        refused("large_segment_size_mb:10", &["large_segment_size_mb:10", "more than 10"]);
        assert_eq!(ok("max_split_size_mb:20").max_split_size, 20 * MIB);
        refused("max_split_size_mb:19", &["max_split_size_mb:19", "at least large_segment_size_mb (20)"]);
        refused("max_split_size_mb:0", &["max_split_size_mb:0"]);
        assert_eq!(ok("max_non_split_rounding_mb:20").max_non_split_rounding, 20 * MIB);
        refused("max_non_split_rounding_mb:19", &["max_non_split_rounding_mb:19"]);
    }

    #[test]
    fn sizes_past_usize_are_clamped_as_pytorch_does() {
        // PyTorch clamps to SIZE_MAX / 1 MiB MiB; for max_split_size that is unlimited.
        assert_eq!(ok("max_split_size_mb:99999999999999999").max_split_size, usize::MAX);
        assert_eq!(ok(&format!("max_split_size_mb:{MAX_MB}")).max_split_size, usize::MAX);
        assert_eq!(ok(&format!("max_split_size_mb:{}", MAX_MB - 1)).max_split_size, (MAX_MB - 1) * MIB);
        let c = ok("large_segment_size_mb:99999999999999999");
        assert_eq!((c.large_segment_size, c.max_non_split_rounding), (MAX_MB * MIB, MAX_MB * MIB));
        // Past u64, stoull fails in PyTorch too.
        refused("max_split_size_mb:99999999999999999999999", &["max_split_size_mb:99999999999999999999999"]);
    }

    #[test]
    fn roundup_power2_divisions_in_both_forms() {
        assert_eq!(divisions("4"), [4; ROUNDUP_INTERVALS]);
        assert_eq!(divisions("1"), [1; ROUNDUP_INTERVALS]);
        assert_eq!(divisions("[256:1,512:2,1024:4,>:8]"), [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]);
        assert_eq!(divisions(" [ 256 : 1 , 512 : 2 , 1024 : 4 , > : 8 ] "), divisions("[256:1,512:2,1024:4,>:8]"));
        assert_eq!(divisions("[1:2,>:4]"), [2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]);
        // PyTorch's own example (AllocatorConfig.h): 128 is never named, so its interval stays 0.
        assert_eq!(divisions("[64:8,256:4,1024:4,>:1]"), [8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1]);
        // `>` first fills after the first interval; a boundary past 32 GiB is the last interval.
        assert_eq!(divisions("[>:4]"), [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]);
        assert_eq!(divisions("[2:4]"), [4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(divisions("[256:0,>:2]"), [0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2]);
        assert_eq!(divisions("[65536:4]"), [4; ROUNDUP_INTERVALS]);
        assert_eq!(divisions("[131072:4,>:2]"), [4; ROUNDUP_INTERVALS]);
        // Items in any order; each writes its own interval, `>` after the last one named.
        assert_eq!(divisions("[1024:4,256:2]"), [4, 4, 4, 4, 4, 4, 4, 4, 2, 4, 4, 0, 0, 0, 0, 0]);
        assert_eq!(divisions("[512:2,>:8,2048:1]"), [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 8, 1, 8, 8, 8, 8]);
        assert_eq!(divisions("[]"), [0; ROUNDUP_INTERVALS]);
        assert_eq!(divisions("[256:1,]"), [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]);
        for (bad, named) in [
            ("3", "roundup_power2_divisions:3"),
            ("0", "roundup_power2_divisions:0"),
            ("[3:4]", "\"3\""),
            ("[0:2]", "\"0\""),
            ("[256:3]", "256:3"),
            ("[256:1", "roundup_power2_divisions"),
            ("[256]", "roundup_power2_divisions"),
            ("[256:1;512:2]", "roundup_power2_divisions"),
            ("[x:1]", "\"x\""),
        ] {
            refused(&format!("roundup_power2_divisions:{bad}"), &[named]);
        }
        refused("roundup_power2_divisions:3", &["a power of two"]);
    }

    #[test]
    fn booleans_are_true_or_false_exactly() {
        for bad in ["true", "1", "TRUE", "yes"] {
            refused(&format!("expandable_segments:{bad}"), &[&format!("expandable_segments:{bad}"), "True or False"]);
        }
    }

    #[test]
    fn numbers_keep_pytorchs_ranges() {
        for (s, v) in [("0.5", 0.5), ("1e-3", 0.001), (".5", 0.5), ("0.999", 0.999)] {
            assert_eq!(ok(&format!("garbage_collection_threshold:{s}")).garbage_collection_threshold, v, "{s}");
        }
        for bad in ["0", "1", "nan", "-0.5", "inf"] {
            refused(
                &format!("garbage_collection_threshold:{bad}"),
                &[&format!("garbage_collection_threshold:{bad}"), "over 0 and under 1"],
            );
        }
        for (s, v) in [("0", 0.0), ("1", 1.0), ("0.25", 0.25)] {
            assert_eq!(ok(&format!("per_process_memory_fraction:{s}")).per_process_memory_fraction, v, "{s}");
        }
        for bad in ["1.5", "-0.1", "nan"] {
            refused(
                &format!("per_process_memory_fraction:{bad}"),
                &[&format!("per_process_memory_fraction:{bad}"), "from 0 to 1"],
            );
        }
        assert_eq!(ok("pinned_num_register_threads:128").pinned_num_register_threads, 128);
        for bad in ["3", "256", "0"] {
            refused(
                &format!("pinned_num_register_threads:{bad}"),
                &[&format!("pinned_num_register_threads:{bad}"), "a power of two, at most 128"],
            );
        }
        refused("pinned_reserve_segment_size_mb:0", &["pinned_reserve_segment_size_mb:0", "from 1"]);
    }

    #[test]
    fn backend_is_native_and_cuda_malloc_async_is_refused() {
        assert_eq!(ok("backend:native"), Config::default());
        refused("backend:cudaMallocAsync", &["backend:cudaMallocAsync", "native caching allocator"]);
        refused("backend:cudaMallocAsync,max_split_size_mb:64", &["backend:cudaMallocAsync"]);
        refused("backend:foo", &["backend:foo", "native"]);
    }

    #[test]
    fn unknown_keys_are_named() {
        for (s, key) in
            [("foo:1", "\"foo\""), ("Max_split_size_mb:64", "\"Max_split_size_mb\""), ("foo:[1:2]", "\"foo\"")]
        {
            refused(s, &[key, "unknown key", "max_split_size_mb"]);
        }
        // Even after good entries, and a cudaMallocAsync-only name is just as unknown.
        refused("max_split_size_mb:64,bogus_key:True", &["\"bogus_key\""]);
    }

    #[test]
    fn what_pytorch_lets_through_unchecked_is_refused() {
        // std::stoull/std::stod stop at the first character that does not fit; PyTorch never
        // checks that its separators are the ones it expects.
        for (s, named) in [
            ("max_split_size_mb:64MB", "max_split_size_mb:64MB"),
            ("max_split_size_mb:-1", "max_split_size_mb:-1"),
            ("max_split_size_mb:+30", "max_split_size_mb:+30"),
            ("max_split_size_mb:30.5", "max_split_size_mb:30.5"),
            ("garbage_collection_threshold:0.5x", "garbage_collection_threshold:0.5x"),
            ("max_split_size_mb,64", "max_split_size_mb"),
            ("max_split_size_mb:64:65", "max_split_size_mb:64"),
            ("max_split_size_mb:64;expandable_segments:True", "max_split_size_mb"),
        ] {
            refused(s, &[named]);
        }
    }

    #[test]
    fn the_string_must_have_its_shape() {
        for (s, named) in [
            ("max_split_size_mb", "max_split_size_mb"),
            ("max_split_size_mb:", "max_split_size_mb"),
            (",max_split_size_mb:64", "expected a key, found \",\""),
            ("max_split_size_mb:64,,expandable_segments:True", "expected a key, found \",\""),
            ("expandable_segments:[True]", "expandable_segments"),
            ("max_split_size_mb:[64]", "max_split_size_mb: expected ':' after 64"),
            (":64", "expected a key, found \":\""),
            ("max_split_size_mb:64 expandable_segments:True", "max_split_size_mb:64expandable_segments"),
        ] {
            refused(s, &[named]);
        }
    }

    #[test]
    fn a_refused_string_changes_nothing() {
        let before = ok("max_split_size_mb:64,expandable_segments:True");
        let copy = before.clone();
        assert!(before.with_conf("max_split_size_mb:128,expandable_segments:maybe").is_err());
        assert!(before.with_conf("roundup_power2_divisions:[256:2,512:3]").is_err());
        assert_eq!(before, copy);
    }

    #[test]
    fn with_conf_replaces_every_key_and_keeps_the_other_options() {
        let start = Config { sim_devices: 3, ..ok("max_split_size_mb:64,roundup_power2_divisions:4") };
        let c = start.with_conf("expandable_segments:True").unwrap();
        assert_eq!(c.sim_devices, 3);
        assert!(c.expandable_segments);
        assert_eq!((c.max_split_size, c.roundup_power2_divisions), (usize::MAX, [0; ROUNDUP_INTERVALS]));
    }

    #[test]
    fn the_string_reads_back_to_the_same_config() {
        let d = Config::default().conf_string();
        assert!(d.starts_with("backend:native,large_segment_size_mb:20,max_split_size_mb:17592186044415,"), "{d}");
        for s in [
            "",
            "max_split_size_mb:64,max_non_split_rounding_mb:40,large_segment_size_mb:32",
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],garbage_collection_threshold:0.6",
            "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
            "roundup_power2_divisions:[1024:4,256:2]",
            "roundup_power2_divisions:[>:4],expandable_segments:True,release_lock_on_cudamalloc:True",
            "per_process_memory_fraction:0.123456789,pinned_reserve_segment_size_mb:7",
            "pinned_use_cuda_host_register:True,pinned_num_register_threads:16,pinned_use_background_threads:True",
            "graph_capture_record_stream_reuse:True,garbage_collection_threshold:1e-9",
            "large_segment_size_mb:11,max_split_size_mb:11,max_non_split_rounding_mb:11",
        ] {
            let c = ok(s);
            let shown = c.conf_string();
            assert_eq!(ok(&shown), c, "{s:?} shows as {shown:?}");
            assert_eq!(ok(&shown).conf_string(), shown);
            let optional = ["pinned_reserve_segment_size_mb", "garbage_collection_threshold"];
            for k in CONF_KEYS.iter().filter(|k| !optional.contains(&k.key)) {
                assert!(shown.contains(&format!("{}:", k.key)), "{shown} lacks {}", k.key);
            }
        }
        assert_eq!(
            ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").conf_string().split(',').nth(4).unwrap(),
            "roundup_power2_divisions:[256:1"
        );
        assert!(ok("roundup_power2_divisions:8").conf_string().contains(",roundup_power2_divisions:8,"));
    }

    #[test]
    fn every_divisions_table_reads_back() {
        // A table of 16 entries from {0, 1, 2, 8}, from a small generator: runs, isolated
        // values and tables equal but for one end.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for n in 0..20_000 {
            let mut t = [0; ROUNDUP_INTERVALS];
            for d in t.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Mostly repeats of the previous entry, so that runs of every length occur.
                *d = [0, 1, 2, 8][(x % 4) as usize];
            }
            if n % 2 == 0 {
                let fill = t[(x % 16) as usize];
                let from = (x >> 8) as usize % ROUNDUP_INTERVALS;
                t[from..].fill(fill);
            }
            let shown = show_roundup(&t);
            let back = ok(&format!("roundup_power2_divisions:{shown}")).roundup_power2_divisions;
            assert_eq!(back, t, "{shown}");
        }
    }
}
