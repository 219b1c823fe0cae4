//! The allocator over every device: the Rust API that the C boundary wraps.
//!
//! Here: the allocator, its configuration, its table of devices (each started on first use),
//! the out-of-memory observers and the lookups of a pointer. The rest by mechanism:
//! - `hit`: malloc, free and `record_stream`, and each thread's cache of recent shards, whose
//!   marker after a miss is in `hit_marker` (its tests in `hit_marker_tests`), the shard of
//!   the last indexed free in `hit_freed`, the index's snapshot the thread keeps in `hit_index`;
//! - `pools`: private pools and the routes to them;
//! - `empty_cache`: `empty_cache`, the deferred frees' synchronisation, the memory fraction;
//! - `caching::sleep::allocator`, in sleep's folder: sleep and wake of a pool;
//! - `caching::accounting::allocator`, in the statistics' folder: the statistics, the summary
//!   and gpupool's diagnostics;
//! - `caching::largest::allocator`, in the largest request's folder: the largest request a
//!   stream would be served now (`gpupool_largest_allocatable`);
//! - `caching::history::allocator`, in the history's folder: the allocation history,
//!   snapshots, tags and the live report;
//! - `caching::ipc::allocator`, in IPC's folder: blocks shared with other processes
//!   (`gpupool_ipc_*`);
//! - `check_segments`: the consistency check, for tests.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;

use super::device::DeviceAllocator;
use super::observers::out_of_memory::{OomEvent, OomObserverId, OomObservers};
use super::observers::segments::{SegmentEvent, SegmentObserverId, SegmentObservers};
use super::segment_index::SegmentIndex;
use super::shard::Shard;
use crate::config::{Config, DriverKind};
use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::Error;
use crate::history::{HistoryHook, Recorder};

