//! One device: its shards (one per stream), PyTorch's malloc with free-and-retry on
//! out-of-memory, `empty_cache`, and the memory fraction.
//!
//! Here: the device's state, what a call on a shard needs (`ctx`), and the memory fraction.
//! The rest by mechanism: `serve.rs`: malloc up to its first failure; `out_of_memory.rs`: the
//! rest of malloc (release-and-retry, observers); `free.rs`: free and `record_stream`;
//! `release_cached.rs`: the deferred frees' synchronisation and `empty_cache`; `gc_threshold.rs`:
//! `garbage_collection_threshold`; `stranded.rs`: the cache of unused streams released before
//! a growth past the high-water mark (`GPUPOOL_RELEASE_UNUSED_STREAMS`); `pools.rs`: private
//! pools; `check_totals.rs`: the consistency check. Five mechanisms keep their device part in their
//! own folder: the statistics (`caching::accounting::device`: the end of each call, peak
//! credit, the settles, `getStats`; `caching::accounting::device_call_settle`: a call's
//! settle, one shard at a time), the allocation history and snapshots
//! (`caching::history::device`), the largest request a stream would be served now
//! (`caching::largest::device`), a pool's sleep and wake (`caching::sleep::device`,
//! `caching::sleep::device_copy`), and the blocks in IPC limbo reclaimed on the out-of-memory
//! path (`caching::ipc::device`).
//!
//! Lock order, which makes deadlock impossible: a thread holding a shard's lock takes no other
//! lock but the segment index's writer lock, the dirty list's (`shard_table`) and the
//! history's (a device's trace, the table of stacks), none of which is held while taking
//! another. The peak lock is taken with no shard lock held; under it a settle locks the shards
//! it visits (one settle at a time; a call's settle one shard after another, a read's all at
//! once), the consistency check and a snapshot lock every shard,
//! and `empty_cache` takes the shard table's lock and only tries the shard locks. The private
//! pools' lock (`pools.rs`), the capture probe's list of streams seen capturing
//! (`capture.rs`), the page pool's lock (`page_pool.rs`, held across `cuMemRelease` calls) and
//! the process's table of IPC exports (`caching::ipc::export`, taken by the free of an
//! exported block) are leaves: taken with or without shard locks held, never held while taking
//! another lock. Out-of-memory observers and route filters run with none of these held
//! (`out_of_memory.rs`, `pools.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize};

use parking_lot::Mutex;

use super::accounting::counters::DeviceCounters;
use super::accounting::peaks::{SpareCredit, Totals};
use super::capture::CaptureProbe;
use super::deferred::DeferredFrees;
use super::expandable::PagePool;
use super::limit::MemoryLimit;
use super::observers::out_of_memory::OomObservers;
use super::observers::segments::SegmentObservers;
use super::peers::Peers;
use super::rules::{SMALL_BUFFER, SizeRules};
use super::segment_index::SegmentIndex;
use super::shard::{ExpandablePolicy, Reclaim, Shard, ShardCtx};
use super::shard_table::ShardTable;
use super::sleep::{Kept, Sleepers, Staging, StagingSettings, sleepable};
use crate::config::Config;
use crate::driver::{Driver, StreamHandle};
use crate::error::Error;
use crate::history::HistoryHook;

mod check_totals;
mod free;
mod gc_threshold;
mod release_cached;
mod serve;
mod stranded;

/// What the peak lock guards: the device's totals and the shards that still hold credit.
#[derive(Default)]
pub(in crate::caching) struct PeakState {
    pub(in crate::caching) totals: Totals,
    pub(in crate::caching) holders: Vec<Arc<Shard>>,
    /// Reused by each settle for the shards it visits (no allocation once warm).
    pub(in crate::caching) visit: Vec<Arc<Shard>>,
    pub(in crate::caching) holds: Vec<bool>,
}

