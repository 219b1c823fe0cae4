//! The allocator over every device: the Rust API that the C boundary wraps.

use std::cell::RefCell;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;

use super::deferred::DeferredStats;
use super::device::{DeviceAllocator, PoolStats, RouteFilter, RouteTo};
use super::observers::{OomEvent, OomObserverId, OomObservers};
use super::segment_index::SegmentIndex;
use super::shard::Shard;
use crate::config::{Config, DriverKind};
use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::Error;
use crate::history::{AllocatorSettings, HistoryHook, HistorySettings, Recorder, Snapshot, TagStats, tags};
use crate::stats::DeviceStats;
use crate::stats::summary::memory_summary;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// The next private pool id: ids are process-wide (one id names the pool on every device and
/// in every allocator), never 0 (the default pools).
static NEXT_POOL: AtomicU64 = AtomicU64::new(1);

/// An allocated block, as [`Allocator::block_info`] describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// The device ordinal.
    pub device: i32,
    /// The stream it was allocated for.
    pub stream: StreamHandle,
    /// Bytes, rounded as `allocated_bytes` counts them.
    pub size: usize,
}

/// A caching allocator over every device of one driver (PyTorch `NativeCachingAllocator`).
///
/// Thread-safe: every method may be called from any thread. Calls on different streams take
/// different locks; see the crate's README for the design.
pub struct Allocator {
    id: u64,
    driver: Arc<dyn Driver>,
    /// Read without a lock ([`Allocator::config`], the LD_PRELOAD shim's frees); replaced only
    /// by [`Allocator::set_config`], before any device starts.
    config: ArcSwap<Config>,
    /// Held while a device starts and while the configuration is replaced, so that no device
    /// starts with a configuration that `set_config` is replacing, nor after it was refused.
    starting: Mutex<()>,
    index: Arc<SegmentIndex<Arc<Shard>>>,
    devices: Box<[OnceLock<DeviceAllocator>]>,
    /// Shared with every device, which calls them when a request fails.
    observers: Arc<OomObservers>,
    /// The allocation history of every device.
    recorder: Arc<Recorder>,
}

/// The configuration an [`Allocator`] holds, as [`Allocator::config`] lends it: a snapshot
/// that reads as a [`Config`]. Cheap to take (no lock, no reference count shared between
/// threads); keep it briefly.
pub struct ConfigRef(Guard<Arc<Config>>);

