//! The table of `GPUPOOL_CONF`'s keys: [`CONF_KEYS`], one row per key of PyTorch 2.11's native
//! CUDA backend, each with its value, default and meaning and how it sets and shows its field
//! of [`Config`] (PyTorch `CUDAAllocatorConfig::parseArgs` and its `parse*` functions in
//! `c10/cuda/CUDAAllocatorConfig.cpp`, and `AcceleratorAllocatorConfig::parseArgs` in
//! `c10/core/AllocatorConfig.cpp`).

use super::parse::Raw;
use super::roundup::{apply_roundup, show_roundup};
use super::{MAX_MB, MAX_REGISTER_THREADS, MIB, MIN_LARGE_SEGMENT_MB};
use crate::config::Config;

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
    pub(super) apply: fn(&mut Config, &Raw) -> Result<(), String>,
    pub(super) show: fn(&Config) -> Option<String>,
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
            let mb = mb_in(v, MIN_LARGE_SEGMENT_MB + 1, &format!("more than {MIN_LARGE_SEGMENT_MB}"))?;
            c.large_segment_size = mb * MIB;
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
            c.max_non_split_rounding = mb * MIB;
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
        default: "True",
        doc: "Segments that grow by mapping more memory into one reserved address range (PyTorch \
              `ExpandableSegment`), where the device and driver support CUDA's virtual memory calls \
              (ordinary segments otherwise). gpupool's default is `True`, PyTorch's `False`: \
              `expandable_segments:False` gives PyTorch's ordinary segments (docs/fragmentation.md, \
              \"The default\").",
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
        doc: "PyTorch: during CUDA graph capture, blocks freed after `record_stream` may be reused within the same \
              graph instead of waiting for the capture to end. Accepted and changes nothing: gpupool always does what \
              PyTorch does with False. A block that other streams used (`gpupool_record_stream`), freed while a \
              capture may be under way (a route to a private pool by stream or filter is active, or one of those \
              streams captures), is reused by nothing, in the graph or out of it, until no capture is; then gpupool \
              records its events, and the block returns to its pool once they complete.",
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
            c.pinned_reserve_segment_size = mb_in(v, 1, "at least 1")? * MIB;
            Ok(())
        },
        show: |c| (c.pinned_reserve_segment_size > 0).then(|| (c.pinned_reserve_segment_size / MIB).to_string()),
    },
];

fn show_bool(b: bool) -> String {
    (if b { "True" } else { "False" }).to_string()
}

/// The `*_mb` limits: a whole number of MiB, at least `large_segment_size_mb` (PyTorch
/// `parseMaxSplitSize`, `parseMaxNonSplitRoundingSize`), at most [`MAX_MB`].
fn mb_at_least_large_segment(c: &Config, v: &Raw) -> Result<usize, String> {
    let floor = c.large_segment_size / MIB;
    mb_in(v, floor, &format!("at least large_segment_size_mb ({floor})"))
}

/// Every size key's one rule: a whole number of MiB from `least` (said as `least_is`) to
/// [`MAX_MB`], the most whose bytes fit in `usize` (17592186044415). Past it, refused: PyTorch
/// clamps `large_segment_size_mb`, `max_split_size_mb` and `max_non_split_rounding_mb` to it
/// (and lets `pinned_reserve_segment_size_mb`'s bytes overflow); gpupool refuses, as it
/// refuses every `GPUPOOL_*` size past the largest, so that no size is ever other than
/// written. For `max_split_size_mb`, the largest means unlimited.
fn mb_in(v: &Raw, least: usize, least_is: &str) -> Result<usize, String> {
    let expected = || format!("a whole number of MiB, {least_is}, at most {MAX_MB}");
    let word = v.word()?;
    if word.is_empty() || !word.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{} (digits only)", expected()));
    }
    // Digits past usize are past the largest too.
    match word.parse::<usize>() {
        Ok(mb) if (least..=MAX_MB).contains(&mb) => Ok(mb),
        _ => Err(expected()),
    }
}
