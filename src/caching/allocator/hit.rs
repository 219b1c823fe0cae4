//! The hit path: malloc, free and `record_stream`, which find a block's device and shard
//! through the segment index, and each thread's cache of the shards it used last, which finds
//! a stream's shard without a lock.

use std::cell::{Cell, UnsafeCell};
use std::mem::ManuallyDrop;
use std::sync::Arc;

use super::Allocator;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::Shard;
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;

/// One entry of a thread's cache of recent shards.
struct CachedShard {
    /// The id of the allocator the entry is of; 0 (no allocator's): an empty entry.
    allocator: u64,
    device: i32,
    stream: StreamHandle,
    /// The allocator's device `device`. Read only by a call on the allocator of id
    /// `allocator`, which is then alive, and so is its table of devices (never resized).
    dev: *const DeviceAllocator,
    /// One strong count of the stream's shard, owned by the entry: given back by
    /// [`ShardCache::clear`] when the entry is replaced or its thread exits.
    shard: Option<ManuallyDrop<Arc<Shard>>>,
}

const EMPTY: CachedShard = CachedShard { allocator: 0, device: 0, stream: 0, dev: std::ptr::null(), shard: None };

const SHARD_CACHE_SLOTS: usize = 4;

#[path = "hit_marker.rs"]
mod marker;

#[path = "hit_freed.rs"]
mod freed;

#[path = "hit_index.rs"]
mod kept_index;

/// Each thread remembers the shards it used last, so the hit path finds its stream's shard
/// without a lock.
///
/// It has no destructor, so that reaching it costs the hit path only its address (a
/// thread-local with one is checked for life at each access: 3 instructions a call, callgrind,
/// `tests/c/hit_loop.c`); its strong counts are given back at the thread's exit by the
/// destructor of a pthread key ([`exit_key`]). Its cells are lent to a call of the hit path
/// for the whole call (`lent`), which may come back here (an out-of-memory observer that
/// allocates): while lent, entries are neither replaced nor given back. A counter, not a
/// `RefCell`: one increment and one decrement a call, where the `RefCell`'s borrow also
/// checked for overflow (8 instructions a pair, callgrind).
struct ShardCache {
    slots: UnsafeCell<[CachedShard; SHARD_CACHE_SLOTS]>,
    next: Cell<usize>,
    lent: Cell<usize>,
}

/// Nothing stored yet on this thread: nothing to give back.
const UNOWNED: u8 = 0;
/// The thread's [`exit_key`] is set: its exit gives the counts back.
const OWNED: u8 = 1;
/// The counts were given back at the thread's exit, or the process has no key for it: nothing
/// is stored (the thread's calls find their shards in the device's table).
const GONE: u8 = 2;

thread_local! {
    static SHARD_CACHE: ShardCache = const {
        ShardCache { slots: UnsafeCell::new([EMPTY; SHARD_CACHE_SLOTS]), next: Cell::new(0), lent: Cell::new(0) }
    };
    /// Whether the thread's exit gives the cache's strong counts back: [`UNOWNED`], [`OWNED`]
    /// or [`GONE`]. Read only by [`ShardCache::store`]; apart from the cache, whose layout the
    /// hit path's instructions depend on (a field more cost the pair one, callgrind,
    /// `tests/c/hit_loop.c`).
    static OWNER: Cell<u8> = const { Cell::new(UNOWNED) };
}

/// The pthread key whose destructor, [`give_back_at_exit`], gives the thread's counts back;
/// set at the thread's first store. Not a thread-local with a destructor: glibc runs those
/// before the pthread keys' destructors, and one first reached from a key's destructor (a
/// program's that allocates, as the thread's first call) is registered too late to run at
/// all; its registration is lost too (`tests/hit/cache_hostile.rs`, `tests/c/test_thread_exit.c`
/// under valgrind). A key's destructor set from another key's runs in the next round (glibc
/// makes four; a first store in the fourth is lost). The thread-locals' destructors, C++'s
/// included, find the cache as it was. `None` when the process has used up its keys: nothing
/// is then cached. Made once; the library is then never unloaded (`RTLD_NODELETE`), so that
/// the destructor stays mapped while any thread may still run it.
fn exit_key() -> Option<libc::pthread_key_t> {
    static KEY: std::sync::OnceLock<Option<libc::pthread_key_t>> = std::sync::OnceLock::new();
    *KEY.get_or_init(|| {
        let mut key = 0;
        // SAFETY: creates a key with a destructor of the signature it takes.
        if unsafe { libc::pthread_key_create(&mut key, Some(give_back_at_exit)) } != 0 {
            return None;
        }
        let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
        // SAFETY: `dladdr` fills `info` for an address of this library; `dlopen` with
        // `RTLD_NOLOAD` only marks the object already loaded, and its handle is kept for good.
        unsafe {
            if libc::dladdr(give_back_at_exit as *const std::ffi::c_void, info.as_mut_ptr()) != 0 {
                let name = info.assume_init().dli_fname;
                libc::dlopen(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD | libc::RTLD_NODELETE);
            }
        }
        Some(key)
    })
}

