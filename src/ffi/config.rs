//! The allocator's configuration in PyTorch's syntax (`GPUPOOL_CONF`), set and read at run
//! time.

use std::ffi::{CStr, c_char};

use super::runtime;
use super::status::{boundary, gpupool_status, write_text};
use crate::config::Config;
use crate::error::Error;

/// --------------------------------------------------------------------------------------------
/// Configuration
/// --------------------------------------------------------------------------------------------
///
/// The allocator's settings, with the syntax, keys, meanings and defaults of PyTorch's
/// `PYTORCH_CUDA_ALLOC_CONF` (but `expandable_segments`, `True` here): read from `GPUPOOL_CONF` at
/// the first call, or set by `gpupool_set_config` before the first allocation;
/// `gpupool_config_string` writes every key back. The other `GPUPOOL_*` variables are listed at the
/// top of this header; docs/configuration.md describes every key.
///
/// --------------------------------------------------------------------------------------------
///
/// Sets the process-wide allocator's configuration from `conf`, a string in the syntax of
/// PyTorch's `PYTORCH_CUDA_ALLOC_CONF` (PyTorch 2.11, native backend), as the `GPUPOOL_CONF`
/// environment variable takes it: `key:value` entries separated by commas, ASCII spaces
/// ignored (any other white space or control character is an error naming it and its byte
/// offset), a list value as `[256:1,512:2,>:4]`, booleans `True`/`False`, sizes in whole MiB up
/// to 17592186044415 (past it, an error; PyTorch clamps). For example
/// `"max_split_size_mb:128,roundup_power2_divisions:4"`. The keys are PyTorch's, with its
/// meanings, defaults and limits but one default (`expandable_segments` is `True` in
/// gpupool, `False` in PyTorch; docs/fragmentation.md, "The default"): `backend` (`native`
/// only), `large_segment_size_mb`, `max_split_size_mb`, `max_non_split_rounding_mb`,
/// `roundup_power2_divisions`, `garbage_collection_threshold`, `expandable_segments`,
/// `release_lock_on_cudamalloc`, `per_process_memory_fraction`,
/// `graph_capture_record_stream_reuse` and the `pinned_*` keys (docs/configuration.md, section
/// "GPUPOOL_CONF").
///
/// The string replaces the whole configuration that `GPUPOOL_CONF` (and the deprecated
/// `GPUPOOL_MAX_SPLIT_SIZE_MB`) set: a key it does not name takes its default. The other
/// `GPUPOOL_*` variables keep their effect. Starts the process-wide allocator if no call did
/// yet (reading the environment, as any call does).
///
/// Must come before the first allocation: it succeeds only while no device has started. A
/// device starts at the first call that names it (or names -1 while it is current): not only
/// `gpupool_malloc` but also `gpupool_stats`, `gpupool_memory_summary`, `gpupool_empty_cache`
/// with a device ordinal, `gpupool_set_memory_fraction` and `gpupool_reset_peak_stats`.
/// `gpupool_device_count`, `gpupool_config_string` and this function start none. Each device
/// then starts with these settings, `per_process_memory_fraction` applied to it as
/// `gpupool_set_memory_fraction` would.
///
/// - `conf`: a NUL-terminated UTF-8 string, read during the call only. "" resets every key to
///   its default.
///
/// Errors, each changing nothing: `GPUPOOL_ERROR_INVALID_VALUE` for NULL, a string that is not
/// UTF-8, an unknown key, `backend:cudaMallocAsync` (gpupool is the native backend), or a bad
/// value: the message names the key, the value and what is expected. Also
/// `GPUPOOL_ERROR_INVALID_VALUE` once a device has started: the message says the configuration
/// must be set before the first allocation (there is no status for a call made too late; the
/// argument may be valid). `GPUPOOL_ERROR_DRIVER_UNAVAILABLE` when the allocator cannot start
/// (its message, every time), `GPUPOOL_ERROR_INVALID_VALUE` when a `GPUPOOL_*` variable is bad.
///
/// Thread-safe: a device that starts on another thread at the same time starts with either the
/// old configuration (and this call fails) or the new one.
///
/// # Safety
/// `conf` must be NULL or point to a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_set_config(conf: *const c_char) -> gpupool_status {
    boundary("gpupool_set_config", || {
        if conf.is_null() {
            return Err(Error::InvalidValue(
                "conf is NULL; pass a configuration string (\"\" for the defaults)".into(),
            ));
        }
        // SAFETY: non-NULL and NUL-terminated, per this function's contract.
        let text = unsafe { CStr::from_ptr(conf) }
            .to_str()
            .map_err(|e| Error::InvalidValue(format!("conf is not valid UTF-8 ({e})")))?;
        // Checked before the allocator starts, so that a bad string has no effect at all.
        Config::default().with_conf(text)?;
        let allocator = &runtime()?.allocator;
        let config = allocator.config().with_conf(text)?;
        allocator.set_config(config)
    })
}

/// Writes the process-wide allocator's configuration in PyTorch's syntax, every key with its
/// value in force: `backend:native,large_segment_size_mb:20,max_split_size_mb:17592186044415,...`
/// (`max_split_size_mb`'s largest value means unlimited; `garbage_collection_threshold` and
/// `pinned_reserve_segment_size_mb` are left out while off, since PyTorch refuses their default,
/// 0, as a value). `gpupool_set_config` reads the string back to the same configuration, and
/// so does `GPUPOOL_CONF`. Starts the allocator if no call did yet, but no device.
///
/// - `buf`, `len`: a caller-owned buffer of `len` bytes, or NULL to ask for the size only.
/// - `needed`: if not NULL, receives the bytes the text needs, NUL included.
///
/// The buffer convention of `gpupool_memory_summary`: with a buffer of at least `*needed`
/// bytes, writes the NUL-terminated text and `*needed`, and succeeds. With a buffer too small:
/// writes `*needed`, leaves the buffer untouched and returns `GPUPOOL_ERROR_INVALID_VALUE`.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (both `buf` and `needed` NULL; `len` too small, the
/// message gives the size needed); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`, or
/// `GPUPOOL_ERROR_INVALID_VALUE` for a bad `GPUPOOL_*` variable, when the allocator cannot
/// start. Thread-safe.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes; `needed` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_config_string(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> gpupool_status {
    boundary("gpupool_config_string", || {
        if buf.is_null() && needed.is_null() {
            return Err(Error::InvalidValue("buf and needed are both NULL".into()));
        }
        let text = runtime()?.allocator.config_string();
        // SAFETY: the caller's buffer and out-pointer, per this function's contract.
        unsafe { write_text(&text, "configuration string", buf, len, needed) }
    })
}
