//! Sleep and wake: a pool gives its device memory back to the driver and gets it back at the
//! same addresses, its live blocks' contents kept in host memory meanwhile or dropped.
//! For engines that share a GPU between phases or models (reinforcement learning that
//! alternates training and generation, models served in turns): weights, KV cache and the
//! CUDA graphs that point into them survive without being rebuilt. Not in PyTorch; vLLM's
//! sleep mode, SGLang's torch_memory_saver and TensorRT-LLM's `releaseWithTag` do it beside
//! their allocator. docs/sleep.md has the rules, each with its test.
//!
//! Which memory can sleep: memory on CUDA's virtual memory API. The default pools' segments
//! are (expandable segments, the default configuration, where the driver can map memory); a
//! private pool's are when it was made with `gpupool_pool_create_sleepable`. Any other pool,
//! or one that holds an ordinary segment (`cuMemAlloc`), is refused with
//! `GPUPOOL_ERROR_INVALID_VALUE` and a message that says why.

use std::ffi::c_int;

use super::runtime;
use super::status::{boundary, gpupool_status, out_ptr};
use crate::SleepMode;
use crate::error::Error;

/// `gpupool_sleep`'s mode: the live blocks' contents are copied to host memory first,
/// and back at `gpupool_wake`, bit for bit (weights).
pub const GPUPOOL_SLEEP_OFFLOAD: u32 = 1;
/// `gpupool_sleep`'s mode: the live blocks' contents are dropped; after `gpupool_wake` they
/// hold whatever the new memory holds (KV cache, activations).
pub const GPUPOOL_SLEEP_DISCARD: u32 = 2;
/// `gpupool_sleep`'s mode: as `GPUPOOL_SLEEP_OFFLOAD`, into pinned host memory that the copy
/// engines write and read directly, with no staging and no CPU copy, and that the pool keeps
/// after `gpupool_wake` for its next sleep in this mode: from the second sleep on, sleep and
/// wake copy at the bus's speed (on an H100: see docs/sleep.md). The first sleep maps the
/// memory, faults it in from several threads and page-locks it (`cuMemHostRegister`), about
/// three times the copy's time, unless `gpupool_sleep_prepare` did it beforehand. The pool's live bytes stay pinned in host memory while it is
/// awake (`gpupool_sleep_host_bytes`), until `gpupool_sleep_release_kept`,
/// `gpupool_release_pool`, or a sleep of the pool in another mode; `gpupool_empty_cache`
/// keeps them. For engines that sleep and wake the same weights again and again (vLLM's
/// sleep mode keeps its pinned backup in PyTorch's caching host allocator likewise).
pub const GPUPOOL_SLEEP_OFFLOAD_PINNED: u32 = 3;

/// --------------------------------------------------------------------------------------------
/// Sleep and wake
/// --------------------------------------------------------------------------------------------
///
/// A pool gives its device memory back to the driver and gets it back at the same addresses, its
/// live blocks' contents kept in host memory meanwhile or dropped: weights, KV cache and the CUDA
/// graphs that point into them survive without being rebuilt (vLLM's sleep mode; not in PyTorch).
/// Memory on CUDA's virtual memory API can sleep: the default pools' expandable segments, and the
/// pools made by `gpupool_pool_create_sleepable`. `GPUPOOL_SLEEP_*` tune the copies; docs/sleep.md
/// has the rules.
///
/// --------------------------------------------------------------------------------------------
///
/// Creates a private pool that may sleep and writes its id to `*pool`: as
/// `gpupool_pool_create` (routes, captures, `gpupool_release_pool` and statistics are the
/// same), but its segments are on CUDA's virtual memory API (expandable segments, PyTorch's
/// `expandable_segments:True`, whatever `GPUPOOL_CONF` says for the default pools), during a
/// graph capture too, so that `gpupool_sleep` can give its memory back. Its segments map pages
/// of 20 MiB (PyTorch's `kLargeBuffer`) in the small pool too, where the default pools map 2 MiB
/// (`kSmallBuffer`): a sleep and a wake make one driver call per page, which the driver
/// serialises, and with 2 MiB pages blocks of 1 MiB spent longer in those calls than in the
/// copy (docs/sleep.md); a stream's last page in each pool may hold up to 20 MiB. Wholly free pages of a
/// segment a captured graph uses stay mapped (the graph writes there at every replay); other
/// free pages go back at `gpupool_empty_cache`. Where the driver cannot map memory, its
/// allocations fail as the driver's calls do. The id has bit 62 set.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (NULL `pool`); `GPUPOOL_ERROR_DRIVER_UNAVAILABLE`.
///
/// Thread-safe.
///
/// # Safety
/// `pool` must be NULL or point to writable storage for one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_pool_create_sleepable(pool: *mut u64) -> gpupool_status {
    boundary("gpupool_pool_create_sleepable", || {
        let pool = out_ptr(pool, "pool")?;
        let id = runtime()?.allocator.pool_create_sleepable();
        // SAFETY: the caller passes storage for one uint64_t.
        unsafe { pool.write(id) };
        Ok(())
    })
}

