//! The table of options: [`OPTIONS`], one row per `GPUPOOL_*` environment variable, each with
//! its kind, its default, its meaning and the field of [`Config`] it reads and writes. The data
//! only: how a value's text is read is in `parse`, how the environment is read in `env`, how
//! the table is printed in `print`.

use super::{Config, DriverKind, LARGE_SEGMENT, MIB, PreloadMode};
use crate::history::HistorySettings;

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
    /// The allocation history's settings: `off`, or `<max_entries>[:<context>[:<stacks>]]`,
    /// the events kept per device, which stacks (`none`, `state`, `alloc` or `all`; `all` when
    /// left out, PyTorch's default) and which frames they hold (`all`, `python`, `native`; `all`
    /// when left out).
    History,
    /// A file's path: any text that does not end with `/` (a folder's). Not read as a path
    /// until it is used; UTF-8 only, as every value.
    Path,
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
    /// A path (`None`: unset). The text lives as long as the process: [`Kind::parse`] leaks
    /// it, which costs its bytes once per read of the option (once per process, outside tests).
    Path(Option<&'static str>),
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

/// Every option gpupool and the LD_PRELOAD shim read from the environment, in the order they
/// are read and printed. The module docs' list is made from it.
pub static OPTIONS: [Opt; 20] = [
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
        name: "GPUPOOL_SIM_START_DELAY_MS",
        kind: Kind::Count { min: 0, max: 60_000 },
        default: Value::Count(0),
        doc: "milliseconds the simulated driver's start takes, for tests of what other threads and fork() do \
              while gpupool starts (a real driver's start takes about this long)",
        set: |c, v| c.sim_start_delay_ms = v.count() as u64,
        get: |c| Value::Count(c.sim_start_delay_ms as i64),
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
        // The largest, 17592186044415 MiB, means unlimited, as max_split_size_mb's does.
        set: |c, v| c.max_split_size = if v.size() >= usize::MAX / MIB * MIB { usize::MAX } else { v.size() },
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
        doc: "With `expandable_segments:True`: a segment does not grow past the device's peak reserved bytes (since the cache was last emptied or the peak statistics reset) while wholly free pages are mapped anywhere on the device; they are unmapped first (the growing stream's own after its queued work has run, an event recorded on it and waited for; other streams' after a device synchronisation), so that reserved memory stays near the most ever in use. Off: PyTorch's behaviour (pages are unmapped only by `empty_cache` and on out of memory), much faster where shapes change (see docs/fragmentation.md)",
        set: |c, v| c.expandable_reclaim = v == Value::Bool(true),
        get: |c| Value::Bool(c.expandable_reclaim),
    },
    Opt {
        name: "GPUPOOL_EXPANDABLE_LARGE_PAGES",
        kind: Kind::Bool,
        default: Value::Bool(true),
        doc: "With expandable segments: requests of 20 MiB and more grow address ranges of their own, mapped in 20 MiB pages (PyTorch's page in its large pool), and smaller ones ranges of 2 MiB pages (gpupool's page in both pools when off); a growth for a request of 20 MiB and more maps 2 MiB pages instead where they map fewer bytes than its large pages, at most 64 of them, and where the bytes they save are at least a 480th of those the pool maps (not with `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST=0` nor with `GPUPOOL_EXPANDABLE_RECLAIM`): far fewer driver calls for large blocks than 2 MiB pages alone at about their reserved memory, and with `GPUPOOL_EXPANDABLE_RECLAIM` far fewer pages moved in a warm pass (see docs/fragmentation.md)",
        set: |c, v| c.expandable_large_pages = v == Value::Bool(true),
        get: |c| Value::Bool(c.expandable_large_pages),
    },
    Opt {
        name: "GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST",
        kind: Kind::Count { min: 0, max: 1 << 20 },
        default: Value::Count(16),
        doc: "With `GPUPOOL_EXPANDABLE_LARGE_PAGES`: a request of 20 MiB or more maps at most this many pages; its address range's page is 20 MiB doubled until it does (a 4 GiB request maps 13 pages of 320 MiB rather than 205 of 20 MiB: each page is a `cuMemCreate` and a `cuMemMap`, tens of microseconds whatever its size); where the device has no room for what the larger pages map past the request, it is grown in smaller ones, down to 20 MiB. 0, or with `GPUPOOL_EXPANDABLE_RECLAIM` (whose point is the least reserved memory): 20 MiB pages at any size, as PyTorch maps them (see docs/fragmentation.md)",
        set: |c, v| c.expandable_pages_per_request = v.count() as usize,
        get: |c| Value::Count(c.expandable_pages_per_request as i64),
    },
    Opt {
        name: "GPUPOOL_RELEASE_UNUSED_STREAMS",
        kind: Kind::Bool,
        default: Value::Bool(false),
        doc: "Before a stream's growth takes the device's physical memory past its high-water mark, the cache of every other stream that holds no block (nothing allocated, nothing awaiting an event) is released as `empty_cache` releases it, so that a program creating a stream per request or step keeps reserved memory flat (gpupool's; PyTorch keeps each stream's cache until the device runs out of memory). Off (the default): PyTorch's behaviour; `gpupool_largest_allocatable` does not count what this would release (see docs/fragmentation.md)",
        set: |c, v| c.release_unused_streams = v == Value::Bool(true),
        get: |c| Value::Bool(c.release_unused_streams),
    },
    Opt {
        name: "GPUPOOL_SLEEP_CHUNK",
        kind: Kind::Size { unit: 1, min: 1 },
        default: Value::Size(32 * MIB),
        doc: "`gpupool_sleep` and `gpupool_wake` with offload: bytes of each pinned staging buffer, the most one \
              copy between the device and the host copy carries (blocks are cut into, and small blocks packed \
              into, pieces of this size; see docs/sleep.md)",
        set: |c, v| c.sleep_chunk = v.size(),
        get: |c| Value::Size(c.sleep_chunk),
    },
    Opt {
        name: "GPUPOOL_SLEEP_BUFFERS",
        kind: Kind::Count { min: 2, max: 64 },
        default: Value::Count(4),
        doc: "`gpupool_sleep` and `gpupool_wake` with offload: pinned staging buffers per device (the ring), \
              allocated at the first offload and kept until `gpupool_empty_cache`; buffers times \
              `GPUPOOL_SLEEP_CHUNK` bytes of pinned host memory",
        // The range check makes the count fit a usize.
        set: |c, v| c.sleep_buffers = v.count() as usize,
        get: |c| Value::Count(c.sleep_buffers as i64),
    },
    Opt {
        name: "GPUPOOL_SLEEP_THREADS",
        kind: Kind::Count { min: 0, max: 256 },
        default: Value::Count(0),
        doc: "`gpupool_sleep` and `gpupool_wake` with offload: CPU threads (the calling one included) that copy \
              between the staging buffers and the host copy while the device copies the next buffer; 0: the \
              cores the process may use, at most 16",
        // The range check makes the count fit a usize.
        set: |c, v| c.sleep_threads = v.count() as usize,
        get: |c| Value::Count(c.sleep_threads as i64),
    },
    Opt {
        name: "GPUPOOL_SLEEP_PAGE",
        kind: Kind::Size { unit: MIB, min: 2 * MIB },
        default: Value::Size(64 * MIB),
        doc: "Sleepable private pools (`gpupool_pool_create_sleepable`): the page of their expandable \
              segments, every request's, rounded up to the driver's granularity (2 MiB). A sleep unmaps \
              and releases each page and a wake creates and maps it again, tens of microseconds a page \
              whatever its size, so larger pages cost a sleep and a wake less beside the copy; a pool \
              reserves up to a page more than it uses at the end of each of its ranges (see docs/sleep.md)",
        set: |c, v| c.sleep_page = v.size(),
        get: |c| Value::Size(c.sleep_page),
    },
    Opt {
        name: "GPUPOOL_SLEEP_HUGE_PAGES",
        kind: Kind::Bool,
        default: Value::Bool(true),
        doc: "`gpupool_sleep` with offload: the host copy (ordinary memory, an anonymous mapping unmapped at \
              `gpupool_wake`) asks for transparent huge pages (`MADV_HUGEPAGE`), a 512th of the page faults \
              when it is first written",
        set: |c, v| c.sleep_huge_pages = v == Value::Bool(true),
        get: |c| Value::Bool(c.sleep_huge_pages),
    },
    Opt {
        name: "GPUPOOL_RECORD_HISTORY",
        kind: Kind::History,
        default: Value::History(None),
        doc: "Records the allocation history from the start, as `gpupool_record_history(1, max_entries, context)` \
              would (PyTorch `_record_memory_history`): the newest `max_entries` events per device and the call \
              stacks of `context` (`none`, `state`, `alloc` or `all`, default `all`), holding the frames of \
              `stacks` (`all`: native and, under CPython, Python; `python`; `native`; default `all`); \
              `gpupool_dump_snapshot` writes them",
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
    Opt {
        name: "GPUPOOL_SNAPSHOT_AT_EXIT",
        kind: Kind::Path,
        default: Value::Path(None),
        doc: "At exit, write the snapshot of every device used to this file, as `gpupool_dump_snapshot` writes it \
              (PyTorch's pickle, with the history `GPUPOOL_RECORD_HISTORY` recorded): how a program that never \
              calls gpupool, run under the LD_PRELOAD shim, gets one. A file that cannot be written: one line on \
              stderr naming it",
        set: |c, v| {
            if let Value::Path(p) = v {
                c.snapshot_at_exit = p;
            }
        },
        get: |c| Value::Path(c.snapshot_at_exit),
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

impl Opt {
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
