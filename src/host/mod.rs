//! Pinned host memory: PyTorch's caching host allocator (`CachingHostAllocatorImpl` in
//! `aten/src/ATen/core/CachingHostAllocator.h`, its CUDA backing in
//! `aten/src/ATen/cuda/CachingHostAllocator.cpp`), behind `gpupool_host_*`.
//!
//! The rules, PyTorch's:
//! - A request is rounded up to its size class, and each class has its own free list
//!   (`size_index`). Blocks are never split nor merged: a block is always one whole allocation
//!   of its size class.
//! - A freed block is reused only after the work of every stream named by
//!   [`HostAllocator::record_event`] since it was handed out has completed: the free records
//!   one event per such stream, and the block goes back to its free list once every one of
//!   them has completed, found by polling (`cuEventQuery`, never blocking) at later
//!   allocations (`free`, `process_events`). Events are kept for reuse (PyTorch's `EventPool`).
//! - A miss allocates new memory: `cuMemHostAlloc` (portable to every context) by default, or
//!   `malloc` and `cuMemHostRegister` with `pinned_use_cuda_host_register` (the pages touched
//!   first by `pinned_num_register_threads` threads, `allocWithCudaHostRegister`); with
//!   `pinned_reserve_segment_size_mb`, the first misses are carved from one segment of that
//!   size, pinned once at the first miss and never released (`PinnedReserveSegment`).
//! - `empty_cache` releases every free block, after polling the events of freed blocks.
//! - Size 0 gives a null pointer.
//!
//! Where gpupool differs, and why:
//! - **Size classes finer than powers of two from 1 MiB up** (`classes`). PyTorch rounds every
//!   request up to a power of two (`PowerOf2Ceil`, one free list per power): 20.4 GiB pins
//!   32 GiB. gpupool keeps powers of two up to 1 MiB and divides each power above into 32
//!   steps, so that a request of 1 MiB or more pins less than 1.032 times its size; on a miss,
//!   a cached block of a larger class up to 5% over the request serves it before new memory is
//!   pinned, so that blocks are reused by requests of about their size.
//! - **No lock shared between threads on the hit path.** PyTorch keeps one mutex for its block
//!   set and pointer map, one per size class and one for the event queue, all shared by every
//!   thread, and a free of a pointer looks it up under the block-set mutex. Here each thread
//!   works in its own *stripe* (a thread is given one at its first call, round robin over
//!   `2 x cores` stripes): a stripe holds free lists for every size class, the pending events
//!   of the blocks it handed out, and its share of the statistics, under one lock that only
//!   its threads take in the steady state. A free finds its block through a lock-free index
//!   (the device side's segment index: an immutable snapshot read through `arc-swap`) and
//!   returns it to the stripe that handed it out, so a block allocated by one thread and freed
//!   by another goes back where it is wanted. A thread whose stripe has no block of the size
//!   looks in the other stripes (polling their events too) before it pins new memory.
//!   Threads staging for different streams so share no lock and no written cache line.
//! - `empty_cache` keeps the reserve segment's blocks cached: their memory cannot be given
//!   back (PyTorch drops them from its lists, and the space is lost until exit).
//! - A free whose event cannot be created or recorded synchronises that stream's device
//!   instead (PyTorch's free throws); if even that fails, the block waits for the next
//!   `empty_cache`, which synchronises every device it waits on before releasing it.
//! - `pinned_use_background_threads`: as PyTorch, allocations no longer poll events on the hit
//!   path; one thread, started at the first miss, polls every stripe's events every 100 µs.
//!
//! The files, one mechanism each: `classes` (the size classes, which blocks serve which
//! requests), `blocks` (blocks and stripes), `free_list` (a class's free blocks in a stripe),
//! `hit` (the C exports' hit path, which makes no call), `handed_out` (a stripe's blocks in
//! use), `thread_number` (a thread's stripe), `events` (blocks held back by events, their
//! polling, the background thread), `pinning` (new memory from the driver, the reserve
//! segment, and unpinning), `release` (`empty_cache`, deferred and stranded blocks, the drop),
//! `stats` and `invariants`; this file keeps the shared state and the full path (`malloc`,
//! `free`, `record_event`).

mod blocks;
mod classes;
mod events;
mod free_list;
mod handed_out;
mod hit;
mod invariants;
mod pinning;
mod release;
mod stats;
mod thread_number;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use self::blocks::{Block, Padded, Stripe};
use self::events::start_background;
pub(crate) use self::hit::StripeLock;
pub use self::release::HostDeferredStats;
pub use self::stats::{DurationStat, HostStats};
use crate::caching::fork;
use crate::caching::segment_index::SegmentIndex;
use crate::config::Config;
use crate::driver::{Driver, HostPtr, StreamHandle};
use crate::error::Error;
use crate::stats::Stat;