/// Puts `pool` on `device` (-1: the calling thread's current device) to sleep: 0 names the
/// device's default pools, any other id a pool from `gpupool_pool_create_sleepable`. `mode` is
/// `GPUPOOL_SLEEP_OFFLOAD`, `GPUPOOL_SLEEP_OFFLOAD_PINNED` or `GPUPOOL_SLEEP_DISCARD`.
///
/// In order: allocations from the pool are refused from now on; the work queued so far on
/// the pool's blocks is waited for, by events (an event recorded on each of the pool's
/// streams and on each stream `gpupool_record_stream` named for a live block, and the events
/// of blocks freed meanwhile; the device is synchronised only for blocks freed with
/// `gpupool_free_after_device_sync` and for the per-thread default stream); with offload,
/// each live block is copied to ordinary host memory (an anonymous `mmap` of the pool's
/// allocated bytes, unmapped at wake) through the device's pinned staging ring
/// (`GPUPOOL_SLEEP_BUFFERS` buffers of `GPUPOOL_SLEEP_CHUNK` bytes, pinned at the first offload
/// and kept until `gpupool_empty_cache`) on two copy streams of gpupool's own, CPU threads
/// (`GPUPOOL_SLEEP_THREADS`) copying each buffer out while the device fills the next (with
/// `GPUPOOL_SLEEP_OFFLOAD_PINNED`, straight into the pinned copy the pool keeps, made at its
/// first such sleep); then every page of the pool's memory, cached
/// free pages included, is unmapped and given back to the driver (`cuMemUnmap`,
/// `cuMemRelease`): free device memory rises by the pool's reserved bytes. The blocks keep
/// their addresses (still reserved, `cuMemAddressReserve`), and reserved bytes still count
/// them; `gpupool_stats_t.sleeping_bytes` says how many of them sleep.
///
/// While the pool sleeps: allocating from it fails with `GPUPOOL_ERROR_INVALID_VALUE` (for
/// pool 0, every allocation on the device that no route sends to a private pool); its blocks
/// may be freed (`gpupool_free`, `gpupool_record_stream` first if need be), from any thread
/// and at any moment, this call's copies included, and come back as cache at wake;
/// `gpupool_empty_cache`, the out-of-memory path, `garbage_collection_threshold` and the
/// high-water rule leave its pages and its host copy alone from the moment this call copies a
/// stream to the end of the wake; `gpupool_release_pool` and `gpupool_ipc_export` refuse it;
/// segment observers are told `GPUPOOL_SEGMENT_UNMAP` of every page before it goes (and
/// `GPUPOOL_SEGMENT_MAP` at wake); `gpupool_largest_allocatable` answers 0 while the default
/// pools sleep; statistics and snapshots may be read throughout. Other pools allocate and free
/// as usual, never waiting for it (docs/sleep.md, "Calls while a pool sleeps or wakes"). The
/// program must not touch the pool's memory (kernels, copies) until `gpupool_wake` returns,
/// nor allocate from the pool while this call runs.
///
/// Errors, each leaving every pool as it was: `GPUPOOL_ERROR_INVALID_VALUE` for a mode that
/// is neither, a pool never created, a device out of range, a pool whose memory is not on the
/// virtual memory API (a private pool from `gpupool_pool_create`; the default pools with
/// `expandable_segments:False` or where the driver cannot map memory; any pool holding an
/// ordinary segment), a pool asleep already (a second sleep changes nothing) or released, a
/// pool holding blocks exported to other processes (`gpupool_ipc_export`, live or freed while
/// imported: the importers would keep the old pages);
/// `GPUPOOL_ERROR_STREAM_CAPTURE` while a capture may be under way on the device;
/// `GPUPOOL_ERROR_OUT_OF_MEMORY` when the host cannot pin the staging ring or give the host
/// copy's memory; `GPUPOOL_ERROR_CUDA` when
/// waiting or copying fails. Once the copies are done the pool sleeps whatever happens: if
/// the driver then refuses to unmap or release a page, the call returns `GPUPOOL_ERROR_CUDA`,
/// the pool sleeps all the same (wake it as usual), and that page stays mapped or held.
///
/// Thread-safe; blocks the calling thread for the wait and the copies (it holds only the
/// pool's own locks meanwhile).
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_sleep(device: c_int, pool: u64, mode: u32) -> gpupool_status {
    boundary("gpupool_sleep", || runtime()?.allocator.sleep(device, pool, sleep_mode(mode)?))
}

