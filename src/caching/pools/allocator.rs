//! Private pools (PyTorch's graph pools and `MemPool`) and the routes that send allocations
//! to them, by device; the rules are in `caching::pools`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::RwLock;
use rustc_hash::FxHashSet;

use super::{RouteFilter, RouteTo};
use crate::caching::allocator::Allocator;
use crate::caching::sleep::SLEEPABLE_BIT;
use crate::driver::StreamHandle;
use crate::error::Error;
use crate::stats::PoolStats;

/// The next private pool id: ids are process-wide (one id names the pool on every device and
/// in every allocator), never 0 (the default pools).
static NEXT_POOL: AtomicU64 = AtomicU64::new(1);

/// Every id handed out, as handed out (a sleepable pool's with [`SLEEPABLE_BIT`]): what
/// [`Allocator::check_pool`] accepts. A counter alone could not tell a sleepable id from its
/// plain twin, nor the sleepable bit over counter 0 from a pool. Read only by calls that name a
/// pool (routes, sleep, statistics, release), never on the hit path.
static CREATED: LazyLock<RwLock<FxHashSet<u64>>> = LazyLock::new(Default::default);

/// The next id, with `bits` set, recorded as created.
fn new_pool(bits: u64) -> u64 {
    let pool = NEXT_POOL.fetch_add(1, Ordering::Relaxed) | bits;
    CREATED.write().insert(pool);
    pool
}

impl Allocator {
    /// A new private pool (PyTorch `graph_pool_handle()` / `MemPool()`): its id, never 0 (the
    /// default pools). Ids are process-wide; the pool's memory is per device, made on the
    /// devices whose allocations are routed to it. Records the id (a few bytes, for the life
    /// of the process) so that only ids handed out are accepted.
    pub fn pool_create(&self) -> u64 {
        new_pool(0)
    }

    /// [`Allocator::pool_create`] with `flags` (PyTorch `torch.cuda.MemPool(use_on_oom=,
    /// no_split=)`), fixed for the pool's life, on every device:
    /// - [`POOL_USE_ON_OOM`](crate::POOL_USE_ON_OOM): a request to the default pools that would
    ///   fail with out of memory takes a cached block of this pool instead (see
    ///   `caching::pools::fallback` for the order, the statistics and the free);
    /// - [`POOL_NO_SPLIT`](crate::POOL_NO_SPLIT): the pool never splits a block (see
    ///   `caching::pools`).
    ///
    /// 0 is [`Allocator::pool_create`]. Allocations reach the pool through the routes, as any
    /// private pool's; a fallback pool needs one to fill its cache.
    ///
    /// Errors: [`Error::InvalidValue`] for a bit that is no flag; no pool is made.
    pub fn pool_create_ex(&self, flags: u32) -> Result<u64, Error> {
        let flags = super::flags::check(flags)?;
        let pool = NEXT_POOL.fetch_add(1, Ordering::Relaxed);
        // The flags before the id is known as created: no shard of the pool exists yet.
        super::flags::set(pool, flags);
        CREATED.write().insert(pool);
        Ok(pool)
    }

    /// A new private pool whose segments come from `alloc` and go back through `free` instead
    /// of the driver (PyTorch `torch.cuda.MemPool(allocator)`, whose `CUDAPluggableAllocator`
    /// gives a pool `ncclMemAlloc` and `ncclMemFree`). Everything else is a private pool's, as
    /// [`Allocator::pool_create`] makes: routes, caching, splitting, `record_stream`,
    /// statistics, `release_pool`. `alloc(bytes, device, stream)` returns the segment's
    /// address, or `None` for out of memory (release-and-retry and the out-of-memory
    /// observers follow); `free(address, bytes, device, stream)` is called once for each
    /// segment `alloc` gave, when gpupool gives it back (`empty_cache`, `release_pool`). Both
    /// run on the calling thread with the stream's shard locked: they must not call gpupool.
    /// The memory counts as reserved, and against the memory fraction, as a driver segment.
    pub fn pool_create_with_allocator(
        &self,
        alloc: impl Fn(usize, i32, StreamHandle) -> Option<crate::driver::DevicePtr> + Send + Sync + 'static,
        free: impl Fn(crate::driver::DevicePtr, usize, i32, StreamHandle) + Send + Sync + 'static,
    ) -> u64 {
        self.pool_create_with_allocator_aligned(alloc, free, 0).expect("no alignment is always valid")
    }

    /// [`Allocator::pool_create_with_allocator`] whose blocks are never split below
    /// `split_alignment` bytes: every request is rounded up to a multiple of it, and every
    /// segment asked of `alloc` too, so that each block starts at a multiple of it from its
    /// segment's start (the segments `alloc` gives must start at such a multiple: `ncclMemAlloc`
    /// gives the multicast granularity NVLink SHARP needs). 0: none. gpupool's own:
    /// `torch.cuda.MemPool(allocator)` takes no alignment.
    ///
    /// Errors: [`Error::InvalidValue`] for an alignment that is not a multiple of 512 bytes
    /// (PyTorch's `kMinBlockSize`, which every block size is a multiple of) or is over 1 TiB;
    /// no pool is made.
    pub fn pool_create_with_allocator_aligned(
        &self,
        alloc: impl Fn(usize, i32, StreamHandle) -> Option<crate::driver::DevicePtr> + Send + Sync + 'static,
        free: impl Fn(crate::driver::DevicePtr, usize, i32, StreamHandle) + Send + Sync + 'static,
        split_alignment: usize,
    ) -> Result<u64, Error> {
        if split_alignment % 512 != 0 || split_alignment > 1 << 40 {
            return Err(Error::InvalidValue(format!(
                "split alignment {split_alignment} bytes is not a multiple of 512 bytes from 0 to 1 TiB"
            )));
        }
        let pool = self.pool_create();
        super::source::set(
            pool,
            super::source::PoolSource { alloc: Box::new(alloc), free: Box::new(free), split_alignment },
        );
        Ok(pool)
    }

    /// A new private pool that may sleep ([`Allocator::sleep`]): as [`Allocator::pool_create`],
    /// but its segments are expandable (on the virtual memory API), during captures too, and
    /// wholly free pages of a segment a CUDA graph uses stay mapped. Its id has bit 62 set.
    pub fn pool_create_sleepable(&self) -> u64 {
        new_pool(SLEEPABLE_BIT)
    }

    /// `pool` names a pool made by [`Allocator::pool_create`] or
    /// [`Allocator::pool_create_sleepable`], exactly as it was handed out.
    pub(in crate::caching) fn check_pool(pool: u64) -> Result<(), Error> {
        if pool == 0 {
            return Err(Error::InvalidValue(
                "pool 0 names the default pools, which are not a private pool: create one with gpupool_pool_create"
                    .into(),
            ));
        }
        if !CREATED.read().contains(&pool) {
            let twin = pool ^ SLEEPABLE_BIT;
            let hint = if pool & (SLEEPABLE_BIT << 1) == 0 && CREATED.read().contains(&twin) {
                format!(" ({twin:#x} was: a sleepable pool's id carries bit 62, a plain pool's does not)")
            } else {
                String::new()
            };
            return Err(Error::InvalidValue(format!(
                "pool {pool:#x} was never created{hint}: gpupool_pool_create and gpupool_pool_create_sleepable make pools"
            )));
        }
        Ok(())
    }

    /// Routes the allocations on `stream` of `device` (-1: current), from any thread, to
    /// `pool` until [`Allocator::end_allocate_to_pool`] (PyTorch `beginAllocateToPool` with
    /// `torch.cuda.graph`'s capture stream). See `caching::pools` for the rules.
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
}