/// The destructor of [`exit_key`]: the thread's counts given back.
extern "C" fn give_back_at_exit(_: *mut std::ffi::c_void) {
    // No panic leaves a C callback; dropping a shard does not panic.
    let _ = std::panic::catch_unwind(|| SHARD_CACHE.with(ShardCache::give_back));
}

/// The calling thread's cache lent for one call: the lend ends when this drops, unwinding
/// included.
struct Lent<'a>(&'a ShardCache);

impl Drop for Lent<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.lent.set(self.0.lent.get() - 1);
    }
}

impl ShardCache {
    /// The calling thread's cache. Never fails: it has no destructor, so it is never destroyed.
    #[inline(always)]
    fn get() -> &'static ShardCache {
        // SAFETY: a thread-local without a destructor lives as long as its thread, and the
        // reference does not leave the thread (`ShardCache` is not `Sync`): every use of it
        // ends before the thread does.
        SHARD_CACHE.with(|c| unsafe { &*std::ptr::from_ref(c) })
    }

    /// Lends the cache to a call (see the type's doc) and returns the first entry that `pick`
    /// takes, with the lend.
    #[inline(always)]
    fn lend(&self, pick: impl Fn(&CachedShard) -> bool) -> Option<(&CachedShard, Lent<'_>)> {
        // SAFETY: entries change only in `store` and `clear`, which leave them alone while any
        // call holds a lend; the lend is taken before the reference is handed out.
        let slots = unsafe { &*self.slots.get() };
        let slot = slots.iter().find(|c| pick(c))?;
        self.lent.set(self.lent.get() + 1);
        Some((slot, Lent(self)))
    }

    /// Empties entry `i`, giving back its strong count. Not while lent (see the type's doc).
    fn clear(&self, i: usize) {
        if self.lent.get() != 0 {
            return;
        }
        // SAFETY: not lent, so no reference into the entries is alive (`lend`); the thread's
        // own code is the only one that reaches them.
        let slot = unsafe { &mut (*self.slots.get())[i] };
        slot.allocator = 0;
        if let Some(shard) = slot.shard.take() {
            drop(ManuallyDrop::into_inner(shard));
        }
    }

    /// At the thread's exit: every entry emptied, and none stored again.
    fn give_back(&self) {
        OWNER.set(GONE);
        for i in 0..SHARD_CACHE_SLOTS {
            self.clear(i);
        }
        freed::give_back();
        kept_index::give_back();
    }

    /// Whether the thread's exit will give back what is stored now: sets the thread's
    /// [`exit_key`] at its first store.
    fn owned(&self) -> bool {
        match OWNER.get() {
            OWNED => true,
            GONE => false,
            _ => {
                // SAFETY: the key exists; its value is only tested for null.
                let set = exit_key()
                    .is_some_and(|key| unsafe { libc::pthread_setspecific(key, std::ptr::from_ref(self).cast()) == 0 });
                OWNER.set(if set { OWNED } else { GONE });
                set
            }
        }
    }

    /// Stores a strong count of `shard` in place of the entry of its allocator, device and
    /// stream, or of the oldest, behind the allocator's [`MARKER`](marker::MARKER) ([`ShardCache::put_marker`]).
    /// Does nothing while lent, or once the thread's counts were given back (its exit), when
    /// nothing would give the count back: the count is taken only once the entry is stored.
    fn store(&self, allocator: u64, dev: &DeviceAllocator, stream: StreamHandle, shard: &Arc<Shard>) {
        if self.lent.get() != 0 || !self.owned() {
            return;
        }
        let device = dev.device;
        self.put_marker(allocator, dev);
        // SAFETY: as in `clear`; the reference ends before `clear` below.
        let slots = unsafe { &*self.slots.get() };
        // The stream first: the entries of a thread's streams differ in it alone.
        let stale = slots.iter().position(|c| c.stream == stream && c.allocator == allocator && c.device == device);
        let i = stale.unwrap_or_else(|| {
            let next = self.next.get().max(1); // not the marker's entry
            self.next.set((next + 1) % SHARD_CACHE_SLOTS);
            next
        });
        self.clear(i);
        let entry = CachedShard { allocator, device, stream, dev, shard: Some(ManuallyDrop::new(shard.clone())) };
        // SAFETY: as in `clear`.
        unsafe { (*self.slots.get())[i] = entry };
    }
}

