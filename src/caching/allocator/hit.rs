//! The hit path: malloc, free and `record_stream`, which find a block's device and shard
//! through the segment index, and each thread's cache of the shards it used last, which finds
//! a stream's shard without a lock.

use std::cell::RefCell;
use std::sync::Arc;

use super::Allocator;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::Shard;
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;

struct CachedShard {
    allocator: u64,
    device: i32,
    stream: StreamHandle,
    shard: Arc<Shard>,
}

const SHARD_CACHE_SLOTS: usize = 4;

/// Each thread remembers the shards it used last, so the hit path finds its stream's shard
/// without a lock.
struct ShardCache {
    slots: [Option<CachedShard>; SHARD_CACHE_SLOTS],
    next: usize,
}

thread_local! {
    static SHARD_CACHE: RefCell<ShardCache> =
        const { RefCell::new(ShardCache { slots: [const { None }; SHARD_CACHE_SLOTS], next: 0 }) };
}

impl Allocator {
    /// [`DeviceAllocator::malloc`] on the shard of `stream`, and whether this thread used it
    /// lately (it was in the thread's cache of recent shards: the stream is hot here, see
    /// `peaks`). On a hit the cache is lent to the call, read-only, for the whole call, which may
    /// come back here (an out-of-memory observer runs inside it), and no reference count is
    /// taken (two atomic operations saved).
    ///
    /// The hit's call is the only one inlined here: with a closure called both on the hit and
    /// on the miss, the compiler kept the closure out of line, which cost the hit pair about 30
    /// instructions (callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    fn malloc_on_shard(
        &self,
        dev: &DeviceAllocator,
        stream: StreamHandle,
        size: usize,
    ) -> Result<DevicePtr, Box<Error>> {
        // The cache by address, so that the call below is not a closure of `try_with` (which
        // the compiler kept out of line: 30 instructions a malloc, callgrind).
        let Ok(cache) = SHARD_CACHE.try_with(std::ptr::from_ref) else {
            return self.malloc_on_new_shard(dev, stream, size);
        };
        // SAFETY: `try_with` found this thread's cache alive, and a thread-local is destroyed
        // only by its own thread, after its other code (this call included) has returned or
        // from a destructor of another thread-local, which then runs instead of it, not
        // during this call.
        let cache = unsafe { &*cache }.borrow();
        let slot = cache
            .slots
            .iter()
            .flatten()
            .find(|c| c.allocator == self.id && c.device == dev.device && c.stream == stream);
        match slot {
            // A retired shard (see `shard_table`) is refetched, and replaces this slot.
            Some(slot) if !slot.shard.is_retired() => dev.malloc(&slot.shard, size, true),
            _ => {
                drop(cache);
                self.malloc_on_new_shard(dev, stream, size)
            }
        }
    }

    /// [`Allocator::malloc_on_shard`] when the calling thread did not use the stream's shard
    /// lately: the shard from the device's table, remembered in the thread's cache.
    #[cold]
    #[inline(never)]
    fn malloc_on_new_shard(
        &self,
        dev: &DeviceAllocator,
        stream: StreamHandle,
        size: usize,
    ) -> Result<DevicePtr, Box<Error>> {
        let shard = dev.shard_or_create(stream);
        self.remember_shard(dev.device, stream, &shard);
        dev.malloc(&shard, size, false)
    }

    /// Puts `shard` in the calling thread's cache of recent shards, in place of its stale entry
    /// or the oldest. Out of line: inlined, it costs the hit path an instruction per call
    /// (callgrind, `examples/hit_loop`).
    #[inline(never)]
    fn remember_shard(&self, device: i32, stream: StreamHandle, shard: &Arc<Shard>) {
        // The segment index's lock-free read keeps a node per thread (`arc-swap`'s debt list)
        // made at the thread's first read. The hit path's frees rarely read it
        // (`free_recent`), so a thread's first read could come at its exit, from a
        // pthread-key destructor that frees, after its thread-locals were destroyed: the node
        // made then is never freed (`tests/c/test_thread_exit.c` under valgrind). Read once
        // here, while the thread runs.
        self.index.with_segment(0, |_| ());
        let _ = SHARD_CACHE.try_with(|cache| {
            // Lent already when `f` of an outer call on this thread calls back into the
            // allocator (an out-of-memory observer that allocates): the cache then stays as it is.
            let Ok(mut cache) = cache.try_borrow_mut() else { return };
            let stale = cache.slots.iter().position(|c| {
                c.as_ref().is_some_and(|c| c.allocator == self.id && c.device == device && c.stream == stream)
            });
            let slot = stale.unwrap_or_else(|| {
                let next = cache.next;
                cache.next = (next + 1) % SHARD_CACHE_SLOTS;
                next
            });
            cache.slots[slot] = Some(CachedShard { allocator: self.id, device, stream, shard: shard.clone() });
        });
    }

    /// Allocates at least `size` bytes on `device` (-1: the calling thread's current device)
    /// for use on `stream` (PyTorch `raw_alloc_with_stream`). Returns 0 for `size` 0.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range, size overflow),
    /// [`Error::OutOfMemory`] (after releasing the cache and retrying once, and calling the
    /// out-of-memory observers: see [`Allocator::attach_oom_observer`]), [`Error::Cuda`].
    ///
    /// Inlined, as the hit path below it: each call between the C ABI's export and the cached
    /// block cost the hit pair a frame (about 15 instructions) and a copy of the result.
    #[inline(always)]
    pub fn malloc(&self, size: usize, device: i32, stream: StreamHandle) -> Result<DevicePtr, Error> {
        let dev = self.device_or_init(device)?;
        if size == 0 {
            return Ok(0);
        }
        if dev.routes_active()
            && let Some(pool) = dev.route_for(stream)
        {
            return dev.malloc_in_pool(pool, stream, size);
        }
        self.malloc_on_shard(dev, stream, size).map_err(|e| *e)
    }

    /// Frees a pointer from [`Allocator::malloc`] (PyTorch `raw_delete`). 0 is a no-op.
    ///
    /// Errors: [`Error::InvalidPointer`] (not from gpupool, interior, double free), leaving
    /// every pool as it was. If an event for a `record_stream` stream cannot be created or
    /// recorded, the block waits for the next device synchronisation instead (see
    /// [`Allocator::free_after_device_sync`]) and the free succeeds.
    ///
    /// Inlined up to the guess of the block's shard, as [`Allocator::malloc`] is; the search of
    /// the segment index out of line ([`Allocator::free_indexed`]).
    #[inline(always)]
    pub fn free(&self, ptr: DevicePtr) -> Result<(), Error> {
        if ptr == 0 {
            return Ok(());
        }
        match self.free_recent(ptr) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(*e),
            None => self.free_indexed(ptr),
        }
    }

    /// [`Allocator::free`] of a block found through the segment index.
    #[inline(never)]
    fn free_indexed(&self, ptr: DevicePtr) -> Result<(), Error> {
        // Before the index: the C export checks for a fork no more (`started_runtime`).
        crate::caching::fork::check()?;
        self.index.with_segment(ptr, |seg| match seg {
            None => Err(not_allocated(ptr)),
            Some(e) => self.used_device(e.device)?.free(&e.owner, ptr, e.base),
        })
    }

    /// The hit path of [`Allocator::free`]: a thread usually frees what it allocated, so the
    /// shard it allocated from last (the first of its cache of recent shards that is this
    /// allocator's) is asked first, under its lock, whether `ptr` is one of its allocated
    /// blocks; the segment index, whose lock-free read costs more than the rest of the free
    /// (callgrind, `examples/hit_loop`: 130 of 530 instructions), is searched only when it is
    /// not. A wrong guess costs a lock and a hash probe. `None`: not freed here.
    #[inline(always)]
    fn free_recent(&self, ptr: DevicePtr) -> Option<Result<(), Box<Error>>> {
        if crate::caching::fork::check().is_err() {
            return None;
        }
        // By address, as in `malloc_on_shard`.
        let cache = SHARD_CACHE.try_with(std::ptr::from_ref).ok()?;
        // SAFETY: as in `malloc_on_shard`: alive for the whole call.
        let cache = unsafe { &*cache }.borrow();
        let slot = cache.slots.iter().flatten().find(|c| c.allocator == self.id)?;
        let dev = self.devices.get(slot.device as usize)?.get()?;
        dev.free_if_listed(&slot.shard, ptr)
    }

    /// Frees like [`Allocator::free`], but the block is handed out again only after gpupool has
    /// synchronised its whole device (`cuCtxSynchronize`) after this call: work queued before
    /// the free on any stream may still use it, as a program that calls `cudaFree` may assume
    /// (`cudaFree` waits for the device). Until then the block counts as active, not allocated,
    /// like one awaiting `record_stream` events. The synchronisation happens at
    /// [`Allocator::release_deferred`], and in `empty_cache` and the out-of-memory path before
    /// they release the cache. Not a PyTorch rule: the LD_PRELOAD shim's safe `cudaFree`.
    ///
    /// Returns the device ordinal and its bytes now awaiting a synchronisation.
    ///
    /// Errors: [`Error::InvalidPointer`] (not from gpupool, interior, double free), leaving
    /// every pool as it was.
    pub fn free_after_device_sync(&self, ptr: DevicePtr) -> Result<(i32, usize), Error> {
        self.index.with_segment(ptr, |seg| match seg {
            None => Err(not_allocated(ptr)),
            Some(e) => Ok((e.device, self.used_device(e.device)?.free_after_sync(&e.owner, ptr, e.base)?)),
        })
    }

    /// Marks the block at `ptr` as used on `stream` (PyTorch `recordStream`).
    ///
    /// Errors: [`Error::InvalidPointer`] when `ptr` is not an allocated block.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), Error> {
        self.index.with_segment(ptr, |seg| match seg {
            None => Err(not_allocated(ptr)),
            Some(e) => self.used_device(e.device)?.record_stream(&e.owner, ptr, e.base, stream),
        })
    }
}

fn not_allocated(ptr: DevicePtr) -> Error {
    Error::InvalidPointer(format!("pointer {ptr:#x} was not allocated by gpupool"))
}