/// What the slow path keeps, under one lock: the statistics of allocations and releases, the
/// reserve segment, blocks waiting for a device synchronisation.
#[derive(Default)]
struct Slow {
    allocations: Stat,
    allocated_bytes: Stat,
    host_alloc_time: DurationStat,
    host_free_time: DurationStat,
    num_host_alloc: i64,
    num_host_free: i64,
    /// The reserve segment: (start, size, bytes carved so far), once pinned.
    reserve: Option<(HostPtr, usize, usize)>,
    /// Freed blocks whose event could not be recorded nor their device synchronised: reused
    /// after `empty_cache` synchronises these devices.
    stranded: Vec<(i32, Arc<Block>)>,
    /// Blocks freed with [`HostAllocator::free_after_device_sync`], with the device to
    /// synchronise before they are reused.
    deferred: Vec<(i32, Arc<Block>)>,
    deferred_bytes: usize,
    /// Device synchronisations made for deferred blocks, and blocks they released.
    deferred_syncs: u64,
    deferred_released: u64,
}

/// How new memory is pinned, from the `pinned_*` keys of the configuration.
#[derive(Clone, Copy, Debug)]
struct Backing {
    use_register: bool,
    register_threads: usize,
    reserve_size: usize,
    background: bool,
}

struct Inner {
    driver: Arc<dyn Driver>,
    backing: Backing,
    stripes: Box<[Padded<Mutex<Stripe>>]>,
    /// The stripes' count less one (a power of two): a thread number's stripe is
    /// `number & stripe_mask`.
    stripe_mask: usize,
    index: SegmentIndex<Arc<Block>>,
    slow: Mutex<Slow>,
    /// Whether a block was ever deferred: until then a miss skips looking at `slow.deferred`.
    any_deferred: AtomicBool,
    background_started: AtomicBool,
}

/// Pinned host memory blocks cached as PyTorch's `CachingHostAllocator` caches them (see the
/// module docs for the rules and the lock design). Thread-safe; cheap to clone (one shared
/// allocator).
#[derive(Clone)]
pub struct HostAllocator {
    inner: Arc<Inner>,
}

impl HostAllocator {
    /// A host allocator over `driver`, with the `pinned_*` settings of `config`.
    pub fn new(driver: Arc<dyn Driver>, config: &Config) -> HostAllocator {
        fork::watch();
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        // At most 64: a thread's number keeps only the bits that choose among 64
        // (`thread_number`).
        let n = (2 * cores).next_power_of_two().clamp(8, thread_number::NUMBER_BITS + 1);
        let backing = Backing {
            use_register: config.pinned_use_cuda_host_register,
            register_threads: config.pinned_num_register_threads.max(1),
            reserve_size: config.pinned_reserve_segment_size,
            background: config.pinned_use_background_threads,
        };
        HostAllocator {
            inner: Arc::new(Inner {
                driver,
                backing,
                stripes: (0..n).map(|_| Padded::default()).collect(),
                stripe_mask: n - 1,
                index: SegmentIndex::default(),
                slow: Mutex::new(Slow::default()),
                any_deferred: AtomicBool::new(false),
                background_started: AtomicBool::new(false),
            }),
        }
    }

    /// Allocates a block of at least `size` bytes of pinned host memory (PyTorch
    /// `CachingHostAllocatorImpl::allocate`): the size rounded up to its class
    /// ([`rounded_size`]: a power of two up to 1 MiB, a 32nd of a power of two above), a cached
    /// block of that class if one is free, else a cached block of a larger class at most 5%
    /// over `size`, new pinned memory otherwise. Size 0 gives 0 (null).
    ///
    /// Errors: [`Error::InvalidValue`] when `size` is over 2^63 bytes;
    /// [`Error::OutOfMemory`] when the host cannot pin more; [`Error::Cuda`] when a driver
    /// call fails otherwise; [`Error::DriverUnavailable`] in a forked child.
    ///
    /// A hit takes `hit`'s call-free path, as the C export's does; anything else the full path
    /// (`malloc_in_parent`), whose misses are out of line.
    #[inline(always)]
    pub fn malloc(&self, size: usize) -> Result<HostPtr, Error> {
        fork::check()?;
        let mut ptr = 0;
        match self.malloc_hit(size, |p| ptr = p) {
            Ok(_stripe) => Ok(ptr),
            Err(stripe) => {
                drop(stripe);
                Ok(self.malloc_in_parent(size)?)
            }
        }
    }