pub(crate) struct DeviceAllocator {
    pub device: i32,
    pub(in crate::caching) driver: Arc<dyn Driver>,
    pub(in crate::caching) index: Arc<SegmentIndex<Arc<Shard>>>,
    /// The size rules of `GPUPOOL_CONF`, fixed when the device started.
    pub(in crate::caching) rules: SizeRules,
    pub max_split_size: usize,
    pub(in crate::caching) shards: ShardTable,
    pub(in crate::caching) peaks: Mutex<PeakState>,
    /// Credit towards the peaks that no shard holds (see `peaks`).
    pub(in crate::caching) spare: SpareCredit,
    pub(in crate::caching) counters: DeviceCounters,
    pub(in crate::caching) limit: MemoryLimit,
    /// Physical pages held unmapped for expandable segments (see `page_pool`).
    pub(in crate::caching) pages: PagePool,
    pub(in crate::caching) deferred: DeferredFrees,
    /// Expandable segments' layout; `None`: ordinary segments.
    pub(in crate::caching) expandable: Option<ExpandablePolicy>,
    /// Whether expandable segments keep to the device's high-water mark (see [`Reclaim`]).
    reclaim: Reclaim,
    /// PyTorch's `garbage_collection_threshold` (0: off; see `gc`).
    gc_threshold: f64,
    /// Whether a growth past the high-water mark releases the cache of unused streams first
    /// (`GPUPOOL_RELEASE_UNUSED_STREAMS`, see `stranded`).
    release_unused_streams: bool,
    /// Bytes grown past the high-water mark since the last scan for unused streams.
    grown_past_mark: AtomicUsize,
    /// The allocator's out-of-memory observers, read only once a request has failed.
    pub(in crate::caching) observers: Arc<OomObservers>,
    /// The allocator's segment observers (see `segment_observers`).
    pub(in crate::caching) segment_observers: Arc<SegmentObservers>,
    /// The allocation history: malloc and free read its flag.
    pub(in crate::caching) history: HistoryHook,
    /// Whether a CUDA graph capture may be under way (see `capture`).
    pub(in crate::caching) capture: CaptureProbe,
    /// The private pools and the routes to them (see `pools`).
    pub(in crate::caching) pools: crate::caching::pools::Pools,
    /// The pools that sleep (see `caching::sleep`).
    pub(in crate::caching) sleepers: Sleepers,
    /// The expandable layout of sleepable private pools when the default pools have none
    /// (`expandable_segments:False`), found at their first use; `None` inside: the driver
    /// cannot map memory.
    pub(in crate::caching) sleep_policy: std::sync::OnceLock<Option<ExpandablePolicy>>,
    /// The page of sleepable pools' expandable segments, bytes (`GPUPOOL_SLEEP_PAGE`).
    pub(in crate::caching) sleep_page: usize,
    /// The pinned staging ring of sleep and wake with offload (see `caching::sleep::staging`).
    pub(in crate::caching) staging: Staging,
    /// The pinned host copies pools keep between sleeps (see `caching::sleep::pinned_copies`).
    pub(in crate::caching) kept: Kept,
    /// The devices its memory is mapped for besides itself (see `caching::peers`).
    pub(in crate::caching) peers: Peers,
}

/// Page size of the large pool's expandable segments, in bytes, rounded up to the driver's
/// granularity. PyTorch maps 20 MiB pages (`kLargeBuffer`) there; replaying the traces of
/// `../shared/traces` on the simulated device, 2 MiB pages reserved less on every one (peak
/// reserved over peak live: llama_decode 1.054 with 20 MiB, 1.027 with 2 MiB;
/// pipeline_streams 1.386 and 1.180; vit_train 1.037 and 1.038) for more driver calls when a
/// segment grows, which the cold pass of `bench` measures on the GPU.
const LARGE_PAGE: usize = 2 << 20;

/// With `GPUPOOL_EXPANDABLE_LARGE_PAGES`, requests of the large pool of this many bytes and
/// more grow ranges of their own mapped in pages of this size (PyTorch's `kLargeBuffer`, its
/// page in the large pool): replaying vit_train on the simulated device with the high-water
/// rule, the warm pass mapped 17 pages instead of 1,176, at 1.040 times live instead of 1.021
/// (docs/fragmentation.md).
const HUGE_PAGE: usize = 20 << 20;

