//! Pinned host memory: PyTorch's caching host allocator (`CachingHostAllocatorImpl` in
//! `aten/src/ATen/core/CachingHostAllocator.h`, its CUDA backing in
//! `aten/src/ATen/cuda/CachingHostAllocator.cpp`), behind `gpupool_host_*`.
//!
//! The rules, PyTorch's:
//! - A request is rounded up to a power of two (`PowerOf2Ceil`), and each power of two has its
//!   own free list (`size_index`, `Log2_64_Ceil`). Blocks are never split nor merged: a block
//!   is always one whole allocation of its size class.
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

mod stats;

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use self::stats::StatExt;
pub use self::stats::{DurationStat, HostStats};
use crate::caching::fork;
use crate::caching::segment_index::{SegmentEntry, SegmentIndex};
use crate::config::Config;
use crate::driver::{Driver, DriverError, EventHandle, HostPtr, StreamHandle};
use crate::error::Error;
use crate::stats::Stat;

/// Size classes: one per power of two up to 2^63 (PyTorch `MAX_SIZE_INDEX`).
const CLASSES: usize = 64;
/// The page size the register path touches and the reserve segment rounds to (PyTorch: 4 KiB).
const PAGE: usize = 4096;
/// How often the background thread polls events (PyTorch: 100 µs).
const BACKGROUND_PERIOD: Duration = Duration::from_micros(100);

/// Where a block's memory came from, so that it goes back the same way (PyTorch keeps
/// `use_host_register` per pointer for the same reason: the configuration may differ between
/// the allocation and the release of a block only for the Rust API, but the rule costs nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// `cuMemHostAlloc` in `device`'s primary context.
    HostAlloc { device: i32 },
    /// `posix_memalign` and `cuMemHostRegister` in `device`'s primary context.
    Registered { device: i32 },
    /// Carved from the reserve segment; never released.
    Reserve,
}

/// One block: one whole allocation of a power-of-two size (PyTorch `HostBlock`).
struct Block {
    ptr: HostPtr,
    size: usize,
    class: usize,
    origin: Origin,
    /// The stripe that handed the block out last: where it goes back to, and where it is
    /// listed while handed out.
    home: AtomicU32,
}

/// A block handed out, in its stripe's list, with the streams (and their devices) named by
/// `record_event` since.
struct HandedOut {
    block: Arc<Block>,
    streams: Vec<(StreamHandle, i32)>,
}

/// A freed block's event on one stream that has not been seen completed yet.
struct Pending {
    event: EventHandle,
    device: i32,
    block: Arc<Block>,
}

/// One stripe: what its threads use on the hit path, under one lock.
struct Stripe {
    /// Free blocks per size class, most recently freed last (PyTorch pops the back too).
    free: [Vec<Arc<Block>>; CLASSES],
    /// Blocks this stripe handed out, by address: a free by a thread of the stripe finds its
    /// block here, under the lock it takes anyway, and a block is allocated exactly while it
    /// is listed in its home stripe.
    handed_out: rustc_hash::FxHashMap<usize, HandedOut>,
    /// Events of freed blocks of this stripe, oldest first.
    pending: VecDeque<Pending>,
    /// How many pending events each block still waits for, by block address.
    waiting: rustc_hash::FxHashMap<usize, u32>,
    /// Created events kept for reuse, with their device (PyTorch's `EventPool`, per stripe).
    idle_events: Vec<(i32, EventHandle)>,
    active_requests: Stat,
    active_bytes: Stat,
}

impl Default for Stripe {
    fn default() -> Self {
        Stripe {
            free: std::array::from_fn(|_| Vec::new()),
            handed_out: Default::default(),
            pending: VecDeque::new(),
            waiting: Default::default(),
            idle_events: Vec::new(),
            active_requests: Stat::default(),
            active_bytes: Stat::default(),
        }
    }
}

/// Cache-line padding, so that stripes never share a line.
#[repr(align(128))]
#[derive(Default)]
struct Padded<T>(T);

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

thread_local! {
    /// This thread's stripe, given at its first call (`usize::MAX` until then).
    static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

/// A deferred-free summary for the LD_PRELOAD shim's report: blocks and bytes waiting, device
/// synchronisations made for them, blocks those released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostDeferredStats {
    pub blocks: u64,
    pub bytes: u64,
    pub syncs: u64,
    pub released: u64,
}