    /// [`HostAllocator::malloc`] for a caller that checked the process is not a forked child
    /// (the C export's start check does: `ffi::started_host`), a check fewer a call; the error
    /// boxed, as [`HostAllocator::malloc_class`]'s.
    #[inline(always)]
    pub(crate) fn malloc_in_parent(&self, size: usize) -> Result<HostPtr, Box<Error>> {
        if size == 0 {
            return Ok(0);
        }
        if size <= classes::SMALL_MAX {
            return self.malloc_class(size, classes::small_class(size));
        }
        self.malloc_large(size)
    }

    /// [`HostAllocator::malloc`] of more than 1 MiB: a class of a 32nd of a power of two.
    #[inline(never)]
    fn malloc_large(&self, size: usize) -> Result<HostPtr, Box<Error>> {
        let Some(class) = classes::large_class(size) else {
            return Err(Box::new(Error::InvalidValue(format!(
                "size {size} bytes is too large: the largest pinned block is 2^63 bytes"
            ))));
        };
        self.malloc_class(size, class)
    }

    /// [`HostAllocator::malloc`] of `size` bytes, of `class`: a free block of the class in this
    /// thread's stripe, else the miss path. Inlined in both callers, so that neither pays a
    /// call: a small request's rounding is one bit scan (cheaper than PyTorch's
    /// `PowerOf2Ceil`), a large one's a dozen instructions more. The error is boxed so that
    /// the answer fits two registers (as the device's hit path's, `DeviceAllocator::malloc`).
    #[inline(always)]
    fn malloc_class(&self, size: usize, class: usize) -> Result<HostPtr, Box<Error>> {
        let me = self.stripe_index();
        let inner = &*self.inner;
        {
            let mut st = inner.stripes[me].0.lock();
            // The stripe's events first: empty on the hit path, one test (2 instructions a
            // malloc fewer than the configuration's first, callgrind).
            if !st.pending.is_empty() && !inner.backing.background {
                inner.process_events(&mut st, true)?;
            }
            if let Some(p) = inner.take(&mut st, me, class) {
                return Ok(p);
            }
        }
        self.malloc_miss(me, size, class).map_err(Box::new)
    }

    #[cold]
    fn malloc_miss(&self, me: usize, size: usize, class: usize) -> Result<HostPtr, Error> {
        let inner = &*self.inner;
        if inner.backing.background && !inner.background_started.swap(true, Ordering::AcqRel) {
            start_background(Arc::downgrade(&self.inner));
        }
        // Every stripe's free blocks and finished events, this one's first (PyTorch
        // `process_events_for_specific_size`, with the background thread on). The events are
        // all polled here, not only up to the first busy one as on the hit path: a block whose
        // copy finished behind a busier stream's is worth a few queries, pinning costs
        // milliseconds. The request's own class first in every stripe, then each larger class
        // that may serve it, smallest first: the best fit among the cached blocks.
        let n = inner.stripes.len();
        let widest = classes::widest(class, size);
        for c in class..=widest {
            for k in 0..n {
                let s = (me + k) % n;
                let mut st = inner.stripes[s].0.lock();
                if c == class && !st.pending.is_empty() {
                    inner.process_events(&mut st, false)?;
                }
                if let Some(b) = st.free[c].pop() {
                    drop(st);
                    let mut mine = inner.stripes[me].0.lock();
                    return Ok(inner.hand_out(&mut mine, me, b));
                }
            }
        }
        // A synchronisation is worth it only for a block that serves the request (it may wait
        // long).
        let deferred_fits = inner.any_deferred.load(Ordering::Acquire)
            && inner.slow.lock().deferred.iter().any(|(_, b)| classes::serves(b.class, b.size, class, size));
        if deferred_fits && inner.release_deferred()? > 0 {
            let mut st = inner.stripes[me].0.lock();
            for c in class..=widest {
                if let Some(p) = inner.take(&mut st, me, c) {
                    return Ok(p);
                }
            }
        }
        let block = inner.new_block(classes::class_size(class), class)?;
        let mut st = inner.stripes[me].0.lock();
        Ok(inner.hand_out(&mut st, me, block))
    }

    /// Returns a block from [`HostAllocator::malloc`] (PyTorch `free`): to its free list at
    /// once when no stream was named by [`HostAllocator::record_event`], else once an event
    /// recorded now on each such stream has completed. 0 (null) is a no-op.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer that is not the start of a block
    /// gpupool pinned, or of a block already freed; nothing changes.
    /// [`Error::DriverUnavailable`] in a forked child, before any lock.
    ///
    /// A hit takes `hit`'s path, as [`HostAllocator::malloc`]'s.
    #[inline(always)]
    pub fn free(&self, ptr: HostPtr) -> Result<(), Error> {
        fork::check()?;
        match self.free_hit(ptr) {
            Ok(_stripe) => Ok(()),
            Err(stripe) => {
                drop(stripe);
                Ok(self.free_in_parent(ptr)?)
            }
        }
    }

