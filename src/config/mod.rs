//! Options: every `GPUPOOL_*` environment variable that gpupool and the LD_PRELOAD shim read,
//! one row each of [`OPTIONS`], all read by one reader with one syntax, once, when the
//! process-wide allocator starts (the first call of the C API or of the shim). The shim reads
//! its options from the same [`Config`] ([`Allocator::config`](crate::Allocator::config)).
//!
//! The syntax, the same for every row:
//! - An empty value, or one of spaces only, counts as unset: the default applies. Spaces
//!   around a value are ignored.
//! - A size is a whole number with an optional unit: `K`, `M`, `G`, `T` or `KiB`, `MiB`,
//!   `GiB`, `TiB` (also `KB`..`TB`, all powers of 1024) or `B`, any case, spaces allowed before
//!   the unit: `4096`, `512K`, `16 GiB`. A bare number counts bytes, except in
//!   `GPUPOOL_MAX_SPLIT_SIZE_MB`, where it counts MiB as PyTorch's `max_split_size_mb` does.
//! - A count is a whole number within the row's range.
//! - A boolean is `1`/`0`, `true`/`false`, `yes`/`no` or `on`/`off`, any case.
//! - A word is one of the row's words, any case.
//! - A value that is not valid UTF-8, or does not parse, is [`Error::InvalidValue`] naming the
//!   variable, the value and what is expected; it is never replaced by the default.
//!
//! The options (the README's list of environment variables is this list, and a unit test
//! checks that both match [`OPTIONS`]):
//!
//! | variable | kind | default | meaning |
//! |---|---|---|---|
//! | `GPUPOOL_DRIVER` | `cuda` or `sim` | `cuda` | `cuda`: the CUDA driver API (libcuda.so.1, loaded at run time); `sim`: the simulated device (no GPU needed). Never chosen silently: without a driver, calls return `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` and print nothing. |
//! | `GPUPOOL_SIM_CAPACITY` | size, at least 1 | `16GiB` | bytes per simulated device |
//! | `GPUPOOL_SIM_DEVICES` | count, 1 to 64 | `1` | number of simulated devices |
//! | `GPUPOOL_MAX_SPLIT_SIZE_MB` | size (a bare number counts MiB), at least 20MiB | unlimited | Deprecated: use `GPUPOOL_CONF=max_split_size_mb:N`. PyTorch's `max_split_size_mb`: cached blocks of at least this size are never split, and serve only requests of about their size. Set in both with different values: an error naming both |
//! | `GPUPOOL_PRELOAD_MODE` | `safe` or `stream` | `safe` | LD_PRELOAD shim: `safe` (a `cudaFree`d block waits for a device synchronisation) or `stream` (reused at once, in stream order) |
//! | `GPUPOOL_PRELOAD_SYNC_BYTES` | size | `256MiB` | LD_PRELOAD shim, safe mode: deferred bytes on a device that trigger the synchronisation (0: at every free) |
//! | `GPUPOOL_PRELOAD_STATS` | boolean | `off` | LD_PRELOAD shim: at exit, print what was intercepted, these options and the memory summary of each device used (stderr) |
//! | `GPUPOOL_EXPANDABLE_RECLAIM` | boolean | `off` | With `expandable_segments:True`: a segment does not grow past the device's peak reserved bytes (since the cache was last emptied or the peak statistics reset) while wholly free pages are mapped anywhere on the device; they are unmapped first (a device synchronisation), so that reserved memory stays near the most ever in use. Off: PyTorch's behaviour (pages are unmapped only by `empty_cache` and on out of memory), much faster where shapes change (see the README's fragmentation table) |
//! | `GPUPOOL_RECORD_HISTORY` | `off` or `<max_entries>[:<context>]` | `off` | Records the allocation history from the start, as `gpupool_record_history(1, max_entries, context)` would (PyTorch `_record_memory_history`): the newest `max_entries` events per device and the call stacks of `context` (`none`, `state`, `alloc` or `all`, default `all`); `gpupool_dump_snapshot` writes them |
//! | `GPUPOOL_LIVE_REPORT_AT_EXIT` | boolean | `off` | At exit, print the live report of each device used (stderr): its allocated blocks grouped by tag and by call stack, largest first, as `gpupool_live_report` prints it; what a leak hunt reads |
//! | `GPUPOOL_CONF` | PyTorch's configuration string, `key:value,key:value` | empty | the allocator's settings, as `PYTORCH_CUDA_ALLOC_CONF` holds them for PyTorch 2.11's native backend (the keys are listed below); an unknown key or a bad value is an error naming it |
//!
//! A new option is a row of [`OPTIONS`] and a field of [`Config`].
//!
//! `GPUPOOL_CONF`, read after the rows, has PyTorch's syntax instead (module `conf`, the rules
//! of PyTorch 2.11's `ConfigTokenizer` and parsers): `key:value` entries separated by commas,
//! spaces ignored anywhere, booleans `True`/`False` only, sizes in whole MiB, a list value as
//! `[256:1,512:2,>:4]`. Its keys are [`CONF_KEYS`], each a field of [`Config`], with PyTorch's
//! meanings, defaults and limits (the README lists them too, and a unit test checks both):
//!
//! | key | value | default | meaning |
//! |---|---|---|---|
//! | `backend` | `native` | native | The allocator behind PyTorch. gpupool is PyTorch's native caching allocator; `cudaMallocAsync` is an error. |
//! | `large_segment_size_mb` | whole MiB, more than 10 | 20 | Size of the segments that requests over 1 MiB and under 10 MiB are carved from (PyTorch `get_allocation_size`; `kLargeBuffer` before 2.11). Also the default of `max_non_split_rounding_mb` and the floor of both `*_mb` limits. |
//! | `max_split_size_mb` | whole MiB, at least `large_segment_size_mb` | unlimited (17592186044415, the largest) | Cached blocks of at least this size are never split, and serve only requests of about their size (PyTorch `max_split_size`). The largest value, 17592186044415, means unlimited. |
//! | `max_non_split_rounding_mb` | whole MiB, at least `large_segment_size_mb` | `large_segment_size_mb` (20) | A request of at least `max_split_size_mb` takes a cached block only if the block is less than this much larger (PyTorch `get_free_block`). |
//! | `roundup_power2_divisions` | a power of two, or a list `[MiB:divisions,...,>:divisions]` | 0 in every interval | Requests are rounded up to one of this many equal steps between two powers of two, instead of to 512 bytes (PyTorch `round_size`, `roundup_power2_next_division`); 0 or 1 leaves the 512-byte rounding. A list sets it per interval: `MiB` a power of two naming the sizes from that many MiB to twice as many (the first also sets every interval below it), `>` every interval after the last one named; each divisions 0 or a power of two. |
//! | `garbage_collection_threshold` | a number over 0 and under 1 | off (0, which cannot be written) | With a memory fraction set (`per_process_memory_fraction` or `gpupool_set_memory_fraction`): once reserved memory passes this fraction of the memory allowed, a request that finds no cached block first releases whole free segments of the large pool, the longest unused first, until reserved memory is back under it (PyTorch `garbage_collect_cached_blocks`; gpupool gathers every stream's segments and ages a block by the blocks its stream freed since). Left out of the configuration string while off. |
//! | `expandable_segments` | `True` or `False` | False | Segments that grow by mapping more memory into one reserved address range (PyTorch `ExpandableSegment`). |
//! | `release_lock_on_cudamalloc` (also `release_lock_on_hipmalloc`) | `True` or `False` | False | PyTorch releases its device lock across `cudaMalloc`. Accepted and changes nothing: gpupool holds one lock per stream across `cuMemAlloc`, which blocks only that stream's callers. |
//! | `per_process_memory_fraction` | a number from 0 to 1 | 1 | Each device, when it starts, reserves at most this fraction of its total memory, as `gpupool_set_memory_fraction` sets it (PyTorch `setMemoryFraction`). |
//! | `graph_capture_record_stream_reuse` | `True` or `False` | False | PyTorch: during CUDA graph capture, blocks freed after `record_stream` may be reused within the graph. Accepted and changes nothing: gpupool has no graph capture. |
//! | `pinned_use_cuda_host_register` (also `pinned_use_hip_host_register`) | `True` or `False` | False | Pinned host memory (`gpupool_host_malloc`): `malloc` then `cuMemHostRegister` instead of `cuMemHostAlloc` for new blocks. |
//! | `pinned_num_register_threads` | a power of two, at most 128 | 1 | Pinned host memory: threads that touch (page in) a new block before `cuMemHostRegister` with `pinned_use_cuda_host_register` (PyTorch's bound, `pinned_max_register_threads`, is 128 and no key). |
//! | `pinned_use_background_threads` | `True` or `False` | False | Pinned host memory: a background thread polls the events of freed blocks every 100 µs, and allocations no longer poll them on the hit path. |
//! | `pinned_reserve_segment_size_mb` | whole MiB, at least 1 | none (0, which cannot be written) | Pinned host memory: one segment of this size pinned at the first miss and carved (4 KiB aligned) for new blocks while it has room; never released. Left out of the configuration string while unset. |
//!
//! `GPUPOOL_MAX_SPLIT_SIZE_MB` is the deprecated spelling of `max_split_size_mb`; both set to
//! different sizes is an error naming both. [`Config::with_conf`] applies a string at run time
//! (`gpupool_set_config`), and [`Config::conf_string`] writes every key back in the same syntax.