/// Writes one byte into every page of `[ptr, ptr + size)` from `threads` threads, so that the
/// kernel maps the pages before `cuMemHostRegister` locks them (PyTorch `mapPagesForRegister`:
/// faulting the pages in parallel is faster than letting the driver do it under its lock).
fn touch_pages(ptr: HostPtr, size: usize, threads: usize) {
    let touch = |start: usize, end: usize| {
        let mut p = start.next_multiple_of(PAGE);
        while p < end {
            // SAFETY: `p` lies in `[ptr, ptr + size)`, memory this allocator just allocated
            // and owns; a volatile write so that it is not optimised out.
            unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
            p += PAGE;
        }
    };
    // PyTorch's condition: more than one thread and at least a page for each.
    if threads > 1 && size >= PAGE * threads {
        std::thread::scope(|s| {
            for i in 0..threads {
                let start = ptr + size / threads * i;
                let end = if i == threads - 1 { ptr + size } else { start + size / threads };
                s.spawn(move || touch(start, end));
            }
        });
    } else {
        touch(ptr, ptr + size);
    }
}

fn micros(since: Instant) -> i64 {
    since.elapsed().as_micros().min(i64::MAX as u128) as i64
}

impl HostAllocator {
    /// A host allocator over `driver`, with the `pinned_*` settings of `config`.
    pub fn new(driver: Arc<dyn Driver>, config: &Config) -> HostAllocator {
        fork::watch();
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let n = (2 * cores).next_power_of_two().clamp(8, 64);
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
                index: SegmentIndex::default(),
                slow: Mutex::new(Slow::default()),
                any_deferred: AtomicBool::new(false),
                background_started: AtomicBool::new(false),
            }),
        }
    }

    /// The calling thread's stripe.
    #[inline]
    fn stripe_index(&self) -> usize {
        let n = self.inner.stripes.len();
        STRIPE.with(|s| {
            let mut i = s.get();
            if i == usize::MAX {
                i = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed);
                s.set(i);
            }
            i & (n - 1)
        })
    }

    /// Allocates a block of at least `size` bytes of pinned host memory (PyTorch
    /// `CachingHostAllocatorImpl::allocate`): the size rounded up to a power of two, a cached
    /// block of that size if one is free, new pinned memory otherwise. Size 0 gives 0 (null).
    ///
    /// Errors: [`Error::InvalidValue`] when `size` rounds past 2^63 bytes;
    /// [`Error::OutOfMemory`] when the host cannot pin more; [`Error::Cuda`] when a driver
    /// call fails otherwise; [`Error::DriverUnavailable`] in a forked child.
    pub fn malloc(&self, size: usize) -> Result<HostPtr, Error> {
        fork::check()?;
        if size == 0 {
            return Ok(0);
        }
        let Some(rounded) = size.checked_next_power_of_two() else {
            return Err(Error::InvalidValue(format!(
                "size {size} bytes is too large: it rounds past the largest power of two, 2^63 bytes"
            )));
        };
        let class = rounded.trailing_zeros() as usize;
        let me = self.stripe_index();
        let inner = &*self.inner;
        {
            let mut st = inner.stripes[me].0.lock();
            if !inner.backing.background && !st.pending.is_empty() {
                inner.process_events(&mut st, true)?;
            }
            if let Some(p) = inner.take(&mut st, me, class) {
                return Ok(p);
            }
        }
        self.malloc_miss(me, class, rounded)
    }

    #[cold]
    fn malloc_miss(&self, me: usize, class: usize, rounded: usize) -> Result<HostPtr, Error> {
        let inner = &*self.inner;
        if inner.backing.background && !inner.background_started.swap(true, Ordering::AcqRel) {
            start_background(Arc::downgrade(&self.inner));
        }
        // Every stripe's free blocks and finished events, this one's first (PyTorch
        // `process_events_for_specific_size`, with the background thread on). The events are
        // all polled here, not only up to the first busy one as on the hit path: a block whose
        // copy finished behind a busier stream's is worth a few queries, pinning costs
        // milliseconds.
        let n = inner.stripes.len();
        for k in 0..n {
            let s = (me + k) % n;
            let mut st = inner.stripes[s].0.lock();
            if !st.pending.is_empty() {
                inner.process_events(&mut st, false)?;
            }
            if let Some(b) = st.free[class].pop() {
                drop(st);
                let mut mine = inner.stripes[me].0.lock();
                return Ok(inner.hand_out(&mut mine, me, b));
            }
        }
        // A synchronisation is worth it only for a block of the size wanted (it may wait long).
        let deferred_fits = inner.any_deferred.load(Ordering::Acquire)
            && inner.slow.lock().deferred.iter().any(|(_, b)| b.class == class);
        if deferred_fits && inner.release_deferred()? > 0 {
            let mut st = inner.stripes[me].0.lock();
            if let Some(p) = inner.take(&mut st, me, class) {
                return Ok(p);
            }
        }
        let block = inner.new_block(rounded, class)?;
        let mut st = inner.stripes[me].0.lock();
        Ok(inner.hand_out(&mut st, me, block))
    }

    /// Returns a block from [`HostAllocator::malloc`] (PyTorch `free`): to its free list at
    /// once when no stream was named by [`HostAllocator::record_event`], else once an event
    /// recorded now on each such stream has completed. 0 (null) is a no-op.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer that is not the start of a block
    /// gpupool pinned, or of a block already freed; nothing changes.
    pub fn free(&self, ptr: HostPtr) -> Result<(), Error> {
        fork::check()?;
        if ptr == 0 {
            return Ok(());
        }
        let me = self.stripe_index();
        let inner = &*self.inner;
        {
            let mut st = inner.stripes[me].0.lock();
            if let Some(h) = st.handed_out.remove(&ptr) {
                inner.give_back(&mut st, h.block, h.streams);
                return Ok(());
            }
        }
        let (_, mut st) = inner.home_of(ptr, "free")?;
        let h = st.handed_out.remove(&ptr).ok_or_else(|| freed_already(ptr))?;
        inner.give_back(&mut st, h.block, h.streams);
        Ok(())
    }

    /// Says that the block at `ptr` is used by work queued on `stream` (PyTorch
    /// `CachingHostAllocator_recordEvent`, `record_event`): at its free, an event is recorded
    /// on `stream`, and the block is reused only once it has completed. The stream's device is
    /// found now ([`Driver::stream_device`]). Naming a stream twice counts once; 0 (null) is a
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
        let Some(h) = st.handed_out.get_mut(&ptr) else {
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

    /// Releases every cached free block to the driver (`cuMemFreeHost`, or
    /// `cuMemHostUnregister` and `free`), after polling the events of freed blocks (PyTorch
    /// `empty_cache`), and destroys the events kept for reuse. Blocks still in use, or whose
    /// events have not completed, stay; so do the reserve segment's blocks, whose memory cannot
    /// be given back. Blocks waiting for a device synchronisation (a failed event record, or
    /// [`HostAllocator::free_after_device_sync`]) are released after one.
    ///
    /// Errors: [`Error::Cuda`] when a driver call fails (what was released before stays
    /// released; a block whose release failed stays cached).
    pub fn empty_cache(&self) -> Result<(), Error> {
        fork::check()?;
        let inner = &*self.inner;
        let mut first_error = None;
        let mut note = |r: Result<(), Error>| {
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        };
        let mut to_release = Vec::new();
        let mut to_destroy = Vec::new();
        // Blocks waiting for a synchronisation first, so that they are released below.
        note(inner.release_deferred().map(|_| ()));
        note(inner.release_stranded());
        for stripe in inner.stripes.iter() {
            let mut st = stripe.0.lock();
            note(inner.process_events(&mut st, false));
            for list in st.free.iter_mut() {
                list.retain(|b| {
                    let keep = b.origin == Origin::Reserve;
                    if !keep {
                        to_release.push(b.clone());
                    }
                    keep
                });
            }
            to_destroy.append(&mut st.idle_events);
        }
        for (device, ev) in to_destroy {
            inner.driver.event_destroy(device, ev);
        }
        for b in to_release {
            note(inner.release(b));
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The statistics (PyTorch `getStats`, `torch.cuda.host_memory_stats()`). The peaks of
    /// `active_requests` and `active_bytes` are the sums of the stripes' peaks: exact while one
    /// thread allocates, an upper bound of the true peak with several (PyTorch sums its
    /// per-size peaks the same way). Thread-safe: it holds every stripe's lock, then the slow
    /// path's, for the copy (the lock order of [`HostAllocator::check_invariants`]), so that
    /// the figures are of one moment, as PyTorch's one mutex gives them. Read one stripe at a
    /// time, a block freed on a stripe already read and taken by a stripe not yet read counted
    /// twice, and `active_requests` could pass `allocations` (seen in the threaded test under
    /// AddressSanitizer).
    pub fn stats(&self) -> HostStats {
        let inner = &*self.inner;
        let mut out = HostStats::default();
        let stripes: Vec<_> = inner.stripes.iter().map(|s| s.0.lock()).collect();
        for st in &stripes {
            out.active_requests.merge(&st.active_requests);
            out.active_bytes.merge(&st.active_bytes);
        }
        let slow = inner.slow.lock();
        out.allocations = slow.allocations;
        out.allocated_bytes = slow.allocated_bytes;
        out.host_alloc_time = slow.host_alloc_time;
        out.host_free_time = slow.host_free_time;
        out.num_host_alloc = slow.num_host_alloc;
        out.num_host_free = slow.num_host_free;
        out
    }

    /// Sets every peak to its current value (PyTorch `resetPeakStats` of the host allocator);
    /// the durations' longest and shortest are cleared, as PyTorch's `DurationStat::reset_peak`.
    pub fn reset_peak_stats(&self) {
        let inner = &*self.inner;
        for stripe in inner.stripes.iter() {
            let mut st = stripe.0.lock();
            st.active_requests.reset_peak();
            st.active_bytes.reset_peak();
        }
        let mut slow = inner.slow.lock();
        let slow = &mut *slow;
        slow.allocations.reset_peak();
        slow.allocated_bytes.reset_peak();
        for d in [&mut slow.host_alloc_time, &mut slow.host_free_time] {
            d.max = 0;
            d.min = 0;
        }
    }

    /// Whether `ptr` lies in a block gpupool pinned (any byte of it, allocated or cached):
    /// what the LD_PRELOAD shim asks before it takes a `cudaFreeHost`.
    pub fn owns(&self, ptr: HostPtr) -> bool {
        self.inner.index.with_segment(ptr as u64, |e| e.is_some())
    }

    /// The size class (bytes) of the allocated block at `ptr`, if `ptr` is the start of one.
    pub fn block_size(&self, ptr: HostPtr) -> Option<usize> {
        let (_, st) = self.inner.home_of(ptr, "look up").ok()?;
        st.handed_out.get(&ptr).map(|h| h.block.size)
    }

    /// Frees the block at `ptr` for reuse only after a synchronisation of `device`, made by
    /// gpupool when a later allocation misses, when [`HostAllocator::release_deferred`] is
    /// called, or by `empty_cache`: the rule of `cudaFreeHost`, which waits for the device,
    /// for the LD_PRELOAD shim. Streams named by `record_event` need no event then. Returns
    /// the bytes now waiting.
    ///
    /// Errors: as [`HostAllocator::free`].
    pub fn free_after_device_sync(&self, ptr: HostPtr, device: i32) -> Result<usize, Error> {
        fork::check()?;
        let block = {
            let (_, mut st) = self.inner.home_of(ptr, "free")?;
            st.handed_out.remove(&ptr).ok_or_else(|| freed_already(ptr))?.block
        };
        let mut slow = self.inner.slow.lock();
        slow.deferred_bytes += block.size;
        slow.deferred.push((device, block));
        self.inner.any_deferred.store(true, Ordering::Release);
        Ok(slow.deferred_bytes)
    }

    /// Synchronises the devices of the deferred blocks and returns them to their free lists;
    /// returns how many there were.
    ///
    /// Errors: [`Error::Cuda`] when a synchronisation fails (the blocks stay deferred).
    pub fn release_deferred(&self) -> Result<usize, Error> {
        fork::check()?;
        self.inner.release_deferred()
    }

    /// The deferred frees: waiting now, and released so far.
    pub fn deferred(&self) -> HostDeferredStats {
        let slow = self.inner.slow.lock();
        HostDeferredStats {
            blocks: slow.deferred.len() as u64,
            bytes: slow.deferred_bytes as u64,
            syncs: slow.deferred_syncs,
            released: slow.deferred_released,
        }
    }

    /// Checks the allocator's invariants, for tests: every block in the index is in exactly
    /// one place (handed out, a free list, a pending event, deferred or stranded); the
    /// statistics match the blocks. Panics with what is wrong.
    pub fn check_invariants(&self) {
        let inner = &*self.inner;
        let stripes: Vec<_> = inner.stripes.iter().map(|s| s.0.lock()).collect();
        let slow = inner.slow.lock();
        let mut seen = rustc_hash::FxHashMap::<usize, &str>::default();
        let mut place = |p: usize, what: &'static str| {
            if let Some(other) = seen.insert(p, what) {
                panic!("block {p:#x} is both {other} and {what}");
            }
        };
        let (mut free_blocks, mut free_bytes) = (0i64, 0i64);
        for st in &stripes {
            for (class, list) in st.free.iter().enumerate() {
                for b in list {
                    assert_eq!(b.class, class, "block {:#x} in the wrong free list", b.ptr);
                    place(b.ptr, "free");
                    free_blocks += 1;
                    free_bytes += b.size as i64;
                }
            }
            let mut pending_blocks = rustc_hash::FxHashMap::<usize, u32>::default();
            for p in &st.pending {
                *pending_blocks.entry(p.block.ptr).or_default() += 1;
            }
            assert_eq!(pending_blocks, st.waiting, "pending events and waiting counts differ");
            for &p in pending_blocks.keys() {
                place(p, "pending");
            }
            for (&p, h) in &st.handed_out {
                assert_eq!(p, h.block.ptr);
                place(p, "handed out");
            }
        }
        for (_, b) in slow.deferred.iter().chain(&slow.stranded) {
            place(b.ptr, "deferred or stranded");
        }
        let segments = inner.index.segments();
        let mut bytes = 0i64;
        for &(base, size, _) in &segments {
            bytes += size as i64;
            assert!(seen.contains_key(&(base as usize)), "block {base:#x} is nowhere");
        }
        for &p in seen.keys() {
            assert!(segments.iter().any(|s| s.0 as usize == p), "block {p:#x} is cached but not in the index");
        }
        assert_eq!(slow.allocations.current, segments.len() as i64, "allocations against blocks");
        assert_eq!(slow.allocated_bytes.current, bytes, "allocated_bytes against blocks");
        let active: i64 = stripes.iter().map(|s| s.active_requests.current).sum();
        let active_bytes: i64 = stripes.iter().map(|s| s.active_bytes.current).sum();
        assert_eq!(active, segments.len() as i64 - free_blocks, "active_requests against free blocks");
        assert_eq!(active_bytes, bytes - free_bytes, "active_bytes against free blocks");
    }
}

fn freed_already(ptr: HostPtr) -> Error {
    Error::InvalidPointer(format!("the pinned block at {ptr:#x} was freed already"))
}

impl Inner {
    /// The block that starts at `ptr`, for the operation `doing`.
    fn block_at(&self, ptr: HostPtr, doing: &str) -> Result<Arc<Block>, Error> {
        self.index.with_segment(ptr as u64, |e| match e {
            Some(e) if e.base == ptr as u64 => Ok(e.owner.clone()),
            Some(e) => Err(Error::InvalidPointer(format!(
                "cannot {doing} {ptr:#x}: it is inside the pinned block at {:#x} ({} bytes), not its start",
                e.base, e.size
            ))),
            None => Err(Error::InvalidPointer(format!(
                "cannot {doing} {ptr:#x}: it is not pinned host memory from gpupool_host_malloc"
            ))),
        })
    }

    /// Pops a free block of `class` from stripe `me` and hands it out.
    #[inline]
    fn take(&self, st: &mut Stripe, me: usize, class: usize) -> Option<HostPtr> {
        let b = st.free[class].pop()?;
        Some(self.hand_out(st, me, b))
    }

    /// Marks `b` allocated by stripe `me` (whose lock the caller holds) and counts it.
    #[inline]
    fn hand_out(&self, st: &mut Stripe, me: usize, b: Arc<Block>) -> HostPtr {
        b.home.store(me as u32, Ordering::Relaxed);
        st.active_requests.increase(1);
        st.active_bytes.increase(b.size as i64);
        let ptr = b.ptr;
        st.handed_out.insert(ptr, HandedOut { block: b, streams: Vec::new() });
        ptr
    }

    /// The stripe that handed out (or last handed out) the block at `ptr`, locked.
    ///
    /// Errors: as [`Inner::block_at`].
    fn home_of(&self, ptr: HostPtr, doing: &str) -> Result<(usize, parking_lot::MutexGuard<'_, Stripe>), Error> {
        let block = self.block_at(ptr, doing)?;
        let home = block.home.load(Ordering::Relaxed) as usize;
        Ok((home, self.stripes[home].0.lock()))
    }

    /// A freed block, with the streams that used it: back to its home stripe's free list, or
    /// into its event queue with one event per stream.
    fn give_back(&self, st: &mut Stripe, block: Arc<Block>, streams: Vec<(StreamHandle, i32)>) {
        if streams.is_empty() {
            return Self::to_free_list(st, block);
        }
        let mut recorded = 0;
        let mut stranded = Vec::new();
        for (stream, device) in streams {
            let ev = match st.idle_events.iter().rposition(|&(d, _)| d == device) {
                Some(i) => Ok(st.idle_events.swap_remove(i).1),
                None => self.driver.event_create(device),
            };
            let recorded_ok = ev.and_then(|ev| match self.driver.event_record(device, ev, stream) {
                Ok(()) => Ok(ev),
                Err(e) => {
                    st.idle_events.push((device, ev));
                    Err(e)
                }
            });
            match recorded_ok {
                Ok(ev) => {
                    st.pending.push_back(Pending { event: ev, device, block: block.clone() });
                    recorded += 1;
                }
                // No event: waiting for the whole device is as safe (PyTorch's free throws).
                Err(_) => {
                    if self.driver.device_synchronize(device).is_err() {
                        stranded.push(device);
                    }
                }
            }
        }
        if !stranded.is_empty() {
            // Events already recorded for this free are left to complete; the block waits
            // for `empty_cache` to synchronise the devices that failed.
            if recorded > 0 {
                let mut kept = Vec::new();
                st.pending.retain(|p| {
                    let mine = Arc::ptr_eq(&p.block, &block);
                    if mine {
                        kept.push((p.device, p.event));
                    }
                    !mine
                });
                stranded.extend(kept.iter().map(|&(d, _)| d));
                st.idle_events.extend(kept);
            }
            let mut slow = self.slow.lock();
            stranded.sort_unstable();
            stranded.dedup();
            slow.stranded.extend(stranded.into_iter().map(|d| (d, block.clone())));
            return;
        }
        if recorded == 0 {
            Self::to_free_list(st, block);
        } else {
            st.waiting.insert(block.ptr, recorded);
        }
    }

    /// A block becomes free in stripe `st`: it no longer counts as active.
    fn to_free_list(st: &mut Stripe, block: Arc<Block>) {
        st.active_requests.decrease(1);
        st.active_bytes.decrease(block.size as i64);
        let class = block.class;
        st.free[class].push(block);
    }

    /// Polls the pending events of stripe `s` (locked by the caller), oldest first: a block
    /// whose last event completed goes back to the free list. With `stop_at_busy` (the
    /// allocation path, PyTorch `process_events`), stops at the first event not completed;
    /// otherwise polls them all. Completed events are kept for reuse.
    ///
    /// Errors: [`Error::Cuda`] when a query fails (the event stays pending).
    fn process_events(&self, st: &mut Stripe, stop_at_busy: bool) -> Result<(), Error> {
        let mut i = 0;
        while i < st.pending.len() {
            let p = &st.pending[i];
            let done = self
                .driver
                .event_query(p.event)
                .map_err(|e| Error::driver_call(e, "polling the event of a freed pinned block"))?;
            if !done {
                if stop_at_busy {
                    return Ok(());
                }
                i += 1;
                continue;
            }
            let p = st.pending.remove(i).expect("in range");
            st.idle_events.push((p.device, p.event));
            let left = st.waiting.get_mut(&p.block.ptr).expect("a pending block is waiting");
            *left -= 1;
            if *left == 0 {
                st.waiting.remove(&p.block.ptr);
                Self::to_free_list(st, p.block);
            }
        }
        Ok(())
    }

    /// The device new pinned memory is allocated from: the one whose primary context is
    /// current, else the current device (PyTorch uses any device with a primary context,
    /// `getDeviceIndexWithPrimaryContext`; the memory is portable, so any works).
    fn alloc_device(&self) -> i32 {
        match self.driver.current_primary_device() {
            Ok(Some(d)) => d,
            _ => self.driver.current_device().unwrap_or(0),
        }
    }

    /// Pins `size` bytes as the configuration says; returns the memory and its origin, and
    /// counts the call.
    fn pin(&self, size: usize) -> Result<(HostPtr, Origin), Error> {
        let device = self.alloc_device();
        let start = Instant::now();
        let r = if self.backing.use_register {
            self.pin_registered(device, size).map(|p| (p, Origin::Registered { device }))
        } else {
            self.driver.host_alloc(device, size).map(|p| (p, Origin::HostAlloc { device }))
        };
        let (ptr, origin) = r.map_err(|e| match e {
            DriverError::OutOfMemory => Error::OutOfMemory(format!(
                "cannot pin {size} bytes of host memory: the host or the driver has no more page-locked memory \
                 (gpupool_host_empty_cache releases cached blocks)"
            )),
            e => Error::driver(e, &format!("pinning {size} bytes of host memory")),
        })?;
        let mut slow = self.slow.lock();
        slow.host_alloc_time.add(micros(start));
        slow.num_host_alloc += 1;
        Ok((ptr, origin))
    }

    /// `posix_memalign`, the pages touched, then `cuMemHostRegister` (PyTorch
    /// `allocWithCudaHostRegister`, which uses `malloc`; page alignment lets the driver lock
    /// exactly the block's pages).
    fn pin_registered(&self, device: i32, size: usize) -> Result<HostPtr, DriverError> {
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; PAGE is a power of two and a multiple of the pointer size.
        if unsafe { libc::posix_memalign(&mut p, PAGE, size) } != 0 || p.is_null() {
            return Err(DriverError::OutOfMemory);
        }
        let ptr = p as HostPtr;
        touch_pages(ptr, size, self.backing.register_threads);
        if let Err(e) = self.driver.host_register(device, ptr, size) {
            // SAFETY: memory from posix_memalign above, registered nowhere.
            unsafe { libc::free(p) };
            return Err(e);
        }
        Ok(ptr)
    }

    /// A new block of `rounded` bytes (PyTorch's slow path, `allocate_host_memory`): from the
    /// reserve segment while it has room, else newly pinned memory.
    fn new_block(&self, rounded: usize, class: usize) -> Result<Arc<Block>, Error> {
        let (ptr, origin) = match self.carve_reserve(rounded)? {
            Some(p) => (p, Origin::Reserve),
            None => self.pin(rounded)?,
        };
        let block = Arc::new(Block { ptr, size: rounded, class, origin, home: AtomicU32::new(0) });
        self.index.insert(SegmentEntry { base: ptr as u64, size: rounded, device: -1, owner: block.clone() });
        let mut slow = self.slow.lock();
        slow.allocations.increase(1);
        slow.allocated_bytes.increase(rounded as i64);
        Ok(block)
    }

    /// `rounded` bytes from the reserve segment (pinned at the first call, PyTorch
    /// `get_reserve_segment`), 4 KiB aligned; `None` without a reserve or when it is used up.
    fn carve_reserve(&self, rounded: usize) -> Result<Option<HostPtr>, Error> {
        let size = self.backing.reserve_size;
        if size == 0 {
            return Ok(None);
        }
        if self.slow.lock().reserve.is_none() {
            let (ptr, _) = self.pin(size)?;
            let mut slow = self.slow.lock();
            if slow.reserve.is_none() {
                slow.reserve = Some((ptr, size, 0));
            } else {
                // Another thread pinned it meanwhile: this one goes back.
                drop(slow);
                self.unpin(ptr, self.origin_now())?;
            }
        }
        let mut slow = self.slow.lock();
        let (start, total, used) = slow.reserve.as_mut().expect("pinned above");
        let take = rounded.next_multiple_of(PAGE);
        if *used + take > *total {
            return Ok(None);
        }
        let p = *start + *used;
        *used += take;
        Ok(Some(p))
    }

    /// The origin new memory has under the configuration, for memory pinned by [`Inner::pin`]
    /// and given back at once.
    fn origin_now(&self) -> Origin {
        let device = self.alloc_device();
        if self.backing.use_register { Origin::Registered { device } } else { Origin::HostAlloc { device } }
    }

    /// Gives pinned memory back the way it was pinned, and counts it.
    fn unpin(&self, ptr: HostPtr, origin: Origin) -> Result<(), Error> {
        let start = Instant::now();
        let r = match origin {
            Origin::HostAlloc { device } => self.driver.host_free(device, ptr),
            Origin::Registered { device } => self.driver.host_unregister(device, ptr).map(|()| {
                // SAFETY: memory from posix_memalign in pin_registered, now unregistered.
                unsafe { libc::free(ptr as *mut libc::c_void) }
            }),
            Origin::Reserve => return Ok(()),
        };
        r.map_err(|e| Error::driver_call(e, &format!("releasing the pinned host memory at {ptr:#x}")))?;
        let mut slow = self.slow.lock();
        slow.host_free_time.add(micros(start));
        slow.num_host_free += 1;
        Ok(())
    }

    /// Releases a free block taken out of its free list: out of the index first (its address
    /// may be pinned again at once), then back to the driver. A failed release puts it back.
    fn release(&self, block: Arc<Block>) -> Result<(), Error> {
        self.index.remove(block.ptr as u64);
        match self.unpin(block.ptr, block.origin) {
            Ok(()) => {
                let mut slow = self.slow.lock();
                slow.allocations.decrease(1);
                slow.allocated_bytes.decrease(block.size as i64);
                Ok(())
            }
            Err(e) => {
                self.index.insert(SegmentEntry {
                    base: block.ptr as u64,
                    size: block.size,
                    device: -1,
                    owner: block.clone(),
                });
                let home = block.home.load(Ordering::Relaxed) as usize;
                let mut st = self.stripes[home].0.lock();
                // Still free: it was counted free when it was taken for release.
                let class = block.class;
                st.free[class].push(block);
                Err(e)
            }
        }
    }

    /// Synchronises each device that deferred blocks wait for, and frees those blocks; returns
    /// how many were released.
    fn release_deferred(&self) -> Result<usize, Error> {
        let waiting = {
            let mut slow = self.slow.lock();
            slow.deferred_bytes = 0;
            std::mem::take(&mut slow.deferred)
        };
        if waiting.is_empty() {
            return Ok(0);
        }
        let mut devices: Vec<i32> = waiting.iter().map(|&(d, _)| d).collect();
        devices.sort_unstable();
        devices.dedup();
        for &d in &devices {
            if let Err(e) = self.driver.device_synchronize(d) {
                let mut slow = self.slow.lock();
                slow.deferred_bytes += waiting.iter().map(|(_, b)| b.size).sum::<usize>();
                slow.deferred.extend(waiting);
                return Err(Error::driver_call(e, &format!("synchronising device {d} for freed pinned blocks")));
            }
        }
        let n = waiting.len();
        {
            let mut slow = self.slow.lock();
            slow.deferred_syncs += devices.len() as u64;
            slow.deferred_released += n as u64;
        }
        for (_, b) in waiting {
            let home = b.home.load(Ordering::Relaxed) as usize;
            Self::to_free_list(&mut self.stripes[home].0.lock(), b);
        }
        Ok(n)
    }

    /// Synchronises the devices stranded blocks wait for, and frees those blocks.
    fn release_stranded(&self) -> Result<(), Error> {
        let stranded = std::mem::take(&mut self.slow.lock().stranded);
        let mut devices: Vec<i32> = stranded.iter().map(|&(d, _)| d).collect();
        devices.sort_unstable();
        devices.dedup();
        for &d in &devices {
            if let Err(e) = self.driver.device_synchronize(d) {
                self.slow.lock().stranded.extend(stranded);
                return Err(Error::driver_call(e, &format!("synchronising device {d} for freed pinned blocks")));
            }
        }
        // A block stranded on several devices appears once per device.
        let mut done = rustc_hash::FxHashSet::default();
        for (_, b) in stranded {
            if done.insert(b.ptr) {
                let home = b.home.load(Ordering::Relaxed) as usize;
                Self::to_free_list(&mut self.stripes[home].0.lock(), b);
            }
        }
        Ok(())
    }
}

/// The background thread of `pinned_use_background_threads`: polls every stripe's events
/// every 100 µs (PyTorch's loop in `allocate`), until the allocator is dropped. Stripes busy
/// with their own thread are skipped for that round.
fn start_background(inner: Weak<Inner>) {
    let spawned = std::thread::Builder::new().name("gpupool-host-events".into()).spawn(move || {
        loop {
            let Some(inner) = inner.upgrade() else { return };
            if fork::check().is_err() {
                return;
            }
            for stripe in inner.stripes.iter() {
                if let Some(mut st) = stripe.0.try_lock()
                    && !st.pending.is_empty()
                {
                    // A failed query leaves the event pending; the next round tries again.
                    let _ = inner.process_events(&mut st, false);
                }
            }
            drop(inner);
            std::thread::sleep(BACKGROUND_PERIOD);
        }
    });
    // Without the thread, events are still polled at every miss: nothing is lost but speed.
    drop(spawned);
}

impl Drop for Inner {
    /// Gives every cached block's memory back, and the events kept for reuse. Blocks still
    /// handed out, or waiting for events, are left pinned: work may still use them.
    fn drop(&mut self) {
        if fork::check().is_err() {
            return;
        }
        let mut blocks = Vec::new();
        for stripe in self.stripes.iter() {
            let mut st = stripe.0.lock();
            for list in st.free.iter_mut() {
                blocks.append(list);
            }
            for (device, ev) in st.idle_events.drain(..) {
                self.driver.event_destroy(device, ev);
            }
        }
        for b in blocks {
            let _ = self.unpin(b.ptr, b.origin);
        }
        if let Some((ptr, _, _)) = self.slow.get_mut().reserve {
            let _ = self.unpin(ptr, self.origin_now());
        }
    }
}

/// The process-wide host allocator, over the process-wide allocator's driver and
/// configuration (the C API and the LD_PRELOAD shim share it).
pub(crate) fn process_host(allocator: &crate::Allocator) -> &'static HostAllocator {
    static HOST: OnceLock<HostAllocator> = OnceLock::new();
    HOST.get_or_init(|| HostAllocator::new(allocator.driver().clone(), &allocator.config()))
}