    /// [`HostAllocator::free`] for a caller that checked the process is not a forked child, as
    /// [`HostAllocator::malloc_in_parent`].
    #[inline(always)]
    pub(crate) fn free_in_parent(&self, ptr: HostPtr) -> Result<(), Box<Error>> {
        if ptr == 0 {
            return Ok(());
        }
        let me = self.stripe_index();
        let inner = &*self.inner;
        {
            let mut st = inner.stripes[me].0.lock();
            if let Some(block) = st.handed_out.take_recent(ptr) {
                Inner::to_free_list(&mut st, block);
                return Ok(());
            }
        }
        self.free_listed(ptr)
    }

    /// [`HostAllocator::free`] of a block that is not among the few the calling thread's
    /// stripe handed out last with no stream named: found through the pinned segments' index,
    /// in its home stripe.
    /// Boxed error: see [`HostAllocator::malloc_class`].
    #[cold]
    #[inline(never)]
    fn free_listed(&self, ptr: HostPtr) -> Result<(), Box<Error>> {
        let inner = &*self.inner;
        let (_, mut st) = inner.home_of(ptr, "free")?;
        let h = st.handed_out.remove(ptr).ok_or_else(|| freed_already(ptr))?;
        inner.give_back(&mut st, h.block, h.streams);
        Ok(())
    }

    /// Says that the block at `ptr` is used by work queued on `stream` (PyTorch
    /// `CachingHostAllocator_recordEvent`, `record_event`): at its free, an event is recorded
    /// on `stream`, and the block is reused only once it has completed. The stream's device is
    /// found now ([`DeviceOps::stream_device`](crate::driver::ops::DeviceOps::stream_device)). Naming a stream twice counts once; 0 (null) is a
    /// no-op.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer that is not the start of an allocated
    /// block; [`Error::Cuda`] when the stream's device cannot be found (a destroyed stream);
    /// nothing changes.
    pub fn record_event(&self, ptr: HostPtr, stream: StreamHandle) -> Result<(), Error> {
        fork::check()?;
        if ptr == 0 {
            return Ok(());
        }
        let inner = &*self.inner;
        inner.block_at(ptr, "record an event for")?;
        let device = inner
            .driver
            .stream_device(stream)
            .map_err(|e| Error::driver_call(e, &format!("finding the device of stream {stream:#x}")))?;
        let (_, mut st) = inner.home_of(ptr, "record an event for")?;
        let Some(h) = st.handed_out.get_mut(ptr) else {
            return Err(Error::InvalidPointer(format!(
                "the pinned block at {ptr:#x} is not allocated (it was freed): an event is recorded only for a block \
                 in use"
            )));
        };
        if !h.streams.iter().any(|&(s, _)| s == stream) {
            h.streams.push((stream, device));
        }
        Ok(())
    }

    /// Whether `ptr` lies in a block gpupool pinned (any byte of it, allocated or cached):
    /// what the LD_PRELOAD shim asks before it takes a `cudaFreeHost`.
    pub fn owns(&self, ptr: HostPtr) -> bool {
        self.inner.index.with_segment(ptr as u64, |e| e.is_some())
    }

    /// The size (bytes, its class's) of the allocated block at `ptr`, if `ptr` is the start of
    /// one: [`rounded_size`] of the request, or up to 5% more than the request when a cached
    /// block of a larger class served it. `None` in a forked child, before any lock (as
    /// [`crate::Allocator::block_info`]: another thread may have held the stripe's lock at the
    /// fork).
    pub fn block_size(&self, ptr: HostPtr) -> Option<usize> {
        fork::check().ok()?;
        let (_, st) = self.inner.home_of(ptr, "look up").ok()?;
        st.handed_out.get(ptr).map(|b| b.size)
    }
}

/// The bytes a new pinned block for a request of `size` bytes holds: `size` rounded up to a
/// power of two up to 1 MiB (PyTorch's rule), to a multiple of a 32nd of the power of two below
/// it above 1 MiB (less than 1/32 more than `size`). `None` for 0 and past 2^63 bytes.
pub fn rounded_size(size: usize) -> Option<usize> {
    if size == 0 {
        return None;
    }
    classes::round(size).map(|(_, rounded)| rounded)
}

fn freed_already(ptr: HostPtr) -> Error {
    Error::InvalidPointer(format!("the pinned block at {ptr:#x} was freed already"))
}

/// The process-wide host allocator, over the process-wide allocator's driver and
/// configuration (the C API and the LD_PRELOAD shim share it).
pub(crate) fn process_host(allocator: &crate::Allocator) -> &'static HostAllocator {
    static HOST: OnceLock<HostAllocator> = OnceLock::new();
    HOST.get_or_init(|| HostAllocator::new(allocator.driver().clone(), &allocator.config()))
}