/// The [`SleepMode`] of a `GPUPOOL_SLEEP_*` constant.
fn sleep_mode(mode: u32) -> Result<SleepMode, Error> {
    match mode {
        GPUPOOL_SLEEP_OFFLOAD => Ok(SleepMode::Offload),
        GPUPOOL_SLEEP_DISCARD => Ok(SleepMode::Discard),
        GPUPOOL_SLEEP_OFFLOAD_PINNED => Ok(SleepMode::OffloadPinned),
        m => Err(Error::InvalidValue(format!(
            "mode {m} is not a sleep mode: pass GPUPOOL_SLEEP_OFFLOAD (1), GPUPOOL_SLEEP_DISCARD (2) or \
             GPUPOOL_SLEEP_OFFLOAD_PINNED (3)"
        ))),
    }
}

/// Makes the host memory of a later `gpupool_sleep(device, pool, mode)` ready now, so that
/// the pool's first sleep runs as fast as the next ones (vLLM allocates its pinned backup
/// before sleeping likewise; not in PyTorch). For an engine's start-up, once the weights are
/// loaded: `device` -1 is the current device, `pool` 0 the default pools or a pool from
/// `gpupool_pool_create_sleepable`, `mode` a `GPUPOOL_SLEEP_*` constant.
///
/// With `GPUPOOL_SLEEP_OFFLOAD_PINNED`: for each of the pool's streams holding live blocks, a
/// host copy of its allocated bytes now is mapped, faulted in by the copy threads
/// (`GPUPOOL_SLEEP_THREADS`) and page-locked (`cuMemHostRegister`), as that sleep would do
/// at its start, and kept for the sleep. While the pool is awake it holds those bytes of pinned
/// host memory (`gpupool_sleep_host_bytes`'s `*kept`, `gpupool_sleep_release_kept` gives them
/// back). A stream that holds more by the sleep (or less than half) pins a new copy then, as
/// with no prepare, and the sleep gives back the prepared copies it did not use; a stream that
/// keeps a fitting copy already pins nothing (a second call costs no driver call). With
/// `GPUPOOL_SLEEP_OFFLOAD`: the device's staging ring is pinned (kept until
/// `gpupool_empty_cache`). With `GPUPOOL_SLEEP_DISCARD`: nothing. `*pinned` (may be NULL)
/// receives the pinned bytes held for the pool's sleep now (the kept copies, or the ring).
///
/// Errors, each leaving the pool awake with what it kept before: `GPUPOOL_ERROR_INVALID_VALUE`
/// for a mode that is not one, a pool never created or released, a device out of range, a pool
/// that cannot sleep (as `gpupool_sleep` says why) or that sleeps (its copy is in use);
/// `GPUPOOL_ERROR_OUT_OF_MEMORY` when the host cannot map or pin the memory;
/// `GPUPOOL_ERROR_CUDA` when page-locking fails. Nothing is written to `*pinned` then.
///
/// Thread-safe; takes each of the pool's stream locks only to read its live bytes. Not to be
/// called while the same pool's sleep runs in another thread.
///
/// # Safety
/// `pinned` must be NULL or point to writable storage for one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sleep_prepare(
    device: c_int,
    pool: u64,
    mode: u32,
    pinned: *mut usize,
) -> gpupool_status {
    boundary("gpupool_sleep_prepare", || {
        let n = runtime()?.allocator.sleep_prepare(device, pool, sleep_mode(mode)?)?;
        if !pinned.is_null() {
            // SAFETY: per this function's contract, writable for one size_t.
            unsafe { pinned.write(n) };
        }
        Ok(())
    })
}

