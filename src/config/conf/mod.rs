//! `GPUPOOL_CONF`: PyTorch's allocator configuration string (`PYTORCH_ALLOC_CONF`, formerly
//! `PYTORCH_CUDA_ALLOC_CONF`), read as PyTorch 2.11 reads it for its native CUDA backend
//! (`c10/core/AllocatorConfig.{h,cpp}`: `ConfigTokenizer`, `AcceleratorAllocatorConfig::parseArgs`;
//! `c10/cuda/CUDAAllocatorConfig.{h,cpp}`: `CUDAAllocatorConfig::parseArgs`). Every key of
//! [`CONF_KEYS`] is a field of [`Config`].
//!
//! The syntax, PyTorch's:
//! - `key:value` entries separated by `,`; a list value is `[a:b,c:d,...]`. ASCII spaces are
//!   ignored wherever they are, as PyTorch's tokenizer drops them. An empty string sets
//!   nothing. A `,` after the last entry, or after the last item of a list, is
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
//!   `[256:1;512:2]`);
//! - white space other than the ASCII space, and control characters (`config::blank`):
//!   PyTorch drops tab, newline, carriage return, vertical tab and form feed as it drops the
//!   space, and keeps a no-break space in the word, where `std::stoull` ignores it;
//! - a size past the largest, 17592186044415 MiB ([`MAX_MB`]; `keys::mb_in`): PyTorch clamps
//!   `large_segment_size_mb`, `max_split_size_mb` and `max_non_split_rounding_mb` to it, and
//!   lets `pinned_reserve_segment_size_mb`'s bytes overflow. (At the largest,
//!   `max_split_size_mb` means unlimited, PyTorch's default.)
//!
//! The files: `keys.rs` the table of keys ([`CONF_KEYS`]); `parse.rs` the syntax (PyTorch's
//! tokenizer, the entries it makes); `roundup.rs` `roundup_power2_divisions`'s value, read and
//! written back; `show.rs` the string written back and the keys' table; `tests.rs` the unit
//! tests, against the figures PyTorch 2.11.0 gives.

use super::Config;
use crate::error::Error;

mod keys;
mod parse;
mod roundup;
mod show;
#[cfg(test)]
mod tests;

pub use keys::{CONF_KEYS, ConfKey};
use parse::{Raw, entries};
pub use show::conf_keys_markdown;

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
/// The largest count of MiB that fits `usize` in bytes: the most any `*_mb` key takes
/// (PyTorch clamps to it; gpupool refuses past it).
const MAX_MB: usize = usize::MAX / MIB;
/// `pinned_num_register_threads` at most (PyTorch `pinned_max_register_threads`).
const MAX_REGISTER_THREADS: usize = 128;

fn find_key(key: &str) -> Option<&'static ConfKey> {
    CONF_KEYS.iter().find(|k| k.key == key || k.also.contains(&key))
}

/// Which keys a string set, for the check of the deprecated `GPUPOOL_MAX_SPLIT_SIZE_MB`.
pub(super) struct Seen {
    pub max_split_size: bool,
}

impl Config {
    /// Every key of `GPUPOOL_CONF` back at its default ([`CONF_KEYS`]: PyTorch's, but
    /// `expandable_segments`, `True`).
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
    /// does not name takes its default (PyTorch's, but `expandable_segments:True`), whatever
    /// this config had (what
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

    /// What PyTorch 2.11 runs under `PYTORCH_CUDA_ALLOC_CONF=conf`: [`Config::pytorch`] with
    /// the keys `conf` names, every other key at PyTorch's default (ordinary segments unless
    /// `conf` says `expandable_segments:True`; gpupool's own options at their defaults). For
    /// replaying what PyTorch recorded, and for checking PyTorch's rules one for one.
    ///
    /// Errors: those of [`Config::with_conf`].
    pub fn pytorch_conf(conf: &str) -> Result<Config, Error> {
        let mut c = Config::pytorch();
        c.reset_conf();
        c.expandable_segments = false;
        c.apply_conf(CONF_VAR, conf)?;
        Ok(c)
    }
}