mod check_segments;
mod empty_cache;
mod hit;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

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
/// different locks; docs/layout.md maps the design onto the source.
pub struct Allocator {
    pub(in crate::caching) id: u64,
    pub(in crate::caching) driver: Arc<dyn Driver>,
    /// Read without a lock ([`Allocator::config`], the LD_PRELOAD shim's frees); replaced only
    /// by [`Allocator::set_config`], before any device starts.
    config: ArcSwap<Config>,
    /// Held while a device starts and while the configuration is replaced, so that no device
    /// starts with a configuration that `set_config` is replacing, nor after it was refused.
    pub(in crate::caching) starting: Mutex<()>,
    pub(in crate::caching) index: Arc<SegmentIndex<Arc<Shard>>>,
    pub(in crate::caching) devices: Box<[OnceLock<DeviceAllocator>]>,
    /// Shared with every device, which calls them when a request fails.
    observers: Arc<OomObservers>,
    /// Shared with every device, told of segments made and given back.
    segment_observers: Arc<SegmentObservers>,
    /// The allocation history of every device.
    pub(in crate::caching) recorder: Arc<Recorder>,
    /// What this allocator imported of other processes' exports (`caching::ipc::import`).
    pub(in crate::caching) ipc_imports: crate::caching::ipc::import::Imports,
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
            segment_observers: Arc::default(),
            recorder,
            ipc_imports: Default::default(),
        }
    }

    /// An allocator over the driver `config` names. Also returns the simulated driver when that
    /// is the one chosen, so tests and the C API can control it.
    ///
    /// Errors: [`Error::DriverUnavailable`] when the CUDA driver or a device is missing.
    pub fn from_config(config: Config) -> Result<(Allocator, Option<Arc<SimDriver>>), Error> {
        match config.driver {
            DriverKind::Sim => {
                std::thread::sleep(std::time::Duration::from_millis(config.sim_start_delay_ms));
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
    /// The hit path's case, a device named and started, inline; the rest out of line.
    #[inline(always)]
    pub(in crate::caching) fn device_or_init(&self, device: i32) -> Result<&DeviceAllocator, Error> {
        if super::fork::forked() {
            return self.device_or_start(device);
        }
        self.device_or_init_in_parent(device)
    }

    /// [`Allocator::device_or_init`] for a caller that checked the process is not a forked
    /// child (the malloc that missed the thread's cache, below `Allocator::malloc_in_parent`):
    /// a check fewer.
    #[inline(always)]
    pub(in crate::caching) fn device_or_init_in_parent(&self, device: i32) -> Result<&DeviceAllocator, Error> {
        if let Some(dev) = usize::try_from(device).ok().and_then(|i| self.devices.get(i)).and_then(OnceLock::get) {
            return Ok(dev);
        }
        self.device_or_start(device)
    }

    /// [`Allocator::device_or_init`] for the current device, a device not started yet, or an
    /// error.
    #[inline(never)]
    fn device_or_start(&self, device: i32) -> Result<&DeviceAllocator, Error> {
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
            self.segment_observers.clone(),
            HistoryHook::new(self.recorder.clone(), d as usize),
        );
        if config.per_process_memory_fraction < 1.0 {
            dev.set_memory_fraction(config.per_process_memory_fraction)?;
        }
        Ok(slot.get_or_init(|| dev))
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
    /// Ownership: the allocator owns the observer until it is detached or the allocator is
    /// dropped. An observer that holds an `Arc` of the allocator it observes makes a cycle that
    /// keeps both alive for good (LeakSanitizer reports it at exit); hold a
    /// [`Weak`](std::sync::Weak) and upgrade it in the call instead.
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

    /// Attaches `observer`, told of every segment of any device taken from the driver or given
    /// back, and of every page range of an expandable segment mapped or unmapped (PyTorch
    /// `attachAllocatorTraceTracker`, with which `ProcessGroupNCCL` registers each segment
    /// with its communicators). Segments that exist already are not told, neither made nor
    /// given back (each observer is told a `Free` or `Unmap` only for the bytes it was told
    /// added): attach before the first allocation, or read them from a snapshot. A sleep
    /// ([`Allocator::sleep`]) tells `Unmap` of every page it gives back, and a wake `Map` of
    /// every page it maps again. Returns the id
    /// [`Allocator::detach_segment_observer`] takes.
    ///
    /// When it runs, on the thread whose call made or gives back the segment (docs/observers.md):
    /// - [`SegmentEventKind::Alloc`](crate::SegmentEventKind::Alloc) and `Map`: after the driver
    ///   call, with no lock of gpupool's held, before the malloc that grew returns (a call that
    ///   fails after growing delivers them at the stream's next call at the latest);
    /// - `Free` and `Unmap`: before the driver call, while the memory is still the segment's,
    ///   with the stream's shard locked (as PyTorch calls its trace tracker under its mutex).
    ///
    /// For each observer, bytes added minus bytes taken away equals the reserved bytes the
    /// segments made since its attach hold, whenever no call is under way.
    ///
    /// The observer may call CUDA and NCCL (`ncclCommRegister`, `ncclCommDeregister`), but not
    /// gpupool: a malloc of it that needs a new segment fails with [`Error::InvalidValue`], and
    /// any call on the stream of a `Free` or `Unmap` event would wait for the lock held. A
    /// panic in it is caught (the panic hook reports it) and the next observers still run.
    ///
    /// Thread-safe: attach and detach from any thread while others allocate. With none
    /// attached, the slow paths that make or give back segments pay one relaxed load; the hit
    /// path makes no segment and pays nothing.
    pub fn attach_segment_observer(
        &self,
        observer: impl Fn(&SegmentEvent) + Send + Sync + 'static,
    ) -> SegmentObserverId {
        self.segment_observers.attach(Box::new(observer))
    }

    /// Detaches the segment observer `id`; false when it is not attached. Called from outside
    /// any segment observer, it returns once no call of it is under way on any thread, and
    /// none starts after; from inside one, at once.
    pub fn detach_segment_observer(&self, id: SegmentObserverId) -> bool {
        self.segment_observers.detach(id)
    }

    /// The device of a segment: started already, since it has segments.
    pub(in crate::caching) fn used_device(&self, device: i32) -> Result<&DeviceAllocator, Error> {
        super::fork::check()?;
        self.used_device_in_parent(device)
    }

    /// [`Allocator::used_device`] for a caller that checked the process is not a forked child
    /// (the indexed free, below `Allocator::free_in_parent`): a check fewer.
    #[inline(always)]
    pub(in crate::caching) fn used_device_in_parent(&self, device: i32) -> Result<&DeviceAllocator, Error> {
        self.devices[device as usize]
            .get()
            .ok_or_else(|| Error::Internal(format!("a segment names device {device}, which was never used")))
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

    /// The ordinals of the devices this allocator has started (used), in order.
    pub fn devices_in_use(&self) -> Vec<i32> {
        self.devices.iter().enumerate().filter(|(_, d)| d.get().is_some()).map(|(i, _)| i as i32).collect()
    }
}