/// Wakes `pool` on `device` (-1: current) from `gpupool_sleep`: new physical memory is
/// created and mapped at the address of every page the pool gave back (`cuMemCreate`,
/// `cuMemMap`, `cuMemSetAccess`); with offload, each live block's copy is put back bit for
/// bit, on two copy streams, and waited for; then the host copy is given back (`munmap`: host
/// memory back where it was), or, after `GPUPOOL_SLEEP_OFFLOAD_PINNED`, kept pinned for the
/// pool's next sleep. Blocks freed during the sleep are cache again. When the
/// call returns, kernels may use the pool's memory and CUDA graphs captured into it replay
/// as before.
///
/// All or nothing: when the device (or `gpupool_set_memory_fraction`'s limit) cannot give the
/// memory, gpupool releases the cache of the device's other pools (as `gpupool_empty_cache`)
/// and tries once more; if that fails, every page mapped by the call is given back, the pool
/// still sleeps with its host copy intact, and the call returns `GPUPOOL_ERROR_OUT_OF_MEMORY`:
/// free memory and call it again.
///
/// Errors, each leaving the pool asleep with its host copy: `GPUPOOL_ERROR_INVALID_VALUE` for
/// a pool never created, a device out of range, a pool that does not sleep (a second wake
/// changes nothing); `GPUPOOL_ERROR_STREAM_CAPTURE` while a capture may be under way on the
/// device; `GPUPOOL_ERROR_OUT_OF_MEMORY`; `GPUPOOL_ERROR_CUDA` when mapping or copying fails.
///
/// Thread-safe; blocks the calling thread for the copies.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpupool_wake(device: c_int, pool: u64) -> gpupool_status {
    boundary("gpupool_wake", || runtime()?.allocator.wake(device, pool))
}

/// Reads the pinned host memory that sleep and wake hold on `device` (-1: current):
/// `*staging`, the staging ring's bytes (`GPUPOOL_SLEEP_BUFFERS` times `GPUPOOL_SLEEP_CHUNK`
/// from the first offload or restore until `gpupool_empty_cache`, 0 otherwise); `*kept`, the
/// bytes of the pinned copies that pools keep for their next `GPUPOOL_SLEEP_OFFLOAD_PINNED`
/// sleep (a sleeping pool's copy is in use and not counted until it wakes). Either pointer may
/// be NULL. Counted in no device statistic (host memory) nor in `gpupool_host_stats` (not the
/// pinned host allocator's memory).
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (a device out of range); nothing is written then.
///
/// Thread-safe; no driver call.
///
/// # Safety
/// `staging` and `kept` must each be NULL or point to writable storage for one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sleep_host_bytes(
    device: c_int,
    staging: *mut usize,
    kept: *mut usize,
) -> gpupool_status {
    boundary("gpupool_sleep_host_bytes", || {
        let a = &runtime()?.allocator;
        let (s, k) = (a.sleep_staging_bytes(device)?, a.sleep_kept_bytes(device, None)?);
        // SAFETY: per this function's contract, each NULL or writable for one size_t.
        unsafe {
            if !staging.is_null() {
                staging.write(s);
            }
            if !kept.is_null() {
                kept.write(k);
            }
        }
        Ok(())
    })
}

/// Gives back the pinned host copy that `pool` (0: the default pools) on `device` (-1:
/// current) keeps after a `GPUPOOL_SLEEP_OFFLOAD_PINNED` sleep (`cuMemHostUnregister`, then
/// `munmap`: host memory back where it was) and writes its bytes to `*released` (may be NULL).
/// A sleeping pool's copy is in use and stays (0 bytes): call this after its wake. The pool's
/// next sleep in that mode pins a new copy.
///
/// Errors: `GPUPOOL_ERROR_INVALID_VALUE` (a device out of range, a pool never created).
///
/// Thread-safe; takes no lock of the pool's streams.
///
/// # Safety
/// `released` must be NULL or point to writable storage for one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn gpupool_sleep_release_kept(
    device: c_int,
    pool: u64,
    released: *mut usize,
) -> gpupool_status {
    boundary("gpupool_sleep_release_kept", || {
        let n = runtime()?.allocator.sleep_release_kept(device, pool)?;
        if !released.is_null() {
            // SAFETY: per this function's contract, writable for one size_t.
            unsafe { released.write(n) };
        }
        Ok(())
    })
}