impl Deref for ConfigRef {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.0
    }
}

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
    /// An allocator over `driver` with the allocation options of `config`, recording its
    /// history from the start if `config.record_history` says so. `config.driver` and the
    /// `sim_*` fields are not used here (they choose the driver in [`Allocator::from_config`]).
    pub fn new(driver: Arc<dyn Driver>, config: Config) -> Allocator {
        let count = driver.device_count().max(0) as usize;
        super::fork::watch();
        let recorder = Arc::new(Recorder::new(count));
        recorder.set(config.record_history);
        Allocator {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            driver,
            config: ArcSwap::from_pointee(config),
            starting: Mutex::new(()),
            index: Arc::new(SegmentIndex::default()),
            devices: (0..count).map(|_| OnceLock::new()).collect(),
            observers: Arc::default(),
            recorder,
        }
    }

    /// An allocator over the driver `config` names. Also returns the simulated driver when that
    /// is the one chosen, so tests and the C API can control it.
    ///
    /// Errors: [`Error::DriverUnavailable`] when the CUDA driver or a device is missing.
    pub fn from_config(config: Config) -> Result<(Allocator, Option<Arc<SimDriver>>), Error> {
        match config.driver {
            DriverKind::Sim => {
                let sim = Arc::new(SimDriver::new(config.sim_devices, config.sim_capacity));
                Ok((Allocator::new(sim.clone(), config), Some(sim)))
            }
            DriverKind::Cuda => {
                let cuda = CudaDriver::new().map_err(|e| Error::driver(e, "starting the CUDA driver"))?;
                Ok((Allocator::new(Arc::new(cuda), config), None))
            }
        }
    }

    /// The driver this allocator uses.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// Its options: those it was made with, or the last [`Allocator::set_config`] (the
    /// process-wide allocator's: every `GPUPOOL_*` option, as the LD_PRELOAD shim reads them).
    pub fn config(&self) -> ConfigRef {
        ConfigRef(self.config.load())
    }

    /// Its `GPUPOOL_CONF` settings in PyTorch's syntax, every key with its value
    /// ([`Config::conf_string`]); [`Config::with_conf`] and `gpupool_set_config` read it back.
    pub fn config_string(&self) -> String {
        self.config().conf_string()
    }

    /// Replaces its options with `config`, as long as no device has started (but
    /// `config.record_history`: [`Allocator::record_history`] turns the history on and off): a device starts
    /// at the first call that names it (or names -1 and it is current): an allocation, but
    /// also `stats`, `memory_summary`, `empty_cache`, `set_memory_fraction` and the like,
    /// which read or change its state. `device_count`, `config` and `owns` start none. The
    /// devices then start with `config`'s size rules and `per_process_memory_fraction`.
    /// `config.driver` and the `sim_*` fields are not used (the driver is chosen already). Like
    /// PyTorch, whose allocator settings apply to devices not yet initialised, and whose
    /// `max_split_size`, say, cannot change under blocks already cut by it.
    ///
    /// Errors: [`Error::InvalidValue`] once a device has started, naming it; nothing changes.
    pub fn set_config(&self, config: Config) -> Result<(), Error> {
        let _starting = self.starting.lock();
        if let Some(d) = self.devices.iter().position(|d| d.get().is_some()) {
            return Err(Error::InvalidValue(format!(
                "the configuration must be set before the first allocation: device {d} has started already (a call \
                 named it), and keeps the configuration it started with"
            )));
        }
        self.config.store(Arc::new(config));
        Ok(())
    }

    /// Number of devices.
    pub fn device_count(&self) -> i32 {
        self.devices.len() as i32
    }

    /// The device `device` names (-1: the calling thread's current one), started on first use.
    fn device_or_init(&self, device: i32) -> Result<&DeviceAllocator, Error> {
        super::fork::check()?;
        let d = if device == -1 {
            self.driver.current_device().map_err(|e| Error::driver(e, "reading the current device"))?
        } else {
            device
        };
        let slot = usize::try_from(d).ok().and_then(|i| self.devices.get(i)).ok_or_else(|| {
            Error::InvalidValue(format!(
                "device {device} is out of range: the {} driver has {} device(s); pass -1 for the current device",
                self.driver.name(),
                self.devices.len()
            ))
        })?;
        match slot.get() {
            Some(dev) => Ok(dev),
            None => self.start_device(d, slot),
        }
    }

    /// Starts device `d` with the configuration in force: its size rules, and its
    /// `per_process_memory_fraction` applied as [`Allocator::set_memory_fraction`] would (PyTorch
    /// applies the key when a device's allocator is created).
    ///
    /// Errors: [`Error::Cuda`] when the fraction is set and the device's total cannot be read;
    /// the device is then not started.
    #[cold]
    fn start_device<'a>(&self, d: i32, slot: &'a OnceLock<DeviceAllocator>) -> Result<&'a DeviceAllocator, Error> {
        let _starting = self.starting.lock();
        if let Some(dev) = slot.get() {
            return Ok(dev);
        }
        let config = self.config.load();
        let dev = DeviceAllocator::new(
            d,
            self.driver.clone(),
            self.index.clone(),
            &config,
            self.observers.clone(),
            HistoryHook::new(self.recorder.clone(), d as usize),
        );
        if config.per_process_memory_fraction < 1.0 {
            dev.set_memory_fraction(config.per_process_memory_fraction)?;
        }
        Ok(slot.get_or_init(|| dev))
    }

    #[inline]
    /// Calls `f` with the shard of `stream` and whether this thread used it lately (it was in
    /// the thread's cache of recent shards: the stream is hot here, see `peaks`). On a hit the
    /// cache is lent to `f`, read-only, for the whole call, which may come back here (an
    /// out-of-memory observer runs inside `f`).
    fn with_shard<R>(&self, dev: &DeviceAllocator, stream: StreamHandle, f: impl FnOnce(&Arc<Shard>, bool) -> R) -> R {
        let mut f = Some(f);
        // The hit: this thread used the shard lately; call in place, with no reference count
        // taken (two atomic operations saved).
        let hit = SHARD_CACHE.try_with(|cache| {
            let cache = cache.borrow();
            let slot = cache
                .slots
                .iter()
                .flatten()
                .find(|c| c.allocator == self.id && c.device == dev.device && c.stream == stream)?;
            // A retired shard (see `shard_table`) is refetched below, and replaces this slot.
            if slot.shard.is_retired() {
                return None;
            }
            Some((f.take().expect("called once"))(&slot.shard, true))
        });
        if let Ok(Some(r)) = hit {
            return r;
        }
        let shard = dev.shard_or_create(stream);
        self.remember_shard(dev.device, stream, &shard);
        (f.take().expect("called once"))(&shard, false)
    }

    /// Puts `shard` in the calling thread's cache of recent shards, in place of its stale entry
    /// or the oldest. Out of line: inlined, it costs the hit path an instruction per call
    /// (callgrind, `examples/hit_loop`).
    #[inline(never)]
    fn remember_shard(&self, device: i32, stream: StreamHandle, shard: &Arc<Shard>) {
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
        self.with_shard(dev, stream, |shard, hot| dev.malloc(shard, size, hot))
    }

    /// A new private pool (PyTorch `graph_pool_handle()` / `MemPool()`): its id, never 0 (the
    /// default pools). Ids are process-wide; the pool's memory is per device, made on the
    /// devices whose allocations are routed to it. Takes no lock and no memory.
    pub fn pool_create(&self) -> u64 {
        NEXT_POOL.fetch_add(1, Ordering::Relaxed)
    }

    /// `pool` names a pool made by [`Allocator::pool_create`].
    fn check_pool(pool: u64) -> Result<(), Error> {
        if pool == 0 {
            return Err(Error::InvalidValue(
                "pool 0 names the default pools, which are not a private pool: create one with gpupool_pool_create"
                    .into(),
            ));
        }
        if pool >= NEXT_POOL.load(Ordering::Relaxed) {
            return Err(Error::InvalidValue(format!(
                "pool {pool} was never created (gpupool_pool_create makes pools)"
            )));
        }
        Ok(())
    }

    /// Routes the allocations on `stream` of `device` (-1: current), from any thread, to
    /// `pool` until [`Allocator::end_allocate_to_pool`] (PyTorch `beginAllocateToPool` with
    /// `torch.cuda.graph`'s capture stream). See `device::pools` for the rules.
    ///
    /// Errors: [`Error::InvalidValue`], nothing changed: pool 0, a pool never created, a pool
    /// released on the device, a stream routed already, a device out of range.
    pub fn begin_allocate_to_pool(&self, device: i32, pool: u64, stream: StreamHandle) -> Result<(), Error> {
        Self::check_pool(pool)?;
        self.device_or_init(device)?.begin_route(pool, RouteTo::Stream(stream))
    }

    /// Routes the allocations the calling thread makes on `device` (any stream) to `pool`
    /// (PyTorch `torch.cuda.use_mem_pool`).
    ///
    /// Errors: as [`Allocator::begin_allocate_to_pool`]; the thread routed already.
    pub fn begin_allocate_to_pool_thread(&self, device: i32, pool: u64) -> Result<(), Error> {
        Self::check_pool(pool)?;
        self.device_or_init(device)?.begin_route(pool, RouteTo::Thread(std::thread::current().id()))
    }

    /// Routes the allocations on `device` on the streams for which `filter` is true to `pool`
    /// (PyTorch `beginAllocateToPool(device, mempool_id, filter)`). `filter` is called only on
    /// allocations made while some route is active on the device, from the allocating thread,
    /// with no lock of gpupool's held.
    ///
    /// Errors: as [`Allocator::begin_allocate_to_pool`] (no conflict is checked: filters may
    /// overlap; the route begun first takes an allocation).
    pub fn begin_allocate_to_pool_filter(
        &self,
        device: i32,
        pool: u64,
        filter: impl Fn(StreamHandle) -> bool + Send + Sync + 'static,
    ) -> Result<(), Error> {
        Self::check_pool(pool)?;
        let filter: RouteFilter = Arc::new(filter);
        self.device_or_init(device)?.begin_route(pool, RouteTo::Filter(filter))
    }

    /// Ends every route to `pool` on `device` (PyTorch `endAllocateToPool`). Blocks freed
    /// during captures get their events once no route is left on the device.
    ///
    /// Errors: [`Error::InvalidValue`]: pool 0, never created, no route to it on the device.
    pub fn end_allocate_to_pool(&self, device: i32, pool: u64) -> Result<(), Error> {
        Self::check_pool(pool)?;
        self.device_or_init(device)?.end_routes(pool)
    }

    /// Releases `pool` on `device` (PyTorch `releasePool`): the graphs that used it are gone,
    /// or the capture failed. Its routes end; its wholly free segments go back to the driver
    /// now, the others as their last block is freed, even if blocks are still allocated; its
    /// cached blocks are never reused and its id is refused for new routes on the device.
    ///
    /// Errors: [`Error::InvalidValue`]: pool 0, never created, released already on the device.
    pub fn release_pool(&self, device: i32, pool: u64) -> Result<(), Error> {
        Self::check_pool(pool)?;
        self.device_or_init(device)?.release_pool(pool)
    }

    /// The statistics of `pool` on `device` (zero where it was never used). The device's
    /// [`Allocator::stats`] include every pool.
    ///
    /// Errors: [`Error::InvalidValue`]: pool 0, never created, device out of range.
    pub fn pool_stats(&self, device: i32, pool: u64) -> Result<PoolStats, Error> {
        Self::check_pool(pool)?;
        Ok(self.device_or_init(device)?.pool_stats(pool))
    }

    /// The statistics of every private pool routed to on `device`, by id.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range).
    pub fn all_pool_stats(&self, device: i32) -> Result<Vec<PoolStats>, Error> {
        Ok(self.device_or_init(device)?.all_pool_stats())
    }

    /// Attaches `observer`, called when a request fails for lack of memory on any device of
    /// this allocator (PyTorch `attachOutOfMemoryObserver`): after gpupool released its cache
    /// and retried, before [`Error::OutOfMemory`] returns, on the thread whose request failed,
    /// with no lock of gpupool's held, so that it may call any method of the allocator (free
    /// memory, read statistics, empty the cache, allocate). Several observers are called in
    /// the order attached, each with the same [`OomEvent`] (statistics read once, `num_ooms`
    /// counting this request).
    ///
    /// The observer returns true to ask for one more attempt (as the callback of RMM's
    /// `failure_callback_resource_adaptor` does): once every observer has run, if any asked,
    /// the allocation is tried once more, release-and-retry included; if that fails too, the
    /// observers are not called again and the error returns (its message read after the last
    /// attempt). A request made from inside an observer that fails calls no observer.
    ///
    /// A panic in the observer is caught (the panic hook reports it): it then asks for
    /// nothing, and the next observers still run. Returns the id that
    /// [`Allocator::detach_oom_observer`] takes.
    ///
    /// Thread-safe: attach and detach from any thread while others allocate; nothing of this
    /// runs on the hit path, only once a request has failed.
    pub fn attach_oom_observer(
        &self,
        observer: impl Fn(&OomEvent<'_>) -> bool + Send + Sync + 'static,
    ) -> OomObserverId {
        self.observers.attach(Box::new(observer))
    }

    /// Detaches the observer `id`; returns false when it is not attached (never was, or
    /// detached already). Called from outside any observer, it returns once no call of the
    /// observer is under way on any thread, and none starts after: what the observer uses may
    /// then be dropped (the caller must not hold a lock that the observer takes, or the two
    /// would wait for each other). Called from inside an observer (its own or another's), it
    /// returns at once: a call on another thread may still be running.
    pub fn detach_oom_observer(&self, id: OomObserverId) -> bool {
        self.observers.detach(id)
    }

    /// Frees a pointer from [`Allocator::malloc`] (PyTorch `raw_delete`). 0 is a no-op.
    ///
    /// Errors: [`Error::InvalidPointer`] (not from gpupool, interior, double free), leaving
    /// every pool as it was. If an event for a `record_stream` stream cannot be created or
    /// recorded, the block waits for the next device synchronisation instead (see
    /// [`Allocator::free_after_device_sync`]) and the free succeeds.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), Error> {
        if ptr == 0 {
            return Ok(());
        }
        self.index.with_segment(ptr, |seg| match seg {
            None => Err(not_allocated(ptr)),
            Some(e) => self.used_device(e.device)?.free(&e.owner, ptr, e.base),
        })
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

    /// Synchronises `device` (-1: every device in use) if blocks freed with
    /// [`Allocator::free_after_device_sync`] await it, and returns them to their pools. Returns
    /// how many were released. Blocks the calling thread until the device is idle.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`] (the
    /// synchronisation failed; the blocks stay deferred).
    pub fn release_deferred(&self, device: i32) -> Result<usize, Error> {
        super::fork::check()?;
        if device == -1 {
            let mut n = 0;
            for dev in self.devices.iter().filter_map(|d| d.get()) {
                n += dev.release_deferred()?;
            }
            return Ok(n);
        }
        self.device_or_init(device)?.release_deferred()
    }

    /// What awaits a device synchronisation on `device`, and what synchronisations released so
    /// far. For a device ordinal (not -1) it reads counters only, with no driver call, so it is
    /// safe at process exit.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range).
    pub fn deferred(&self, device: i32) -> Result<DeferredStats, Error> {
        Ok(self.device_or_init(device)?.deferred())
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

    /// The device of a segment: started already, since it has segments.
    fn used_device(&self, device: i32) -> Result<&DeviceAllocator, Error> {
        super::fork::check()?;
        self.devices[device as usize]
            .get()
            .ok_or_else(|| Error::Internal(format!("a segment names device {device}, which was never used")))
    }

    /// Returns every wholly free cached segment to the driver, after waiting for all pending
    /// events (PyTorch `emptyCache`). `device` -1: every device in use.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`].
    pub fn empty_cache(&self, device: i32) -> Result<(), Error> {
        super::fork::check()?;
        if device == -1 {
            for dev in self.devices.iter().filter_map(|d| d.get()) {
                dev.release_cached_blocks()?;
            }
            return Ok(());
        }
        self.device_or_init(device)?.release_cached_blocks()
    }

    /// The statistics of `device` (-1: current), as `torch.cuda.memory_stats` reports them:
    /// one snapshot taken with every lock of the device held briefly.
    ///
    /// Errors: [`Error::InvalidValue`] (device out of range), [`Error::Cuda`] (reading the
    /// current device for -1).
    pub fn stats(&self, device: i32) -> Result<DeviceStats, Error> {
        Ok(self.device_or_init(device)?.stats())
    }

    /// Limits `device` (-1: current) to reserving at most `fraction` of its total memory
    /// (PyTorch `torch.cuda.set_per_process_memory_fraction` / `setMemoryFraction`). A
    /// segment that would pass the limit is treated as out of memory: gpupool releases its
    /// cache and retries as for a full device, then fails with the out-of-memory error.
    /// Segments already reserved stay. 1.0 allows the whole device.
    ///
    /// Errors: [`Error::InvalidValue`] (`fraction` not within 0 to 1, device out of range),
    /// [`Error::Cuda`] (the device's total cannot be read).
    pub fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidValue(format!(
                "memory fraction {fraction} is not valid: expected a value from 0 to 1"
            )));
        }
        self.device_or_init(device)?.set_memory_fraction(fraction)
    }

    /// Whether `ptr` lies in a segment of this allocator (allocated, cached or awaiting
    /// events). Lock-free; for a program that receives pointers from several allocators and
    /// must send each back to the one it came from (the LD_PRELOAD shim).
    pub fn owns(&self, ptr: DevicePtr) -> bool {
        self.index.with_segment(ptr, |seg| seg.is_some())
    }

    /// Where the allocated block at `ptr` is: its device, the stream it was allocated for and
    /// its size in bytes (rounded, as `allocated_bytes` counts it). `None` when `ptr` is not
    /// the start of an allocated block (never allocated, freed, or inside a block). Takes the
    /// block's shard lock.
    pub fn block_info(&self, ptr: DevicePtr) -> Option<BlockInfo> {
        super::fork::check().ok()?;
        self.index.with_segment(ptr, |seg| {
            let e = seg?;
            let size = e.owner.lock().allocated_size(ptr)?;
            Some(BlockInfo { device: e.device, stream: e.owner.stream, size })
        })
    }

    /// Sets every peak of `device` (-1: current) to its current value (PyTorch
    /// `reset_peak_memory_stats`).
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn reset_peak_stats(&self, device: i32) -> Result<(), Error> {
        self.device_or_init(device)?.reset_peak_stats();
        Ok(())
    }

    /// How many calls on `device` had to lock every stream's shard to settle the peak
    /// statistics (see `src/caching/peaks.rs`): a diagnostic of the cost of exact peaks, not a
    /// PyTorch statistic. In a steady state it stays flat.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn peak_settles(&self, device: i32) -> Result<i64, Error> {
        Ok(self.device_or_init(device)?.peak_settles())
    }

    /// How many streams of `device` have state in gpupool: those holding memory (blocks,
    /// cached segments, events) and those used since the last `empty_cache`, which reclaims
    /// the state of streams that hold nothing. A diagnostic, not a PyTorch statistic.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn stream_count(&self, device: i32) -> Result<usize, Error> {
        Ok(self.device_or_init(device)?.shard_count())
    }

    /// Size bins, empty or not, in the pools of every stream of `device`: the host memory the
    /// free lists take. For tests that it follows the blocks cached, not every size ever seen.
    ///
    /// Errors: as [`Allocator::stats`].
    #[doc(hidden)]
    pub fn pool_bins(&self, device: i32) -> Result<usize, Error> {
        Ok(self.device_or_init(device)?.pool_bins())
    }

    /// The table of `torch.cuda.memory_summary` for `device` (-1: current), one line a row,
    /// sizes in PyTorch's units (B, KiB, MiB, GiB).
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn memory_summary(&self, device: i32) -> Result<String, Error> {
        let dev = self.device_or_init(device)?;
        let mut text = memory_summary(dev.device, self.driver.name(), &dev.stats());
        text.push_str(&crate::stats::summary::pools_summary(&dev.all_pool_stats()));
        Ok(text)
    }

    /// Starts, changes or stops the allocation history of every device (PyTorch
    /// `torch.cuda.memory._record_memory_history`): with `Some(settings)`, each device keeps
    /// its newest `settings.max_entries` events (alloc, frees, segments, maps and unmaps,
    /// out-of-memory, snapshots) and the call stacks `settings.context` asks for; a trace
    /// recorded already keeps its newest events up to the new limit. `None` stops recording and
    /// forgets every trace. When stacks stop being kept (`None`, or a context below
    /// [`HistoryContext::State`](crate::history::HistoryContext::State)), the live blocks
    /// forget theirs too.
    ///
    /// Costs, while off, one relaxed load per malloc and free; while on, see the README
    /// (section "History and snapshots"). Calls that race with this one record with the old
    /// settings or the new ones.
    ///
    /// Errors: [`Error::DriverUnavailable`] in a process forked from one that used gpupool.
    pub fn record_history(&self, settings: Option<HistorySettings>) -> Result<(), Error> {
        super::fork::check()?;
        let _starting = self.starting.lock();
        let level = self.recorder.set(settings);
        for dev in self.devices.iter().filter_map(|d| d.get()) {
            dev.set_history_level(level);
        }
        Ok(())
    }

    /// What the history records now; `None` when it is off.
    pub fn history(&self) -> Option<HistorySettings> {
        self.recorder.settings()
    }

    /// Every segment of every device in use, with its blocks, and each device's trace
    /// (PyTorch `torch.cuda.memory._snapshot()`); [`Snapshot::to_pickle`] writes PyTorch's
    /// file. Each device is taken with all its streams locked, as one consistent state; while
    /// history is on, its trace ends with the `snapshot` event this call records. Stacks are
    /// symbolised here, after the locks are released (the first time, reading the debug
    /// information of every library in them can take seconds). Works with history off too:
    /// the segments, no trace, no stacks.
    ///
    /// Errors: [`Error::DriverUnavailable`] in a process forked from one that used gpupool.
    pub fn snapshot(&self) -> Result<Snapshot, Error> {
        super::fork::check()?;
        let mut segments = Vec::new();
        let mut traces = vec![Vec::new(); self.devices.len()];
        for (trace, dev) in traces.iter_mut().zip(self.devices.iter()) {
            if let Some(dev) = dev.get() {
                *trace = dev.snapshot_into(&mut segments);
            }
        }
        let c = self.config();
        let settings = AllocatorSettings {
            conf: c.conf_string(),
            max_split_size: c.max_split_size,
            garbage_collection_threshold: c.garbage_collection_threshold,
            expandable_segments: c.expandable_segments,
            pinned_num_register_threads: c.pinned_num_register_threads,
            release_lock_on_cudamalloc: c.release_lock_on_cudamalloc,
            pinned_use_cuda_host_register: c.pinned_use_cuda_host_register,
            roundup_power2_divisions: c.roundup_power2_divisions.to_vec(),
        };
        Ok(Snapshot::assemble(&self.recorder.contexts, segments, traces, settings))
    }

    /// The statistics of the blocks allocated under tag `name` (see [`crate::history::tags`]),
    /// over every device: bytes (rounded, as `allocated_bytes`) and blocks, each current, peak,
    /// allocated and freed. A block freed on another thread, or under another tag, counts to
    /// the tag it was allocated under. Lock-free but for a read lock; the figures of a block
    /// allocated or freed meanwhile may show in some and not yet in others.
    ///
    /// Errors: [`Error::InvalidValue`] when no thread of the process ever pushed `name`.
    pub fn tag_stats(&self, name: &str) -> Result<TagStats, Error> {
        let id = tags::id_of(name)
            .ok_or_else(|| Error::InvalidValue(format!("no tag named {name:?} was ever pushed in this process")))?;
        Ok(self.recorder.tags.get(id))
    }

    /// Every tag pushed in the process, in the order first pushed, with its statistics on this
    /// allocator (as [`Allocator::tag_stats`]; zero where none of its blocks were allocated
    /// here).
    pub fn all_tag_stats(&self) -> Vec<(Arc<str>, TagStats)> {
        tags::names().into_iter().enumerate().map(|(i, n)| (n, self.recorder.tags.get(i as u32 + 1))).collect()
    }

    /// The live report of `device` (-1: current): its allocated blocks grouped by tag, then
    /// by the call stack that allocated them (where history kept stacks, with
    /// [`HistoryContext::State`](crate::history::HistoryContext::State) or more, when they
    /// were allocated), largest first (bytes, then blocks), one line a row. Stacks are
    /// symbolised here (the first time, reading debug information can take seconds). Each
    /// stream is read under its lock in turn: allocations on other streams go on meanwhile.
    ///
    /// Errors: as [`Allocator::stats`].
    pub fn live_report(&self, device: i32) -> Result<String, Error> {
        let dev = self.device_or_init(device)?;
        Ok(crate::history::live_report(dev.device, &self.recorder.contexts, &dev.live_blocks()))
    }

    /// The ordinals of the devices this allocator has started (used), in order.
    pub fn devices_in_use(&self) -> Vec<i32> {
        self.devices.iter().enumerate().filter(|(_, d)| d.get().is_some()).map(|(i, _)| i as i32).collect()
    }

    /// Checks every invariant of every device, for tests: each segment's blocks cover it
    /// exactly and in order, free neighbours are coalesced, each free block is in its pool
    /// once, the live map holds exactly the allocated blocks, pending events match the blocks
    /// awaiting them, each statistic equals a recount, the peak credit adds up, no two
    /// segments overlap, each tag's current figures are its live blocks', and the private
    /// pools agree with their routes (counted routes, none to a released pool, each pool
    /// shard's release state, segments kept for a graph only in live pools, never expandable,
    /// blocks deferred until no capture listed as such). Takes every
    /// lock; O(blocks). Call it while no other thread allocates or frees.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut end = 0;
        let mut per_device = vec![0i64; self.devices.len()];
        for (base, size, device) in self.index.segments() {
            if base < end {
                return Err(format!("segment {base:#x} overlaps the one before it"));
            }
            end = base + size as u64;
            per_device[device as usize] += 1;
        }
        for (i, dev) in self.devices.iter().enumerate() {
            if let Some(dev) = dev.get() {
                dev.check()?;
                let segments = dev.stats().segment.all.current;
                if segments != per_device[i] {
                    return Err(format!("device {i}: {segments} segments counted, {} indexed", per_device[i]));
                }
            } else if per_device[i] != 0 {
                return Err(format!("device {i} was never used but has segments"));
            }
        }
        self.check_tags()
    }

    /// Each tag's current bytes and blocks equal those of the allocated blocks that carry it.
    fn check_tags(&self) -> Result<(), String> {
        let mut live: std::collections::BTreeMap<u32, (i64, i64)> = Default::default();
        for dev in self.devices.iter().filter_map(|d| d.get()) {
            for (ctx, size) in dev.live_blocks() {
                let e = live.entry(self.recorder.contexts.tag_of(ctx)).or_default();
                e.0 += size as i64;
                e.1 += 1;
            }
        }
        for (i, (name, s)) in self.all_tag_stats().into_iter().enumerate() {
            let (bytes, blocks) = live.get(&(i as u32 + 1)).copied().unwrap_or_default();
            if (s.bytes.current, s.blocks.current) != (bytes, blocks) {
                return Err(format!(
                    "tag {name:?} counts {} bytes in {} blocks; its live blocks hold {bytes} in {blocks}",
                    s.bytes.current, s.blocks.current
                ));
            }
        }
        Ok(())
    }
}

fn not_allocated(ptr: DevicePtr) -> Error {
    Error::InvalidPointer(format!("pointer {ptr:#x} was not allocated by gpupool"))
}