impl Allocator {
    /// [`Allocator::malloc`] on the shard the calling thread's cache holds for `device` (as
    /// named: -1 never matches) and `stream`, if it holds one that is not retired (see
    /// `shard_table`); `None` when it does not, having done nothing. The stream is then hot
    /// for this thread (see `peaks`). `routes_seen`: the caller found no route to a private
    /// pool for the stream.
    ///
    /// The device comes from the entry: a hit looks up no device (13 instructions a malloc,
    /// callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    fn malloc_cached(
        &self,
        size: usize,
        device: i32,
        stream: StreamHandle,
        routes_seen: bool,
    ) -> Option<Result<DevicePtr, Box<Error>>> {
        let cache = ShardCache::get();
        let (slot, _lent) = cache.lend(|c| c.allocator == self.id && c.device == device && c.stream == stream)?;
        let shard = slot.shard.as_deref()?;
        if shard.is_retired() {
            return None;
        }
        // SAFETY: the entry is this allocator's, which is alive (see `CachedShard::dev`).
        let dev = unsafe { &*slot.dev };
        if size == 0 || (!routes_seen && dev.routes_active()) {
            return None;
        }
        Some(dev.malloc(shard, size, true))
    }

    /// [`Allocator::malloc`] when the calling thread's cache does not hold the stream's shard:
    /// the device, then the shard from the device's table, remembered in the thread's cache.
    ///
    /// A thread ended in a callout on the way (a stream filter, a pool's allocator, an observer:
    /// `crate::callout`) ends here, its block given back.
    #[cold]
    #[inline(never)]
    fn malloc_uncached(&self, size: usize, device: i32, stream: StreamHandle) -> Result<DevicePtr, Box<Error>> {
        let deferred = crate::callout::Deferred::enter();
        let r = self.uncached_body(size, device, stream);
        drop(deferred);
        crate::callout::end_of_malloc(r, |p| drop(self.free(p)))
    }

    /// The work of [`Allocator::malloc_uncached`].
    fn uncached_body(&self, size: usize, device: i32, stream: StreamHandle) -> Result<DevicePtr, Box<Error>> {
        // The caller checked the process is not a forked child (`malloc_in_parent`).
        let dev = self.device_or_init_in_parent(device)?;
        if size == 0 {
            return Ok(0);
        }
        // Read once for both tests (a second read cost 3 instructions a cold malloc).
        let routed = dev.routes_active();
        if routed && let Some(pool) = dev.route_for(stream) {
            return Ok(dev.malloc_in_pool(pool, stream, size)?);
        }
        // Asked again only where the first ask could not match: the device named by -1, or a
        // route looked for (the cache's scan, about 15 instructions a cold malloc).
        if (device != dev.device || routed)
            && let Some(r) = self.malloc_cached(size, dev.device, stream, true)
        {
            return r;
        }
        // The shard of the block this thread freed last, when it is the stream's (`hit_freed`).
        let shard = freed::take(self.id, dev.device, stream).unwrap_or_else(|| dev.shard_or_create(stream));
        self.remember_shard(dev, stream, &shard);
        dev.malloc(&shard, size, false)
    }

    /// Puts `shard` in the calling thread's cache of recent shards, in place of its stale entry
    /// or the oldest.
    fn remember_shard(&self, dev: &DeviceAllocator, stream: StreamHandle, shard: &Arc<Shard>) {
        // The segment index's lock-free read keeps a node per thread (`arc-swap`'s debt list)
        // made at the thread's first read. The hit path's frees rarely read it
        // (`free_recent`), so a thread's first read could come at its exit, from a
        // pthread-key destructor that frees, after its thread-locals were destroyed: the node
        // made then is never freed (`tests/c/test_thread_exit.c` under valgrind). Read once
        // here, while the thread runs, until its cache is owned: the node serves every index,
        // and an owned cache was stored by a call that read one already (a read at each
        // store cost a cold malloc about 60 instructions, callgrind,
        // `examples/stream_rotation.rs`).
        if OWNER.get() != OWNED {
            self.index.with_segment(0, |_| ());
        }
        ShardCache::get().store(self.id, dev, stream, shard);
    }

    /// Allocates at least `size` bytes on `device` (-1: the calling thread's current device)
    /// for use on `stream` (PyTorch `raw_alloc_with_stream`). Returns 0 for `size` 0.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range, size overflow),
    /// [`Error::OutOfMemory`] (after releasing the cache and retrying once, and calling the
    /// out-of-memory observers: see [`Allocator::attach_oom_observer`]), [`Error::Cuda`],
    /// [`Error::DriverUnavailable`] in a process forked from one that used gpupool.
    #[inline(always)]
    pub fn malloc(&self, size: usize, device: i32, stream: StreamHandle) -> Result<DevicePtr, Error> {
        crate::caching::fork::check()?;
        Ok(self.malloc_in_parent(size, device, stream)?)
    }

    /// [`Allocator::malloc`] for a caller that checked the process is not a forked child (the
    /// C export's start check does: `ffi::started_runtime`), a check fewer a call.
    ///
    /// Inlined, as the hit path below it: each call between the C ABI's export and the cached
    /// block cost the hit pair a frame (about 15 instructions) and a copy of the result. The
    /// error boxed, as the hit path's (unboxed here, the result went through the stack: 6
    /// instructions a malloc, callgrind, `tests/c/hit_loop.c`).
    #[inline(always)]
    pub(crate) fn malloc_in_parent(
        &self,
        size: usize,
        device: i32,
        stream: StreamHandle,
    ) -> Result<DevicePtr, Box<Error>> {
        match self.malloc_cached(size, device, stream, false) {
            Some(r) => r,
            None => self.malloc_uncached(size, device, stream),
        }
    }

    /// Frees a pointer from [`Allocator::malloc`] (PyTorch `raw_delete`). 0 is a no-op.
    ///
    /// Errors: [`Error::InvalidPointer`] (not from gpupool, interior, double free), leaving
    /// every pool as it was; [`Error::DriverUnavailable`] in a process forked from one that
    /// used gpupool. If an event for a `record_stream` stream cannot be created or recorded,
    /// the block waits for the next device synchronisation instead (see
    /// [`Allocator::free_after_device_sync`]) and the free succeeds.
    #[inline(always)]
    pub fn free(&self, ptr: DevicePtr) -> Result<(), Error> {
        crate::caching::fork::check()?;
        Ok(self.free_in_parent(ptr)?)
    }

    /// [`Allocator::free`] for a caller that checked the process is not a forked child, as
    /// [`Allocator::malloc_in_parent`].
    ///
    /// Inlined up to the guess of the block's shard, as [`Allocator::malloc`] is; the search of
    /// the segment index out of line ([`Allocator::free_indexed`]).
    #[inline(always)]
    pub(crate) fn free_in_parent(&self, ptr: DevicePtr) -> Result<(), Box<Error>> {
        if ptr == 0 {
            return Ok(());
        }
        match self.free_recent(ptr) {
            Some(r) => r,
            None => self.free_indexed(ptr).map_err(Box::new),
        }
    }

    /// [`Allocator::free`] of a block found through the segment index.
    #[inline(never)]
    fn free_indexed(&self, ptr: DevicePtr) -> Result<(), Error> {
        kept_index::with_segment(&self.index, ptr, |seg| match seg {
            None => Err(not_allocated(ptr)),
            Some(e) => {
                ShardCache::get().guess_again_if_right(self.id, &e.owner);
                freed::remember(self.id, e.device, &e.owner);
                self.used_device_in_parent(e.device)?.free(&e.owner, ptr, e.base)
            }
        })
    }

    /// The hit path of [`Allocator::free`]: a thread usually frees what it allocated, so the
    /// shard it allocated from last (the first of its cache of recent shards that is this
    /// allocator's) is asked first, under its lock, whether `ptr` is one of its allocated
    /// blocks; the segment index, whose lock-free read costs more than the rest of the free
    /// (callgrind, `examples/hit_loop`: 130 of 530 instructions), is searched only when it is
    /// not. A wrong guess costs a lock and a hash probe; after a malloc that missed the
    /// thread's cache, frees do not guess until one would have guessed right ([`MARKER`](marker::MARKER)).
    /// `None`: not freed here.
    #[inline(always)]
    fn free_recent(&self, ptr: DevicePtr) -> Option<Result<(), Box<Error>>> {
        let (slot, _lent) = ShardCache::get().lend(|c| c.allocator == self.id)?;
        // SAFETY: as in `malloc_cached`.
        let dev = unsafe { &*slot.dev };
        dev.free_if_listed(slot.shard.as_deref()?, ptr)
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
