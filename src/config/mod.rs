//! Options: every `GPUPOOL_*` environment variable that gpupool and the LD_PRELOAD shim read,
//! one row each of [`OPTIONS`], all read by one reader with one syntax, once, when the
//! process-wide allocator starts (the first call of the C API or of the shim). The shim reads
//! its options from the same [`Config`] ([`Allocator::config`](crate::Allocator::config)).
//!
//! One rule for sizes and white space, for every row and for `GPUPOOL_CONF` alike (module
//! `blank`, `conf::keys::mb_in`; docs/configuration.md, section "Sizes and white space"):
//! - The ASCII space is the only blank a value may hold: around a value and before a size's
//!   unit here, anywhere in `GPUPOOL_CONF` (PyTorch's tokenizer drops it too). Any other white
//!   space (tab, newline, carriage return, no-break space, the Unicode spaces and separators),
//!   control character or invisible character (zero width space, byte order mark) is an error
//!   naming the character and its byte offset. PyTorch drops tab, newline, carriage return,
//!   vertical tab and form feed in its configuration string; gpupool is stricter there.
//! - A size past the largest its option takes is an error naming the largest, never clamped:
//!   `usize::MAX` bytes for the sizes here (17592186044415 MiB for
//!   `GPUPOOL_MAX_SPLIT_SIZE_MB`, which at that value means unlimited, as `max_split_size_mb`
//!   does), 17592186044415 MiB for every `*_mb` key of `GPUPOOL_CONF`. PyTorch clamps
//!   `large_segment_size_mb`, `max_split_size_mb` and `max_non_split_rounding_mb` to that
//!   largest; gpupool is stricter there too.
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
//! - A value that is not valid UTF-8, or does not parse, is
//!   [`Error::InvalidValue`](crate::Error::InvalidValue) naming the variable, the value and
//!   what is expected; it is never replaced by the default.
//!
//! The options (docs/configuration.md's list of environment variables is this list, and a unit
//! test checks that both match [`OPTIONS`]):
//!
//! | variable | kind | default | meaning |
//! |---|---|---|---|
//! | `GPUPOOL_DRIVER` | `cuda` or `sim` | `cuda` | `cuda`: the CUDA driver API (libcuda.so.1, loaded at run time); `sim`: the simulated device (no GPU needed). Never chosen silently: without a driver, calls return `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` and print nothing. |
//! | `GPUPOOL_SIM_CAPACITY` | size, at least 1 | `16GiB` | bytes per simulated device |
//! | `GPUPOOL_SIM_DEVICES` | count, 1 to 64 | `1` | number of simulated devices |
//! | `GPUPOOL_SIM_START_DELAY_MS` | count, 0 to 60000 | `0` | milliseconds the simulated driver's start takes, for tests of what other threads and fork() do while gpupool starts (a real driver's start takes about this long) |
//! | `GPUPOOL_MAX_SPLIT_SIZE_MB` | size (a bare number counts MiB), at least 20MiB | unlimited | Deprecated: use `GPUPOOL_CONF=max_split_size_mb:N`. PyTorch's `max_split_size_mb`: cached blocks of at least this size are never split, and serve only requests of about their size. Set in both with different values: an error naming both |
//! | `GPUPOOL_PRELOAD_MODE` | `safe` or `stream` | `safe` | LD_PRELOAD shim: `safe` (a `cudaFree`d block waits for a device synchronisation) or `stream` (reused at once, in stream order) |
//! | `GPUPOOL_PRELOAD_SYNC_BYTES` | size | `256MiB` | LD_PRELOAD shim, safe mode: deferred bytes on a device that trigger the synchronisation (0: at every free) |
//! | `GPUPOOL_PRELOAD_STATS` | boolean | `off` | LD_PRELOAD shim: at exit, print what was intercepted, these options and the memory summary of each device used (stderr) |
//! | `GPUPOOL_EXPANDABLE_RECLAIM` | boolean | `off` | With `expandable_segments:True`: a segment does not grow past the device's peak reserved bytes (since the cache was last emptied or the peak statistics reset) while wholly free pages are mapped anywhere on the device; they are unmapped first (the growing stream's own after its queued work has run, an event recorded on it and waited for; other streams' after a device synchronisation), so that reserved memory stays near the most ever in use. Off: PyTorch's behaviour (pages are unmapped only by `empty_cache` and on out of memory), much faster where shapes change (see docs/fragmentation.md) |
//! | `GPUPOOL_EXPANDABLE_LARGE_PAGES` | boolean | `on` | With expandable segments: requests of 20 MiB and more grow address ranges of their own, mapped in 20 MiB pages (PyTorch's page in its large pool), and smaller ones ranges of 2 MiB pages (gpupool's page in both pools when off); a growth for a request of 20 MiB and more maps 2 MiB pages instead where they map fewer bytes than its large pages, at most 64 of them, and where the bytes they save are at least a 480th of those the pool maps (not with `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST=0` nor with `GPUPOOL_EXPANDABLE_RECLAIM`): far fewer driver calls for large blocks than 2 MiB pages alone at about their reserved memory, and with `GPUPOOL_EXPANDABLE_RECLAIM` far fewer pages moved in a warm pass (see docs/fragmentation.md) |
//! | `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST` | count, 0 to 1048576 | `16` | With `GPUPOOL_EXPANDABLE_LARGE_PAGES`: a request of 20 MiB or more maps at most this many pages; its address range's page is 20 MiB doubled until it does (a 4 GiB request maps 13 pages of 320 MiB rather than 205 of 20 MiB: each page is a `cuMemCreate` and a `cuMemMap`, tens of microseconds whatever its size); where the device has no room for what the larger pages map past the request, it is grown in smaller ones, down to 20 MiB. 0, or with `GPUPOOL_EXPANDABLE_RECLAIM` (whose point is the least reserved memory): 20 MiB pages at any size, as PyTorch maps them (see docs/fragmentation.md) |
//! | `GPUPOOL_RELEASE_UNUSED_STREAMS` | boolean | `off` | Before a stream's growth takes the device's physical memory past its high-water mark, the cache of every other stream that holds no block (nothing allocated, nothing awaiting an event) is released as `empty_cache` releases it, so that a program creating a stream per request or step keeps reserved memory flat (gpupool's; PyTorch keeps each stream's cache until the device runs out of memory). Off (the default): PyTorch's behaviour; `gpupool_largest_allocatable` does not count what this would release (see docs/fragmentation.md) |
//! | `GPUPOOL_SLEEP_CHUNK` | size, at least 1 | `32MiB` | `gpupool_sleep` and `gpupool_wake` with offload: bytes of each pinned staging buffer, the most one copy between the device and the host copy carries (blocks are cut into, and small blocks packed into, pieces of this size; see docs/sleep.md) |
//! | `GPUPOOL_SLEEP_BUFFERS` | count, 2 to 64 | `4` | `gpupool_sleep` and `gpupool_wake` with offload: pinned staging buffers per device (the ring), allocated at the first offload and kept until `gpupool_empty_cache`; buffers times `GPUPOOL_SLEEP_CHUNK` bytes of pinned host memory |
//! | `GPUPOOL_SLEEP_THREADS` | count, 0 to 256 | `0` | `gpupool_sleep` and `gpupool_wake` with offload: CPU threads (the calling one included) that copy between the staging buffers and the host copy while the device copies the next buffer; 0: the cores the process may use, at most 16 |
//! | `GPUPOOL_SLEEP_PAGE` | size (a bare number counts MiB), at least 2MiB | `64MiB` | Sleepable private pools (`gpupool_pool_create_sleepable`): the page of their expandable segments, every request's, rounded up to the driver's granularity (2 MiB). A sleep unmaps and releases each page and a wake creates and maps it again, tens of microseconds a page whatever its size, so larger pages cost a sleep and a wake less beside the copy; a pool reserves up to a page more than it uses at the end of each of its ranges (see docs/sleep.md) |
//! | `GPUPOOL_SLEEP_HUGE_PAGES` | boolean | `on` | `gpupool_sleep` with offload: the host copy (ordinary memory, an anonymous mapping unmapped at `gpupool_wake`) asks for transparent huge pages (`MADV_HUGEPAGE`), a 512th of the page faults when it is first written |
//! | `GPUPOOL_RECORD_HISTORY` | `off` or `<max_entries>[:<context>[:<stacks>]]` | `off` | Records the allocation history from the start, as `gpupool_record_history(1, max_entries, context)` would (PyTorch `_record_memory_history`): the newest `max_entries` events per device and the call stacks of `context` (`none`, `state`, `alloc` or `all`, default `all`), holding the frames of `stacks` (`all`: native and, under CPython, Python; `python`; `native`; default `all`); `gpupool_dump_snapshot` writes them |
//! | `GPUPOOL_LIVE_REPORT_AT_EXIT` | boolean | `off` | At exit, print the live report of each device used (stderr): its allocated blocks grouped by tag and by call stack, largest first, as `gpupool_live_report` prints it; what a leak hunt reads |
//! | `GPUPOOL_SNAPSHOT_AT_EXIT` | a file's path | unset | At exit, write the snapshot of every device used to this file, as `gpupool_dump_snapshot` writes it (PyTorch's pickle, with the history `GPUPOOL_RECORD_HISTORY` recorded): how a program that never calls gpupool, run under the LD_PRELOAD shim, gets one. A file that cannot be written: one line on stderr naming it |
//! | `GPUPOOL_CONF` | PyTorch's configuration string, `key:value,key:value` | empty | the allocator's settings, as `PYTORCH_CUDA_ALLOC_CONF` holds them for PyTorch 2.11's native backend (the keys are listed below); an unknown key or a bad value is an error naming it |
//!
//! A new option is a row of [`OPTIONS`] and a field of [`Config`].
//!
//! A variable whose name starts with `GPUPOOL_` and that is none of these (a misspelling such
//! as `GPUPOOL_CNF`) is no error: [`Config::from_env`] writes one line to stderr for it, once
//! per process, naming the known variable it probably meant when one is close, and changes
//! nothing else (module `unknown`). The `GPUPOOL_*` environment variables that other parts of
//! the project read (`GPUPOOL_LIB` of the Python glue, the tests' `GPUPOOL_FUZZ_CASES` and
//! `GPUPOOL_SOAK_*`) get none: they are listed in `unknown::READ_ELSEWHERE`, where a new one
//! goes.
//!
//! `GPUPOOL_CONF`, read after the rows, has PyTorch's syntax instead (module `conf`, the rules
//! of PyTorch 2.11's `ConfigTokenizer` and parsers): `key:value` entries separated by commas,
//! ASCII spaces ignored anywhere, booleans `True`/`False` only, sizes in whole MiB, a list value as
//! `[256:1,512:2,>:4]`. Its keys are [`CONF_KEYS`], each a field of [`Config`], with PyTorch's
//! meanings, defaults and limits (docs/configuration.md lists them too, and a unit test checks
//! both):
//!
//! | key | value | default | meaning |
//! |---|---|---|---|
//! | `backend` | `native` | native | The allocator behind PyTorch. gpupool is PyTorch's native caching allocator; `cudaMallocAsync` is an error. |
//! | `large_segment_size_mb` | whole MiB, more than 10 | 20 | Size of the segments that requests over 1 MiB and under 10 MiB are carved from (PyTorch `get_allocation_size`; `kLargeBuffer` before 2.11). Also the default of `max_non_split_rounding_mb` and the floor of both `*_mb` limits. |
//! | `max_split_size_mb` | whole MiB, at least `large_segment_size_mb` | unlimited (17592186044415, the largest) | Cached blocks of at least this size are never split, and serve only requests of about their size (PyTorch `max_split_size`). The largest value, 17592186044415, means unlimited. |
//! | `max_non_split_rounding_mb` | whole MiB, at least `large_segment_size_mb` | `large_segment_size_mb` (20) | A request of at least `max_split_size_mb` takes a cached block only if the block is less than this much larger (PyTorch `get_free_block`). |
//! | `roundup_power2_divisions` | a power of two, or a list `[MiB:divisions,...,>:divisions]` | 0 in every interval | Requests are rounded up to one of this many equal steps between two powers of two, instead of to 512 bytes (PyTorch `round_size`, `roundup_power2_next_division`); 0 or 1 leaves the 512-byte rounding. A list sets it per interval: `MiB` a power of two naming the sizes from that many MiB to twice as many (the first also sets every interval below it), `>` every interval after the last one named; each divisions 0 or a power of two. |
//! | `garbage_collection_threshold` | a number over 0 and under 1 | off (0, which cannot be written) | With a memory fraction set (`per_process_memory_fraction` or `gpupool_set_memory_fraction`): once reserved memory passes this fraction of the memory allowed, a request that finds no cached block first releases whole free segments of the large pool, the longest unused first, until reserved memory is back under it (PyTorch `garbage_collect_cached_blocks`; gpupool gathers every stream's segments and ages a block by the blocks its stream freed since). Left out of the configuration string while off. |
//! | `expandable_segments` | `True` or `False` | True | Segments that grow by mapping more memory into one reserved address range (PyTorch `ExpandableSegment`), where the device and driver support CUDA's virtual memory calls (ordinary segments otherwise). gpupool's default is `True`, PyTorch's `False`: `expandable_segments:False` gives PyTorch's ordinary segments (docs/fragmentation.md, "The default"). |
//! | `release_lock_on_cudamalloc` (also `release_lock_on_hipmalloc`) | `True` or `False` | False | PyTorch releases its device lock across `cudaMalloc`. Accepted and changes nothing: gpupool holds one lock per stream across `cuMemAlloc`, which blocks only that stream's callers. |
//! | `per_process_memory_fraction` | a number from 0 to 1 | 1 | Each device, when it starts, reserves at most this fraction of its total memory, as `gpupool_set_memory_fraction` sets it (PyTorch `setMemoryFraction`). |
//! | `graph_capture_record_stream_reuse` | `True` or `False` | False | PyTorch: during CUDA graph capture, blocks freed after `record_stream` may be reused within the same graph instead of waiting for the capture to end. Accepted and changes nothing: gpupool always does what PyTorch does with False. A block that other streams used (`gpupool_record_stream`), freed while a capture may be under way (a route to a private pool by stream or filter is active, or one of those streams captures), is reused by nothing, in the graph or out of it, until no capture is; then gpupool records its events, and the block returns to its pool once they complete. |
//! | `pinned_use_cuda_host_register` (also `pinned_use_hip_host_register`) | `True` or `False` | False | Pinned host memory (`gpupool_host_malloc`): `malloc` then `cuMemHostRegister` instead of `cuMemHostAlloc` for new blocks. |
//! | `pinned_num_register_threads` | a power of two, at most 128 | 1 | Pinned host memory: threads that touch (page in) a new block before `cuMemHostRegister` with `pinned_use_cuda_host_register` (PyTorch's bound, `pinned_max_register_threads`, is 128 and no key). |
//! | `pinned_use_background_threads` | `True` or `False` | False | Pinned host memory: a background thread polls the events of freed blocks every 100 µs, and allocations no longer poll them on the hit path. |
//! | `pinned_reserve_segment_size_mb` | whole MiB, at least 1 | none (0, which cannot be written) | Pinned host memory: one segment of this size pinned at the first miss and carved (4 KiB aligned) for new blocks while it has room; never released. Left out of the configuration string while unset. |
//!
//! `GPUPOOL_MAX_SPLIT_SIZE_MB` is the deprecated spelling of `max_split_size_mb`; both set to
//! different sizes is an error naming both. [`Config::with_conf`] applies a string at run time
//! (`gpupool_set_config`), and [`Config::conf_string`] writes every key back in the same syntax.
//!
//! The files: `options.rs` the table of rows; `parse.rs` the value parsers and the one reader
//! of a value; `env.rs` the environment read ([`Config::from_env`]); `print.rs` the options
//! printed, with their values and as the tables above; `blank.rs` the rule on white space;
//! `unknown.rs` the warning for a misspelled variable; `conf/` `GPUPOOL_CONF`; `tests.rs` the
//! unit tests.