use std::ffi::{OsStr, OsString};
use std::fmt::Write;

use crate::error::Error;
use crate::history::{HistoryContext, HistorySettings};

mod conf;

pub use conf::{CONF_KEYS, CONF_VAR, ConfKey, ROUNDUP_INTERVALS, conf_keys_markdown};

/// The deprecated spelling of `GPUPOOL_CONF=max_split_size_mb:N`.
const MAX_SPLIT_ALIAS: &str = "GPUPOOL_MAX_SPLIT_SIZE_MB";
/// The kind column of `GPUPOOL_CONF`'s row.
const CONF_KIND: &str = "PyTorch's configuration string, `key:value,key:value`";
/// The meaning column of `GPUPOOL_CONF`'s row.
const CONF_DOC: &str = "the allocator's settings, as `PYTORCH_CUDA_ALLOC_CONF` holds them for PyTorch 2.11's native \
                        backend (the keys are listed below); an unknown key or a bad value is an error naming it";

/// Which driver the process-wide allocator uses (`GPUPOOL_DRIVER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverKind {
    /// The CUDA driver API (`libcuda.so.1`).
    Cuda,
    /// The simulated device: host memory, no GPU needed.
    Sim,
}

/// When the LD_PRELOAD shim lets a block freed through `cudaFree`/`cuMemFree` be reused
/// (`GPUPOOL_PRELOAD_MODE`; the shim's crate docs say why).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreloadMode {
    /// After a device synchronisation that follows the free (the default).
    Safe,
    /// At once, in stream order, as PyTorch's caching allocator does (one-stream programs).
    Stream,
}