/// With large pages, a growth for a request of [`HUGE_PAGE`] bytes and more maps 2 MiB pages
/// where they map fewer bytes than its large ones, and at most this many (128 MiB; past it
/// the large pages, as many driver calls as before): replaying the traces of
/// docs/fragmentation.md, and the same with every size scaled by 0.8 and by 1.3, on the
/// simulated device, 64 to 128 pages reserved about the same; 40 or 48 up to 0.09 of live more
/// on some traces, 160 more on the random working set (1.218 against 1.184).
const SMALL_PAGES_PER_GROWTH: usize = 64;

/// Those 2 MiB pages only where the bytes they save are at least the pool's mapped bytes (the
/// shard's, with them) over this: 2 MiB saved from 1 GiB mapped, 20 MiB from 10 GiB. A saving
/// moves reserved over live by its share of the pool, while a page costs a `cuMemCreate` and a
/// `cuMemMap` (50-100 us on an H200) whatever the pool holds. Replaying the 26 traces of
/// docs/fragmentation.md on the simulated device: 12% fewer pages mapped in the cold passes
/// than small pages wherever they map less (vit_train 1,595 rather than 2,431, bert_train
/// 1,440 rather than 1,542) at the same mean reserved over live (1.112), no trace worse by
/// more than 0.005 (vit_train 1.039) and no page call added to a warm pass; on 32 copies
/// scaled by 0.7-1.2, 9% fewer at most 0.004 worse. 400 to 500 about the same, but some of
/// them add page calls to vit_train's warm pass (500: 30); 150 to 350 fewer pages still (up
/// to 29%) but bert_train 0.06 of live more, and bounds in bytes (a saving of at least 4 to
/// 16 MiB) 0.01 to 0.1 more on other traces. Most pages left are those of the requests below
/// 20 MiB, which map 2 MiB pages whatever this says.
const SMALL_PAGES_SAVING: usize = 480;

impl DeviceAllocator {
    /// The allocator of `device` with `config`'s rules (PyTorch's size rules,
    /// `garbage_collection_threshold`), calling `observers` when a request fails. With
    /// `expandable_segments`, its segments are expandable if the driver can map memory on it;
    /// otherwise, or when asking the driver fails, they are ordinary segments, as PyTorch falls
    /// back; with `expandable_reclaim` they keep to the high-water mark (see [`Reclaim`]). Its events go to
    /// `history`.
    pub fn new(
        device: i32,
        driver: Arc<dyn Driver>,
        index: Arc<SegmentIndex<Arc<Shard>>>,
        config: &Config,
        observers: Arc<OomObservers>,
        segment_observers: Arc<SegmentObservers>,
        history: HistoryHook,
    ) -> Self {
        let rules = SizeRules::from_config(config);
        let (expandable, reclaim, gc_threshold) =
            (config.expandable_segments, config.expandable_reclaim, config.garbage_collection_threshold);
        // The high-water rule moves pages one by one to keep reserved memory at the floor,
        // which larger pages would raise (the random working set of `bench`: 1.11 of live
        // rather than 1.01 on the simulated device): with it, 20 MiB pages at any size.
        let per_request = if reclaim { 0 } else { config.expandable_pages_per_request };
        let expandable = expandable
            .then(|| expandable_policy(&*driver, device, config.expandable_large_pages, per_request))
            .flatten();
        DeviceAllocator {
            gc_threshold,
            release_unused_streams: config.release_unused_streams,
            grown_past_mark: AtomicUsize::new(0),
            reclaim: if expandable.is_some() && reclaim { Reclaim::Device } else { Reclaim::Off },
            expandable,
            device,
            driver: driver.clone(),
            index,
            rules,
            max_split_size: rules.max_split_size,
            shards: ShardTable::default(),
            peaks: Mutex::default(),
            spare: std::array::from_fn(|_| AtomicI64::new(0)),
            counters: DeviceCounters::default(),
            limit: MemoryLimit::default(),
            pages: PagePool::default(),
            deferred: DeferredFrees::default(),
            observers,
            segment_observers,
            history,
            capture: CaptureProbe::new(driver.clone(), device),
            pools: crate::caching::pools::Pools::default(),
            sleepers: Sleepers::default(),
            sleep_policy: std::sync::OnceLock::new(),
            sleep_page: config.sleep_page,
            staging: Staging::new(StagingSettings::from_config(config)),
            kept: Default::default(),
            peers: Peers::default(),
        }
    }