use crate::history::HistorySettings;

mod blank;
mod conf;
mod env;
mod options;
mod parse;
mod print;
#[cfg(test)]
mod tests;
mod unknown;

pub use conf::{CONF_KEYS, CONF_VAR, ConfKey, ROUNDUP_INTERVALS, conf_keys_markdown};
pub use options::{Kind, OPTIONS, Opt, Value};
pub use parse::parse_size;
pub use print::{options_c_comment, options_markdown};

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
/// ([`CONF_KEYS`]). [`Config::default`] holds every row's and every key's default: PyTorch's
/// for the keys but `expandable_segments`, which is `True` (gpupool's default since
/// 2026-11-26, with `GPUPOOL_EXPANDABLE_LARGE_PAGES` on: docs/fragmentation.md says why);
/// [`Config::pytorch`] is the same with PyTorch 2.11's ordinary segments.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The driver [`Allocator::from_config`](crate::Allocator::from_config) starts.
    pub driver: DriverKind,
    /// Simulated devices (with [`DriverKind::Sim`]).
    pub sim_devices: i32,
    /// Bytes per simulated device.
    pub sim_capacity: usize,
    /// Milliseconds the simulated driver's start takes (`GPUPOOL_SIM_START_DELAY_MS`), for tests
    /// of what happens meanwhile.
    pub sim_start_delay_ms: u64,
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
    /// demand (CUDA's virtual memory calls), when the device supports them (a device or driver
    /// without them gets ordinary segments). `true` by default, where PyTorch's is `false`:
    /// reserved memory within 5% of live on most traces at the speed of ordinary segments
    /// (docs/fragmentation.md, "The default").
    pub expandable_segments: bool,
    /// PyTorch's `release_lock_on_cudamalloc`. Changes nothing: gpupool's lock across
    /// `cuMemAlloc` is one stream's, not the device's.
    pub release_lock_on_cudamalloc: bool,
    /// PyTorch's `per_process_memory_fraction`, 0 to 1: applied to each device when it starts,
    /// as [`Allocator::set_memory_fraction`](crate::Allocator::set_memory_fraction) does.
    /// Default 1 (no limit is set).
    pub per_process_memory_fraction: f64,
    /// PyTorch's `graph_capture_record_stream_reuse`. Changes nothing: a block freed after
    /// `record_stream` while a capture may be under way always waits, with no event, until no
    /// capture is (the shard's `capture_deferred`), as in PyTorch with the key False.
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
    /// on the device are unmapped (after the growing stream's work, or the device, is waited
    /// for). Off: PyTorch's behaviour.
    pub expandable_reclaim: bool,
    /// `GPUPOOL_EXPANDABLE_LARGE_PAGES` (on by default): with expandable segments, requests of
    /// 20 MiB and more grow address ranges of their own mapped in 20 MiB pages (PyTorch's page
    /// in its large pool), or 2 MiB pages where those map fewer bytes (at most 64 a growth),
    /// the rest 2 MiB pages (see `caching::expandable`).
    pub expandable_large_pages: bool,
    /// `GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST` (16 by default): with large pages, a request of
    /// 20 MiB or more maps at most this many pages, its range's page doubled until it does;
    /// 0, or with `expandable_reclaim`: 20 MiB pages at any size (see
    /// `caching::expandable::ExpandablePolicy::page_for`).
    pub expandable_pages_per_request: usize,
    /// `GPUPOOL_RELEASE_UNUSED_STREAMS` (see `caching::device::stranded`).
    pub release_unused_streams: bool,
    /// The allocation history an allocator records from its start
    /// ([`Allocator::new`](crate::Allocator::new); `GPUPOOL_RECORD_HISTORY`); `None` (the
    /// default): none until [`Allocator::record_history`](crate::Allocator::record_history).
    pub record_history: Option<HistorySettings>,
    /// The process-wide allocator prints the live report of each device it used to stderr at
    /// exit (`GPUPOOL_LIVE_REPORT_AT_EXIT`; see [`Allocator::live_report`](crate::Allocator::live_report)).
    pub live_report_at_exit: bool,
    /// The file the process-wide allocator writes its snapshot to at exit
    /// (`GPUPOOL_SNAPSHOT_AT_EXIT`; `None`, the default: none is written). A `&'static str`
    /// so that the config stays cheap to copy around; the reader leaks the text once.
    pub snapshot_at_exit: Option<&'static str>,
    /// Bytes of each pinned staging buffer of sleep and wake with offload
    /// (`GPUPOOL_SLEEP_CHUNK`, 32 MiB; see `caching::sleep::staging`).
    pub sleep_chunk: usize,
    /// Pinned staging buffers per device (`GPUPOOL_SLEEP_BUFFERS`, 4, at least 2).
    pub sleep_buffers: usize,
    /// CPU threads of a sleep's or wake's host copies, the calling one included
    /// (`GPUPOOL_SLEEP_THREADS`; 0, the default: the cores the process may use, at most 16).
    pub sleep_threads: usize,
    /// Whether the host copy of a sleeping pool asks for transparent huge pages
    /// (`GPUPOOL_SLEEP_HUGE_PAGES`, on).
    pub sleep_huge_pages: bool,
    /// Bytes of each page of sleepable pools' expandable segments (`GPUPOOL_SLEEP_PAGE`, 64 MiB,
    /// rounded up to the driver's granularity).
    pub sleep_page: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            driver: DriverKind::Cuda,
            sim_devices: 1,
            sim_capacity: 16 << 30,
            sim_start_delay_ms: 0,
            max_split_size: usize::MAX,
            max_non_split_rounding: LARGE_SEGMENT,
            large_segment_size: LARGE_SEGMENT,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: true,
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
            expandable_large_pages: true,
            expandable_pages_per_request: 16,
            release_unused_streams: false,
            record_history: None,
            live_report_at_exit: false,
            snapshot_at_exit: None,
            sleep_chunk: 32 * MIB,
            sleep_buffers: 4,
            sleep_threads: 0,
            sleep_huge_pages: true,
            sleep_page: 64 * MIB,
        }
    }
}

impl Config {
    /// PyTorch 2.11's defaults: [`Config::default`] with ordinary segments
    /// (`expandable_segments:False`), the configuration whose every rule, statistic and
    /// segment matches what PyTorch's native allocator does for the same calls
    /// (docs/rules.md). The same as `GPUPOOL_CONF=expandable_segments:False`. Note that
    /// [`Config::with_conf`] resets every key it is not given, this one included: for keys on
    /// PyTorch's defaults, [`Config::pytorch_conf`].
    pub fn pytorch() -> Config {
        Config { expandable_segments: false, ..Config::default() }
    }
}

const MIB: usize = 1 << 20;
/// PyTorch's default `large_segment_size` (`kLargeBuffer`, 20 MiB).
const LARGE_SEGMENT: usize = 20 * MIB;