/// The options of an allocator, one field per row of [`OPTIONS`] and per key of `GPUPOOL_CONF`
/// ([`CONF_KEYS`]). [`Config::default`] holds every row's and every key's default (PyTorch's
/// for the keys).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The driver [`Allocator::from_config`](crate::Allocator::from_config) starts.
    pub driver: DriverKind,
    /// Simulated devices (with [`DriverKind::Sim`]).
    pub sim_devices: i32,
    /// Bytes per simulated device.
    pub sim_capacity: usize,
    /// PyTorch's `max_split_size`, in bytes; `usize::MAX` (PyTorch's default) for none
    /// (`max_split_size_mb`, or the deprecated `GPUPOOL_MAX_SPLIT_SIZE_MB`).
    pub max_split_size: usize,
    /// PyTorch's `max_non_split_rounding_size`, in bytes: a request of at least
    /// `max_split_size` takes a cached block only if the block is less than this much larger
    /// (`max_non_split_rounding_mb`; default `large_segment_size`, 20 MiB).
    pub max_non_split_rounding: usize,
    /// PyTorch's `large_segment_size`, in bytes: the segment size for requests over 1 MiB and
    /// under 10 MiB (`large_segment_size_mb`; default 20 MiB, `kLargeBuffer`).
    pub large_segment_size: usize,
    /// PyTorch's `roundup_power2_divisions`, one entry per power-of-two size interval from
    /// 1 MiB ([`ROUNDUP_INTERVALS`]): 0 or 1 rounds requests in that interval to 512 bytes, more
    /// to that many steps between two powers of two. Default all 0.
    pub roundup_power2_divisions: [usize; ROUNDUP_INTERVALS],
    /// PyTorch's `garbage_collection_threshold`, a fraction over 0 and under 1; 0 (the default)
    /// for off. With a memory fraction set, a request that finds no cached block while
    /// reserved bytes are over this share of the limit first releases the oldest whole free
    /// segments of the large pool (PyTorch `garbage_collect_cached_blocks`).
    pub garbage_collection_threshold: f64,
    /// PyTorch's `expandable_segments`: segments are address ranges whose pages are mapped on
    /// demand (CUDA's virtual memory calls), when the device supports them.
    pub expandable_segments: bool,
    /// PyTorch's `release_lock_on_cudamalloc`. Changes nothing: gpupool's lock across
    /// `cuMemAlloc` is one stream's, not the device's.
    pub release_lock_on_cudamalloc: bool,
    /// PyTorch's `per_process_memory_fraction`, 0 to 1: applied to each device when it starts,
    /// as [`Allocator::set_memory_fraction`](crate::Allocator::set_memory_fraction) does.
    /// Default 1 (no limit is set).
    pub per_process_memory_fraction: f64,
    /// PyTorch's `graph_capture_record_stream_reuse`. Changes nothing: gpupool has no CUDA graph
    /// capture.
    pub graph_capture_record_stream_reuse: bool,
    /// PyTorch's `pinned_use_cuda_host_register`: the pinned host allocator (`crate::host`) pins
    /// new blocks with `malloc` and `cuMemHostRegister`.
    pub pinned_use_cuda_host_register: bool,
    /// PyTorch's `pinned_num_register_threads` (a power of two, at most 128; default 1): threads
    /// that touch a new registered block's pages.
    pub pinned_num_register_threads: usize,
    /// PyTorch's `pinned_use_background_threads`: a thread polls freed pinned blocks' events.
    pub pinned_use_background_threads: bool,
    /// PyTorch's `pinned_reserve_segment_size_mb`, in bytes (0, the default: none): one pinned
    /// segment carved for new pinned blocks, never released.
    pub pinned_reserve_segment_size: usize,
    /// The LD_PRELOAD shim's reuse rule for `cudaFree`/`cuMemFree`.
    pub preload_mode: PreloadMode,
    /// The LD_PRELOAD shim, safe mode: a device's deferred bytes that make the shim synchronise
    /// the device and release them.
    pub preload_sync_bytes: usize,
    /// The LD_PRELOAD shim writes its counts, the options and the memory summaries to stderr
    /// at exit.
    pub preload_stats: bool,
    /// gpupool's high-water rule for expandable segments (`GPUPOOL_EXPANDABLE_RECLAIM`, off by
    /// default): before an expandable segment grows past the device's peak reserved bytes
    /// (since the cache was last emptied or the peaks reset), wholly free pages mapped anywhere
    /// on the device are unmapped (after a device synchronisation). Off: PyTorch's behaviour.
    pub expandable_reclaim: bool,
    /// The allocation history an allocator records from its start
    /// ([`Allocator::new`](crate::Allocator::new); `GPUPOOL_RECORD_HISTORY`); `None` (the
    /// default): none until [`Allocator::record_history`](crate::Allocator::record_history).
    pub record_history: Option<HistorySettings>,
    /// The process-wide allocator prints the live report of each device it used to stderr at
    /// exit (`GPUPOOL_LIVE_REPORT_AT_EXIT`; see [`Allocator::live_report`](crate::Allocator::live_report)).
    pub live_report_at_exit: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            driver: DriverKind::Cuda,
            sim_devices: 1,
            sim_capacity: 16 << 30,
            max_split_size: usize::MAX,
            max_non_split_rounding: LARGE_SEGMENT,
            large_segment_size: LARGE_SEGMENT,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            release_lock_on_cudamalloc: false,
            per_process_memory_fraction: 1.0,
            graph_capture_record_stream_reuse: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size: 0,
            preload_mode: PreloadMode::Safe,
            preload_sync_bytes: 256 << 20,
            preload_stats: false,
            expandable_reclaim: false,
            record_history: None,
            live_report_at_exit: false,
        }
    }
}

/// What an option's value is, and so how its text is read (the module docs give the syntax).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A size in bytes, at least `min`; a number without a unit counts `unit` bytes.
    Size { unit: usize, min: usize },
    /// A whole number from `min` to `max`.
    Count { min: i64, max: i64 },
    /// On or off.
    Bool,
    /// One of these words (lower case; matched in any case).
    Word(&'static [&'static str]),
    /// The allocation history's settings: `off`, or `<max_entries>[:<context>]`, the events
    /// kept per device and which stacks (`none`, `state`, `alloc` or `all`; `all` when left
    /// out, PyTorch's default).
    History,
}

/// An option's value, as [`Kind`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value {
    /// Bytes (`usize::MAX`: unlimited).
    Size(usize),
    /// A count.
    Count(i64),
    /// A boolean.
    Bool(bool),
    /// One of the row's words, as the row spells it.
    Word(&'static str),
    /// History settings (`None`: off).
    History(Option<HistorySettings>),
}

/// One option: a row of [`OPTIONS`].
pub struct Opt {
    /// The environment variable.
    pub name: &'static str,
    /// How its value is read.
    pub kind: Kind,
    /// The value when the variable is unset or empty.
    pub default: Value,
    /// What it does, one line (the meaning column of the list).
    pub doc: &'static str,
    set: fn(&mut Config, Value),
    get: fn(&Config) -> Value,
}

const MIB: usize = 1 << 20;
/// PyTorch's default `large_segment_size` (`kLargeBuffer`, 20 MiB).
const LARGE_SEGMENT: usize = 20 * MIB;