    /// What a call on `shard` needs. A private pool's segments are ordinary ones: a graph
    /// replays at fixed addresses, which an expandable segment unmapping its free pages would
    /// take away; but a sleepable pool's are expandable (see `caching::sleep`), and keep the
    /// free pages of a segment a graph uses mapped.
    pub(in crate::caching) fn ctx<'a>(&'a self, shard: &'a Arc<Shard>) -> ShardCtx<'a> {
        let private = shard.pool != 0;
        let expandable = match private {
            false => self.expandable.as_ref(),
            true if sleepable(shard.pool) => self.sleep_policy(),
            true => None,
        };
        ShardCtx {
            driver: &*self.driver,
            device: self.device,
            max_split_size: self.max_split_size,
            index: &self.index,
            shard,
            limit: &self.limit,
            pages: &self.pages,
            deferred: &self.deferred,
            expandable,
            reclaim: if private { Reclaim::Off } else { self.reclaim },
            history: &self.history,
            capture: &self.capture,
            segments: &self.segment_observers,
            peers: &self.peers,
        }
    }

    /// The shard of `stream` in the default pools, created on first use.
    pub fn shard_or_create(&self, stream: StreamHandle) -> Arc<Shard> {
        self.shards.get_or_create(0, stream)
    }

    /// Whether a route to a private pool is active on the device (one relaxed load).
    #[inline(always)]
    pub fn routes_active(&self) -> bool {
        self.capture.routes() != 0
    }

    /// PyTorch `setMemoryFraction`: from now on the device reserves at most `fraction` of its
    /// total memory (`cuMemGetInfo`); a segment past that fails as out of memory, after the
    /// cache was released and the allocation retried. Segments already reserved stay.
    /// `fraction` is checked by the caller.
    ///
    /// Errors: [`Error::Cuda`] when the total cannot be read.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        let info =
            self.driver.mem_info(self.device).map_err(|e| Error::driver(e, "reading the device's total memory"))?;
        self.limit.set((fraction * info.total as f64) as i64);
        Ok(())
    }
}

/// The layout of `device`'s expandable segments, or `None` when the driver cannot map memory
/// there (or fails to say). With `large_pages` (`GPUPOOL_EXPANDABLE_LARGE_PAGES`), requests of
/// [`HUGE_PAGE`] bytes and more grow ranges of pages of that size, or of its doubles past
/// `pages_per_request` pages (`GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST`), or with
/// `pages_per_request` above 0 ranges of 2 MiB pages where those map fewer bytes
/// ([`SMALL_PAGES_PER_GROWTH`], [`SMALL_PAGES_SAVING`]).
pub(in crate::caching) fn expandable_policy(
    driver: &dyn Driver,
    device: i32,
    large_pages: bool,
    pages_per_request: usize,
) -> Option<ExpandablePolicy> {
    let granularity = driver.vmm_granularity(device).ok()??;
    let total = driver.mem_info(device).ok()?.total;
    let small_page = SMALL_BUFFER.next_multiple_of(granularity);
    let large_page = LARGE_PAGE.next_multiple_of(granularity);
    let huge_page = HUGE_PAGE.next_multiple_of(granularity);
    let huge_from = if large_pages { HUGE_PAGE } else { usize::MAX };
    // The page by rounding goes with the ladder: off where 20 MiB pages are asked for at any
    // size, and with the high-water rule, which moves 20 MiB pages whole.
    let small_pages_within = if large_pages && pages_per_request > 0 { SMALL_PAGES_PER_GROWTH } else { 0 };
    Some(ExpandablePolicy {
        small_page,
        large_page,
        huge_from,
        huge_page,
        pages_per_request,
        small_pages_within,
        small_pages_saving: SMALL_PAGES_SAVING,
        device_total: total,
    })
}

impl Drop for DeviceAllocator {
    /// Gives back to the driver what is free: cached segments and idle events, after waiting
    /// for the pending events of freed blocks and for blocks awaiting a device synchronisation
    /// (as `empty_cache`). Live blocks, and the segments holding them, stay allocated until
    /// the process exits: gpupool cannot know whether the program still uses them.
    fn drop(&mut self) {
        if super::fork::check().is_ok() {
            let _ = self.release_cached_blocks();
        }
    }
}