/// Every option gpupool and the LD_PRELOAD shim read from the environment, in the order they
/// are read and printed. The module docs' list is made from it.
pub static OPTIONS: [Opt; 10] = [
    Opt {
        name: "GPUPOOL_DRIVER",
        kind: Kind::Word(&["cuda", "sim"]),
        default: Value::Word("cuda"),
        doc: "`cuda`: the CUDA driver API (libcuda.so.1, loaded at run time); `sim`: the simulated device (no GPU \
              needed). Never chosen silently: without a driver, calls return `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` and \
              print nothing.",
        set: |c, v| c.driver = if v == Value::Word("sim") { DriverKind::Sim } else { DriverKind::Cuda },
        get: |c| Value::Word(if c.driver == DriverKind::Sim { "sim" } else { "cuda" }),
    },
    Opt {
        name: "GPUPOOL_SIM_CAPACITY",
        kind: Kind::Size { unit: 1, min: 1 },
        default: Value::Size(16 << 30),
        doc: "bytes per simulated device",
        set: |c, v| c.sim_capacity = v.size(),
        get: |c| Value::Size(c.sim_capacity),
    },
    Opt {
        name: "GPUPOOL_SIM_DEVICES",
        kind: Kind::Count { min: 1, max: 64 },
        default: Value::Count(1),
        doc: "number of simulated devices",
        // The range check makes the count fit an i32.
        set: |c, v| c.sim_devices = v.count() as i32,
        get: |c| Value::Count(c.sim_devices.into()),
    },
    Opt {
        name: "GPUPOOL_MAX_SPLIT_SIZE_MB",
        // PyTorch 2.11: "max_split_size_mb too small, must be >= 20" (large_segment_size_mb,
        // 20 by default; checked against GPUPOOL_CONF's once both are read).
        kind: Kind::Size { unit: MIB, min: LARGE_SEGMENT },
        default: Value::Size(usize::MAX),
        doc: "Deprecated: use `GPUPOOL_CONF=max_split_size_mb:N`. PyTorch's `max_split_size_mb`: cached blocks \
              of at least this size are never split, and serve only requests of about their size. Set in both \
              with different values: an error naming both",
        set: |c, v| c.max_split_size = v.size(),
        get: |c| Value::Size(c.max_split_size),
    },
    Opt {
        name: "GPUPOOL_PRELOAD_MODE",
        kind: Kind::Word(&["safe", "stream"]),
        default: Value::Word("safe"),
        doc: "LD_PRELOAD shim: `safe` (a `cudaFree`d block waits for a device synchronisation) or `stream` (reused \
              at once, in stream order)",
        set: |c, v| c.preload_mode = if v == Value::Word("stream") { PreloadMode::Stream } else { PreloadMode::Safe },
        get: |c| Value::Word(if c.preload_mode == PreloadMode::Stream { "stream" } else { "safe" }),
    },
    Opt {
        name: "GPUPOOL_PRELOAD_SYNC_BYTES",
        kind: Kind::Size { unit: 1, min: 0 },
        default: Value::Size(256 * MIB),
        doc: "LD_PRELOAD shim, safe mode: deferred bytes on a device that trigger the synchronisation (0: at every \
              free)",
        set: |c, v| c.preload_sync_bytes = v.size(),
        get: |c| Value::Size(c.preload_sync_bytes),
    },
    Opt {
        name: "GPUPOOL_PRELOAD_STATS",
        kind: Kind::Bool,
        default: Value::Bool(false),
        doc: "LD_PRELOAD shim: at exit, print what was intercepted, these options and the memory summary of each \
              device used (stderr)",
        set: |c, v| c.preload_stats = v == Value::Bool(true),
        get: |c| Value::Bool(c.preload_stats),
    },
    Opt {
        name: "GPUPOOL_EXPANDABLE_RECLAIM",
        kind: Kind::Bool,
        default: Value::Bool(false),
        doc: "With `expandable_segments:True`: a segment does not grow past the device's peak reserved bytes (since the cache was last emptied or the peak statistics reset) while wholly free pages are mapped anywhere on the device; they are unmapped first (a device synchronisation), so that reserved memory stays near the most ever in use. Off: PyTorch's behaviour (pages are unmapped only by `empty_cache` and on out of memory), much faster where shapes change (see the README's fragmentation table)",
        set: |c, v| c.expandable_reclaim = v == Value::Bool(true),
        get: |c| Value::Bool(c.expandable_reclaim),
    },
    Opt {
        name: "GPUPOOL_RECORD_HISTORY",
        kind: Kind::History,
        default: Value::History(None),
        doc: "Records the allocation history from the start, as `gpupool_record_history(1, max_entries, context)` \
              would (PyTorch `_record_memory_history`): the newest `max_entries` events per device and the call \
              stacks of `context` (`none`, `state`, `alloc` or `all`, default `all`); `gpupool_dump_snapshot` \
              writes them",
        set: |c, v| {
            if let Value::History(h) = v {
                c.record_history = h;
            }
        },
        get: |c| Value::History(c.record_history),
    },
    Opt {
        name: "GPUPOOL_LIVE_REPORT_AT_EXIT",
        kind: Kind::Bool,
        default: Value::Bool(false),
        doc: "At exit, print the live report of each device used (stderr): its allocated blocks grouped by tag and \
              by call stack, largest first, as `gpupool_live_report` prints it; what a leak hunt reads",
        set: |c, v| c.live_report_at_exit = v == Value::Bool(true),
        get: |c| Value::Bool(c.live_report_at_exit),
    },
];

impl Value {
    fn size(self) -> usize {
        match self {
            Value::Size(n) => n,
            _ => unreachable!("a size option's setter got {self:?}"),
        }
    }

    fn count(self) -> i64 {
        match self {
            Value::Count(n) => n,
            _ => unreachable!("a count option's setter got {self:?}"),
        }
    }
}

impl Kind {
    /// Reads `text` (trimmed, not empty) as this kind; `None` when it does not parse or is out
    /// of range.
    pub fn parse(&self, text: &str) -> Option<Value> {
        match *self {
            Kind::Size { unit, min } => parse_size_in(text, unit).filter(|&n| n >= min).map(Value::Size),
            Kind::Count { min, max } => text.parse().ok().filter(|n| (min..=max).contains(n)).map(Value::Count),
            Kind::Bool => match text.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Some(Value::Bool(true)),
                "0" | "false" | "no" | "off" => Some(Value::Bool(false)),
                _ => None,
            },
            Kind::Word(words) => words.iter().find(|w| w.eq_ignore_ascii_case(text)).map(|&w| Value::Word(w)),
            Kind::History => parse_history(text).map(Value::History),
        }
    }

    /// What a value of this kind must look like, for error messages.
    pub fn expected(&self) -> String {
        match *self {
            Kind::Size { unit, min } => {
                let counts = unit_name(unit);
                let min = if min == 0 { String::new() } else { format!(", at least {}", show_size(min, unit)) };
                format!(
                    "a size such as 4096, 512K or 16GiB (a bare number counts {counts}; units K, M, G, T or \
                     KiB, MiB, GiB, TiB are powers of 1024){min}"
                )
            }
            Kind::Count { min, max } => format!("a whole number from {min} to {max}"),
            Kind::Bool => "a boolean: 1/0, true/false, yes/no or on/off".to_string(),
            Kind::Word(words) => words.join(" or "),
            Kind::History => "off, or the events kept per device with an optional context: 100000 or 100000:alloc \
                              (contexts none, state, alloc, all; all when left out)"
                .to_string(),
        }
    }

    /// `value` written so that [`Kind::parse`] reads it back (`unlimited` for the size
    /// `usize::MAX`, which cannot be written).
    pub fn show(&self, value: Value) -> String {
        match (*self, value) {
            (Kind::Size { unit, .. }, Value::Size(n)) => show_size(n, unit),
            (_, Value::Size(n)) => n.to_string(),
            (_, Value::Count(n)) => n.to_string(),
            (_, Value::Bool(b)) => (if b { "on" } else { "off" }).to_string(),
            (_, Value::Word(w)) => w.to_string(),
            (_, Value::History(None)) => "off".to_string(),
            (_, Value::History(Some(h))) => format!("{}:{}", h.max_entries, h.context.name()),
        }
    }

    /// The kind column of the list.
    fn describe(&self) -> String {
        match *self {
            Kind::Size { unit, min } => {
                let bare =
                    if unit == 1 { String::new() } else { format!(" (a bare number counts {})", unit_name(unit)) };
                let min = if min == 0 { String::new() } else { format!(", at least {}", show_size(min, unit)) };
                format!("size{bare}{min}")
            }
            Kind::Count { min, max } => format!("count, {min} to {max}"),
            Kind::Bool => "boolean".to_string(),
            Kind::Word(words) => words.iter().map(|w| format!("`{w}`")).collect::<Vec<_>>().join(" or "),
            Kind::History => "`off` or `<max_entries>[:<context>]`".to_string(),
        }
    }
}

/// Reads history settings: `off`, or `<max_entries>[:<context>]` (see [`Kind::History`]).
fn parse_history(text: &str) -> Option<Option<HistorySettings>> {
    if text.eq_ignore_ascii_case("off") {
        return Some(None);
    }
    let (n, context) = match text.split_once(':') {
        Some((n, c)) => {
            let c = c.trim();
            let context = [HistoryContext::None, HistoryContext::State, HistoryContext::Alloc, HistoryContext::All]
                .into_iter()
                .find(|h| h.name().eq_ignore_ascii_case(c))?;
            (n, context)
        }
        None => (text, HistoryContext::All),
    };
    let max_entries = n.trim().parse().ok()?;
    Some(Some(HistorySettings { max_entries, context }))
}

impl Opt {
    /// The one reader of a value: `text` from `origin` (the variable, or later a key of
    /// another syntax), trimmed. `Ok(None)` when it is empty (unset).
    ///
    /// Errors: [`Error::InvalidValue`] naming `origin`, the value and what is expected.
    pub fn parse_text(&self, origin: &str, text: &str) -> Result<Option<Value>, Error> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(None);
        }
        self.kind.parse(t).map(Some).ok_or_else(|| {
            Error::InvalidValue(format!("{origin}={text:?} is not valid: expected {}", self.kind.expected()))
        })
    }

    /// Reads this option's environment value `raw` (as `std::env::var_os` gives it); `Ok(None)`
    /// when unset or empty.
    ///
    /// Errors: [`Error::InvalidValue`] naming the variable when `raw` is not valid UTF-8 or
    /// does not parse.
    pub fn read(&self, raw: Option<&OsStr>) -> Result<Option<Value>, Error> {
        let Some(raw) = raw else { return Ok(None) };
        let origin = format!("environment variable {}", self.name);
        match raw.to_str() {
            Some(text) => self.parse_text(&origin, text),
            None => Err(Error::InvalidValue(format!(
                "{origin}={raw:?} is not valid UTF-8: expected {}",
                self.kind.expected()
            ))),
        }
    }

    /// This option's value in `config`.
    pub fn get(&self, config: &Config) -> Value {
        (self.get)(config)
    }

    /// Sets this option in `config`. `value` must be one [`Opt::parse_text`] of this row gave,
    /// or [`Opt::default`].
    pub fn set(&self, config: &mut Config, value: Value) {
        (self.set)(config, value)
    }
}

impl Config {
    /// Reads every option from the environment (`std::env::var_os`).
    ///
    /// Errors: [`Error::InvalidValue`] naming the first variable, in [`OPTIONS`] order, whose
    /// value is not valid UTF-8 or does not parse.
    pub fn from_env() -> Result<Config, Error> {
        Config::from_lookup(|name| std::env::var_os(name))
    }

    /// Reads every option through `get` (the environment, or a test's table), as
    /// [`Config::from_env`] does: the rows of [`OPTIONS`], then `GPUPOOL_CONF`.
    ///
    /// Errors: [`Error::InvalidValue`] naming the first variable whose value is not valid
    /// UTF-8 or does not parse (for `GPUPOOL_CONF`, the key and its value);
    /// `GPUPOOL_MAX_SPLIT_SIZE_MB` and `GPUPOOL_CONF`'s `max_split_size_mb` set to different
    /// sizes, or the former under `large_segment_size_mb`.
    pub fn from_lookup<V: Into<OsString>>(get: impl Fn(&str) -> Option<V>) -> Result<Config, Error> {
        let mut c = Config::default();
        let mut alias = None;
        for opt in &OPTIONS {
            let raw = get(opt.name).map(Into::into);
            if let Some(v) = opt.read(raw.as_deref())? {
                opt.set(&mut c, v);
                if opt.name == MAX_SPLIT_ALIAS {
                    alias = Some(c.max_split_size);
                }
            }
        }
        let origin = format!("environment variable {CONF_VAR}");
        let seen = match get(CONF_VAR).map(Into::into) {
            None => None,
            Some(raw) => match raw.to_str() {
                Some(text) => {
                    c.max_split_size = usize::MAX;
                    Some(c.apply_conf(&origin, text)?)
                }
                None => {
                    return Err(Error::InvalidValue(format!(
                        "{origin}={raw:?} is not valid UTF-8: expected PyTorch's configuration string, \
                         key:value,key:value"
                    )));
                }
            },
        };
        if let Some(bytes) = alias {
            let show = |n| OPTIONS.iter().find(|o| o.name == MAX_SPLIT_ALIAS).expect("a row").kind.show(Value::Size(n));
            if seen.is_some_and(|s| s.max_split_size) {
                if c.max_split_size != bytes {
                    return Err(Error::InvalidValue(format!(
                        "environment variables {MAX_SPLIT_ALIAS}={} and {CONF_VAR} with max_split_size_mb:{} \
                         disagree; set max_split_size_mb in {CONF_VAR} only ({MAX_SPLIT_ALIAS} is deprecated)",
                        show(bytes),
                        show(c.max_split_size),
                    )));
                }
            } else if bytes < c.large_segment_size {
                return Err(Error::InvalidValue(format!(
                    "environment variable {MAX_SPLIT_ALIAS}={} is under {CONF_VAR}'s large_segment_size_mb:{}: \
                     expected at least that (PyTorch's max_split_size_mb floor)",
                    show(bytes),
                    c.large_segment_size / MIB,
                )));
            } else {
                c.max_split_size = bytes;
            }
        }
        Ok(c)
    }

    /// Every option with its value in this config, one line each, `(default)` after a value
    /// that is the default (mimalloc's `mi_options_print`); `GPUPOOL_CONF` last, with every
    /// key ([`Config::conf_string`]):
    ///
    /// ```text
    /// GPUPOOL_DRIVER=sim
    /// GPUPOOL_SIM_CAPACITY=16GiB (default)
    /// GPUPOOL_CONF=backend:native,large_segment_size_mb:20,...
    /// ```
    pub fn options_text(&self) -> String {
        let mut out = String::new();
        for opt in &OPTIONS {
            let v = opt.get(self);
            let default = if v == opt.default { " (default)" } else { "" };
            let _ = writeln!(out, "{}={}{default}", opt.name, opt.kind.show(v));
        }
        let conf = self.conf_string();
        let default = if conf == Config::default().conf_string() { " (default)" } else { "" };
        let _ = writeln!(out, "{CONF_VAR}={conf}{default}");
        out
    }
}

/// The list of options as a markdown table, made from [`OPTIONS`]: the module docs and the
/// README's list of environment variables are this text.
pub fn options_markdown() -> String {
    let mut out = String::from("| variable | kind | default | meaning |\n|---|---|---|---|\n");
    for opt in &OPTIONS {
        let d = opt.kind.show(opt.default);
        let d = if opt.default == Value::Size(usize::MAX) { d } else { format!("`{d}`") };
        let _ = writeln!(out, "| `{}` | {} | {d} | {} |", opt.name, opt.kind.describe(), opt.doc);
    }
    let _ = writeln!(out, "| `{CONF_VAR}` | {CONF_KIND} | empty | {CONF_DOC} |");
    out
}

/// The unit a bare number counts.
fn unit_name(unit: usize) -> String {
    match unit {
        1 => "bytes".to_string(),
        MIB => "MiB".to_string(),
        u => format!("units of {u} bytes"),
    }
}

/// `n` bytes in the largest unit that divides them ("16GiB"), or bare when `unit` is bytes
/// and none does; `unlimited` for `usize::MAX`.
fn show_size(n: usize, unit: usize) -> String {
    if n == usize::MAX {
        return "unlimited".to_string();
    }
    for (shift, name) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n != 0 && n % (1 << shift) == 0 {
            return format!("{}{name}", n >> shift);
        }
    }
    if unit == 1 { n.to_string() } else { format!("{n}B") }
}

/// Parses "4096", "512K", "64MiB", "16 GiB" (case-insensitive; every unit a power of 1024) to
/// bytes; `None` when it does not parse or overflows.
pub fn parse_size(text: &str) -> Option<usize> {
    parse_size_in(text, 1)
}

/// As [`parse_size`], a number without a unit counting `unit` bytes.
fn parse_size_in(text: &str, unit: usize) -> Option<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: usize = digits.parse().ok()?;
    let scale = match suffix.trim().to_ascii_lowercase().as_str() {
        "" => unit,
        "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStringExt;

    use super::*;

    fn table(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn one(name: &str, value: &str) -> Result<Config, Error> {
        Config::from_lookup(table(&[(name, value)]))
    }

    fn opt(name: &str) -> &'static Opt {
        OPTIONS.iter().find(|o| o.name == name).unwrap()
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64MiB"), Some(64 << 20));
        assert_eq!(parse_size("16 GiB"), Some(16 << 30));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }

    #[test]
    fn options_parse_and_bad_values_are_named() {
        let c = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "sim"), ("GPUPOOL_SIM_DEVICES", "2")])).unwrap();
        assert_eq!((c.driver, c.sim_devices), (DriverKind::Sim, 2));
        let c = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "64")])).unwrap();
        assert_eq!(c.max_split_size, 64 << 20);
        let e = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "opencl")])).unwrap_err();
        assert!(e.message().contains("GPUPOOL_DRIVER"), "{e}");
        let e = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "19")])).unwrap_err();
        assert!(e.message().contains("at least 20MiB"), "{e}");
    }

    #[test]
    fn the_defaults_are_the_tables() {
        let c = Config::default();
        for o in &OPTIONS {
            assert_eq!(o.get(&c), o.default, "{}", o.name);
        }
        assert_eq!(Config::from_lookup(|_| None::<String>).unwrap(), c);
    }

    #[test]
    fn every_size_option_takes_every_suffix() {
        let sizes: Vec<&Opt> = OPTIONS.iter().filter(|o| matches!(o.kind, Kind::Size { .. })).collect();
        assert_eq!(sizes.len(), 3);
        let cases = [
            ("64M", 64 << 20),
            ("64MiB", 64 << 20),
            ("64mb", 64 << 20),
            ("65536K", 64 << 20),
            ("65536 KiB", 64 << 20),
            ("1G", 1 << 30),
            ("1gib", 1 << 30),
            ("1T", 1 << 40),
            ("1TiB", 1 << 40),
            (" 2 GiB ", 2 << 30),
            ("67108864B", 64 << 20),
        ];
        for o in sizes {
            for (text, bytes) in cases {
                let c = one(o.name, text).unwrap_or_else(|e| panic!("{}={text:?}: {e}", o.name));
                assert_eq!(o.get(&c), Value::Size(bytes), "{}={text:?}", o.name);
            }
            for bad in ["12X", "1.5G", "-1", "G", "1 G B", "99999999999T"] {
                let e = one(o.name, bad).unwrap_err();
                assert!(e.message().contains(o.name) && e.message().contains("a size"), "{e}");
            }
        }
        // The case that used to be refused: the shim's size in the size syntax.
        assert_eq!(one("GPUPOOL_PRELOAD_SYNC_BYTES", "256MiB").unwrap().preload_sync_bytes, 256 << 20);
        // A bare number counts bytes, except in the option PyTorch counts in MiB.
        assert_eq!(one("GPUPOOL_SIM_CAPACITY", "4096").unwrap().sim_capacity, 4096);
        assert_eq!(one("GPUPOOL_PRELOAD_SYNC_BYTES", "0").unwrap().preload_sync_bytes, 0);
        assert_eq!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "20").unwrap().max_split_size, 20 << 20);
        assert!(one("GPUPOOL_SIM_CAPACITY", "0").is_err());
        assert!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "19MiB").is_err());
        assert!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "99999999999999999").is_err());
    }

    #[test]
    fn empty_means_unset_for_every_option() {
        for name in OPTIONS.iter().map(|o| o.name).chain([CONF_VAR]) {
            for empty in ["", "  ", "\t"] {
                assert_eq!(one(name, empty), Ok(Config::default()), "{name}={empty:?}");
            }
        }
    }

    #[test]
    fn words_and_booleans_ignore_case() {
        assert_eq!(one("GPUPOOL_DRIVER", "SIM").unwrap().driver, DriverKind::Sim);
        assert_eq!(one("GPUPOOL_DRIVER", " Cuda ").unwrap().driver, DriverKind::Cuda);
        assert_eq!(one("GPUPOOL_PRELOAD_MODE", "Stream").unwrap().preload_mode, PreloadMode::Stream);
        assert_eq!(one("GPUPOOL_PRELOAD_MODE", "SAFE").unwrap().preload_mode, PreloadMode::Safe);
        for yes in ["1", "true", "TRUE", "yes", "Yes", "on", "ON"] {
            assert!(one("GPUPOOL_PRELOAD_STATS", yes).unwrap().preload_stats, "{yes}");
        }
        for no in ["0", "false", "False", "no", "NO", "off", "Off"] {
            assert!(!one("GPUPOOL_PRELOAD_STATS", no).unwrap().preload_stats, "{no}");
        }
        for bad in ["2", "y", "enabled"] {
            let e = one("GPUPOOL_PRELOAD_STATS", bad).unwrap_err();
            assert!(e.message().contains("GPUPOOL_PRELOAD_STATS") && e.message().contains("on/off"), "{e}");
        }
    }

    #[test]
    fn counts_keep_their_range() {
        assert_eq!(one("GPUPOOL_SIM_DEVICES", "64").unwrap().sim_devices, 64);
        for bad in ["0", "65", "-1", "two", "1K"] {
            let e = one("GPUPOOL_SIM_DEVICES", bad).unwrap_err();
            assert!(e.message().contains("from 1 to 64"), "{e}");
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_is_an_error_naming_the_variable() {
        let rows = OPTIONS.iter().map(|o| {
            let default = o.kind.show(o.default);
            (o.name, if default == "unlimited" { "64".to_string() } else { default })
        });
        for (name, valid) in rows.chain([(CONF_VAR, "max_split_size_mb:64".to_string())]) {
            let mut bytes = valid.into_bytes();
            bytes.push(0xff);
            let raw = OsString::from_vec(bytes);
            let e = Config::from_lookup(|n| (n == name).then(|| raw.clone())).unwrap_err();
            assert!(matches!(e, Error::InvalidValue(_)));
            assert!(e.message().contains(name) && e.message().contains("not valid UTF-8"), "{e}");
            assert!(e.message().contains("\\xFF"), "the value is shown: {e}");
        }
    }

    #[test]
    fn bad_values_name_the_variable_the_value_and_what_is_expected() {
        let cases = [
            ("GPUPOOL_DRIVER", "opencl", "cuda or sim"),
            ("GPUPOOL_SIM_CAPACITY", "16Q", "a size"),
            ("GPUPOOL_SIM_DEVICES", "0", "from 1 to 64"),
            ("GPUPOOL_MAX_SPLIT_SIZE_MB", "4", "at least 20MiB"),
            ("GPUPOOL_PRELOAD_MODE", "fast", "safe or stream"),
            ("GPUPOOL_PRELOAD_SYNC_BYTES", "lots", "a size"),
            ("GPUPOOL_PRELOAD_STATS", "maybe", "a boolean"),
            ("GPUPOOL_EXPANDABLE_RECLAIM", "sometimes", "a boolean"),
            ("GPUPOOL_RECORD_HISTORY", "100000:stacks", "100000:alloc"),
            ("GPUPOOL_LIVE_REPORT_AT_EXIT", "later", "a boolean"),
        ];
        assert_eq!(cases.len(), OPTIONS.len());
        for (name, value, want) in cases {
            let e = one(name, value).unwrap_err();
            let m = e.message();
            assert!(matches!(e, Error::InvalidValue(_)));
            assert!(m.contains(name) && m.contains(&format!("{value:?}")) && m.contains(want), "{m}");
        }
    }

    #[test]
    fn history_settings_parse() {
        let h = |t: &str| one("GPUPOOL_RECORD_HISTORY", t).map(|c| c.record_history);
        let on = |max_entries, context| Ok(Some(HistorySettings { max_entries, context }));
        assert_eq!(h(""), Ok(None));
        assert_eq!(h("off"), Ok(None));
        assert_eq!(h("100000"), on(100000, HistoryContext::All));
        assert_eq!(h(" 5000 : State "), on(5000, HistoryContext::State));
        assert_eq!(h("0:none"), on(0, HistoryContext::None));
        assert_eq!(h("7:alloc"), on(7, HistoryContext::Alloc));
        for bad in ["on", "-1", "10:", "10:stacks", ":all", "1e5", "10:all:x"] {
            assert!(h(bad).is_err(), "{bad}");
        }
        let row = opt("GPUPOOL_RECORD_HISTORY");
        let v = Value::History(Some(HistorySettings { max_entries: 12, context: HistoryContext::Alloc }));
        assert_eq!(row.kind.show(v), "12:alloc");
    }

    #[test]
    fn options_text_shows_every_option_with_its_value() {
        let c = Config::from_lookup(table(&[
            ("GPUPOOL_DRIVER", "sim"),
            ("GPUPOOL_SIM_CAPACITY", "64M"),
            ("GPUPOOL_PRELOAD_STATS", "yes"),
        ]))
        .unwrap();
        let text = c.options_text();
        assert_eq!(
            text,
            "GPUPOOL_DRIVER=sim\n\
             GPUPOOL_SIM_CAPACITY=64MiB\n\
             GPUPOOL_SIM_DEVICES=1 (default)\n\
             GPUPOOL_MAX_SPLIT_SIZE_MB=unlimited (default)\n\
             GPUPOOL_PRELOAD_MODE=safe (default)\n\
             GPUPOOL_PRELOAD_SYNC_BYTES=256MiB (default)\n\
             GPUPOOL_PRELOAD_STATS=on\n\
             GPUPOOL_EXPANDABLE_RECLAIM=off (default)\n\
             GPUPOOL_RECORD_HISTORY=off (default)\n\
             GPUPOOL_LIVE_REPORT_AT_EXIT=off (default)\n\
             GPUPOOL_CONF=backend:native,large_segment_size_mb:20,max_split_size_mb:17592186044415,\
             max_non_split_rounding_mb:20,roundup_power2_divisions:[1:0,>:0],expandable_segments:False,\
             release_lock_on_cudamalloc:False,per_process_memory_fraction:1,\
             graph_capture_record_stream_reuse:False,pinned_use_cuda_host_register:False,\
             pinned_num_register_threads:1,pinned_use_background_threads:False (default)\n"
        );
        let c =
            Config::from_lookup(table(&[("GPUPOOL_CONF", "max_split_size_mb:64, expandable_segments:True")])).unwrap();
        let last = c.options_text().lines().last().unwrap().to_string();
        assert!(last.starts_with("GPUPOOL_CONF=backend:native,"), "{last}");
        assert!(last.contains(",max_split_size_mb:64,") && last.contains(",expandable_segments:True,"), "{last}");
        assert!(!last.ends_with("(default)"), "{last}");
        // Every shown value reads back to itself.
        for o in &OPTIONS {
            for v in [o.default, o.get(&c)] {
                if v != Value::Size(usize::MAX) {
                    assert_eq!(o.parse_text(o.name, &o.kind.show(v)), Ok(Some(v)), "{}", o.name);
                }
            }
        }
        assert_eq!(opt("GPUPOOL_SIM_CAPACITY").kind.show(Value::Size(1000)), "1000");
        assert_eq!(opt("GPUPOOL_MAX_SPLIT_SIZE_MB").kind.show(Value::Size(1000)), "1000B");
    }

    #[test]
    fn the_module_docs_and_the_readme_hold_the_tables() {
        for table in [options_markdown(), conf_keys_markdown()] {
            let docs: String = table.lines().map(|l| format!("//! {l}\n")).collect();
            assert!(include_str!("config.rs").contains(&docs), "src/config.rs's module docs must hold:\n{docs}");
            assert!(include_str!("../README.md").contains(&table), "README.md must hold:\n{table}");
        }
    }

    #[test]
    fn the_deprecated_max_split_variable_agrees_with_gpupool_conf_or_is_refused() {
        let both = |alias: &str, conf: &str| {
            Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", alias), ("GPUPOOL_CONF", conf)]))
        };
        // Alone, or with a GPUPOOL_CONF that does not name the key, it still works.
        assert_eq!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "64").unwrap().max_split_size, 64 << 20);
        let c = both("64", "expandable_segments:True").unwrap();
        assert_eq!((c.max_split_size, c.expandable_segments), (64 << 20, true));
        // The same size both ways is no conflict, in any unit.
        assert_eq!(both("64MiB", "max_split_size_mb:64").unwrap().max_split_size, 64 << 20);
        assert_eq!(both("1G", "max_split_size_mb:1024").unwrap().max_split_size, 1 << 30);
        // Different sizes: an error naming both.
        let e = both("64", "max_split_size_mb:128").unwrap_err();
        let m = e.message();
        assert!(matches!(e, Error::InvalidValue(_)));
        assert!(m.contains("GPUPOOL_MAX_SPLIT_SIZE_MB=64MiB") && m.contains("GPUPOOL_CONF"), "{m}");
        assert!(m.contains("max_split_size_mb:128MiB") && m.contains("deprecated"), "{m}");
        // Its floor is GPUPOOL_CONF's large_segment_size_mb, as for the key.
        let e = both("32", "large_segment_size_mb:64").unwrap_err();
        assert!(
            e.message().contains("GPUPOOL_MAX_SPLIT_SIZE_MB=32MiB") && e.message().contains("large_segment_size_mb:64")
        );
        assert_eq!(both("64", "large_segment_size_mb:64").unwrap().max_split_size, 64 << 20);
    }

    #[test]
    fn a_bad_gpupool_conf_is_an_error_naming_the_variable_the_key_and_the_value() {
        let e = one("GPUPOOL_CONF", "expandable_segments:yes").unwrap_err();
        let m = e.message();
        assert!(matches!(e, Error::InvalidValue(_)));
        assert!(m.contains("environment variable GPUPOOL_CONF") && m.contains("expandable_segments:yes"), "{m}");
        assert!(m.contains("True or False"), "{m}");
    }
}
