//! A device's private pools (`caching::pools`): their table, routes and the pool a malloc
//! goes to, statistics per pool, release.

use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::caching::accounting::counters::{self, CELLS, DeviceCounters};
use crate::caching::accounting::peaks::Totals;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::{Request, Shard};
use crate::caching::shard_table::ShardTable;
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Error;
use crate::stats::{DeviceStats, PoolStats};

/// A route's test of a stream (PyTorch's `std::function<bool(cudaStream_t)>` filter). Called
/// only while the route is active, on allocations of the device, with no lock of gpupool's held.
pub(crate) type RouteFilter = Arc<dyn Fn(StreamHandle) -> bool + Send + Sync>;

/// What a route sends to its pool.
#[derive(Clone)]
pub(crate) enum RouteTo {
    /// Allocations on this stream, from any thread (`torch.cuda.graph`'s capture stream).
    Stream(StreamHandle),
    /// Allocations of this thread, on any stream (`torch.cuda.use_mem_pool`).
    Thread(ThreadId),
    /// Allocations on the streams the filter accepts.
    Filter(RouteFilter),
}

#[derive(Clone)]
struct Route {
    pool: u64,
    to: RouteTo,
}

struct PoolEntry {
    released: bool,
    /// The highest value of each statistic the pool was seen at: after each allocation from
    /// it, and at each read.
    peak: [i64; CELLS],
}

impl PoolsState {
    /// Routes made for a capture: by stream or by filter.
    fn capture_routes(&self) -> usize {
        self.routes.iter().filter(|r| !matches!(r.to, RouteTo::Thread(_))).count()
    }
}

#[derive(Default)]
struct PoolsState {
    /// In the order begun: the first that matches an allocation takes it (as PyTorch's search
    /// of `captures_underway`).
    routes: Vec<Route>,
    /// Every pool routed to on this device, and the released ones that still hold memory.
    pools: FxHashMap<u64, PoolEntry>,
    /// The released pools that hold nothing any more: their ids stay refused (8 bytes each).
    released: rustc_hash::FxHashSet<u64>,
}

impl PoolsState {
    fn is_released(&self, pool: u64) -> bool {
        self.released.contains(&pool) || self.pools.get(&pool).is_some_and(|p| p.released)
    }
}

/// A device's private pools and the routes to them.
#[derive(Default)]
pub(in crate::caching) struct Pools {
    state: Mutex<PoolsState>,
}

impl DeviceAllocator {
    /// Begins a route to `pool` (PyTorch `beginAllocateToPool`).
    ///
    /// Errors: [`Error::InvalidValue`], nothing changed: the pool was released on this device,
    /// or the stream (the thread) is routed already, to this pool or another.
    pub fn begin_route(&self, pool: u64, to: RouteTo) -> Result<(), Error> {
        let mut ps = self.pools.state.lock();
        if ps.is_released(pool) {
            return Err(Error::InvalidValue(format!(
                "pool {pool} was released on device {}: its id cannot be routed to again there; create a new pool",
                self.device
            )));
        }
        let clash = ps.routes.iter().find(|r| match (&r.to, &to) {
            (RouteTo::Stream(a), RouteTo::Stream(b)) => a == b,
            (RouteTo::Thread(a), RouteTo::Thread(b)) => a == b,
            _ => false,
        });
        if let Some(r) = clash {
            let what = match to {
                RouteTo::Stream(s) => format!("stream {s:#x}"),
                _ => "the calling thread".to_string(),
            };
            return Err(Error::InvalidValue(format!(
                "{what} already allocates to pool {} on device {}: end that route first (gpupool_end_allocate_to_pool)",
                r.pool, self.device
            )));
        }
        ps.pools.entry(pool).or_insert(PoolEntry { released: false, peak: [0; CELLS] });
        ps.routes.push(Route { pool, to });
        self.capture.set_routes(ps.routes.len(), ps.capture_routes());
        Ok(())
    }

    /// Ends every route to `pool` (PyTorch `endAllocateToPool`). Once no route by stream or
    /// filter is left on the device, the blocks freed during captures get their events and the
    /// released pools' wholly free segments go back to the driver.
    ///
    /// Errors: [`Error::InvalidValue`] when no route to `pool` is active on this device.
    pub fn end_routes(&self, pool: u64) -> Result<(), Error> {
        let (left, _ended) = {
            let mut ps = self.pools.state.lock();
            let ended = take_routes(&mut ps.routes, pool);
            if ended.is_empty() {
                return Err(Error::InvalidValue(format!(
                    "no allocation is routed to pool {pool} on device {}: nothing to end",
                    self.device
                )));
            }
            self.capture.set_routes(ps.routes.len(), ps.capture_routes());
            (ps.capture_routes(), ended)
        };
        if left == 0 {
            self.after_captures();
        }
        Ok(())
    }

    /// What waited for no capture to be under way: blocks freed during one get their events,
    /// the events of private pools' shards are processed (no route reaches those shards now,
    /// so no malloc would), and released pools give back their wholly free segments. Best
    /// effort: a failure leaves the rest for `empty_cache`.
    fn after_captures(&self) {
        for shard in self.shards.all() {
            let ctx = self.ctx(&shard);
            let mut st = self.shards.lock_for_change(&shard);
            if st.has_capture_deferred() {
                st.insert_deferred_events(&ctx);
            }
            if shard.pool != 0 && st.events_pending() && !self.capture.capture_routed() {
                let _ = self.process_events(&mut st, || ctx);
            }
            if st.released {
                self.release_emptied(&mut st, &ctx);
            }
            self.finish(st, ());
        }
    }

    /// Releases `pool` on this device (PyTorch `releasePool`): its routes end, its wholly free
    /// segments go back to the driver now (unless a capture may be under way: then at the next
    /// free, `end_allocate_to_pool` or `empty_cache`), the others as their last block is freed,
    /// and nothing is allocated from it again.
    ///
    /// Errors: [`Error::InvalidValue`] when it was released on this device already, or sleeps;
    /// nothing changed.
    pub fn release_pool(&self, pool: u64) -> Result<(), Error> {
        self.refuse_asleep(pool)?;
        let left = {
            let mut ps = self.pools.state.lock();
            if ps.released.contains(&pool) {
                return Err(Error::InvalidValue(format!("pool {pool} was released on device {} already", self.device)));
            }
            let entry = ps.pools.entry(pool).or_insert(PoolEntry { released: false, peak: [0; CELLS] });
            if entry.released {
                return Err(Error::InvalidValue(format!("pool {pool} was released on device {} already", self.device)));
            }
            entry.released = true;
            let ended = take_routes(&mut ps.routes, pool);
            self.capture.set_routes(ps.routes.len(), ps.capture_routes());
            (ps.capture_routes(), ended)
        };
        let (left, _ended) = left;
        for shard in self.shards.of_pool(pool) {
            let ctx = self.ctx(&shard);
            let mut st = self.shards.lock_for_change(&shard);
            st.release_graph_segments();
            self.release_emptied(&mut st, &ctx);
            self.finish(st, ());
        }
        if left == 0 {
            self.after_captures();
        }
        self.prune_released();
        self.close_kept(pool);
        Ok(())
    }

    /// Forgets the released pools that hold nothing any more but their ids (see
    /// `PoolsState::released`), so that churning pools grows neither the device's state nor its
    /// summary.
    pub(in crate::caching) fn prune_released(&self) {
        let candidates: Vec<u64> =
            self.pools.state.lock().pools.iter().filter(|(_, e)| e.released).map(|(&id, _)| id).collect();
        let seg = counters::cell(counters::Metric::Segment, counters::StatType::All);
        let active = counters::cell(counters::Metric::Active, counters::StatType::All);
        for pool in candidates {
            let (current, _, _) = sum_pool(&self.shards, pool);
            if current[seg] == 0 && current[active] == 0 {
                let mut ps = self.pools.state.lock();
                ps.pools.remove(&pool);
                ps.released.insert(pool);
                self.sleepers.forget(pool);
                self.shards.budgets.forget(pool);
            }
        }
    }

    /// Gives back to the driver the wholly free segments of a released pool's shard, its
    /// events processed first (without waiting), unless a capture may be under way (see
    /// `capture`): freeing device memory then would break it.
    /// Best effort: what fails stays cached, for `empty_cache`.
    pub(in crate::caching) fn release_emptied(
        &self,
        st: &mut crate::caching::shard::ShardState,
        ctx: &crate::caching::shard::ShardCtx,
    ) {
        // The shard's stream is not asked: the program may have destroyed it (see `capture`).
        if self.capture.any_underway() {
            return;
        }
        if st.has_capture_deferred() {
            st.insert_deferred_events(ctx);
        }
        let _ = st.process_events(ctx);
        let _ = st.release_cached(ctx);
    }

    /// The pool an allocation on `stream` by the calling thread goes to, if a route takes it;
    /// pool 0 while the default pools sleep, which `malloc_in_pool` refuses. Filters are called
    /// with no lock held.
    #[cold]
    #[inline(never)]
    pub fn route_for(&self, stream: StreamHandle) -> Option<u64> {
        let me = std::thread::current().id();
        let routes = self.pools.state.lock().routes.clone();
        routes
            .iter()
            .find_map(|r| {
                let takes = match &r.to {
                    RouteTo::Stream(s) => *s == stream,
                    RouteTo::Thread(t) => *t == me,
                    RouteTo::Filter(f) => f(stream),
                };
                takes.then_some(r.pool)
            })
            .or_else(|| self.capture.default_asleep().then_some(0))
    }

    /// Allocates `size` bytes from `pool` for `stream`: PyTorch's malloc on the pool's shard
    /// of the stream. While the stream captures, a block from the cache or a new segment
    /// (made with the thread's capture mode relaxed) is kept for the graph (see the module).
    ///
    /// Errors: as [`DeviceAllocator::malloc`]; [`Error::InvalidValue`] when the pool was
    /// released meanwhile, or sleeps (pool 0: the default pools).
    pub fn malloc_in_pool(&self, pool: u64, stream: StreamHandle, size: usize) -> Result<DevicePtr, Error> {
        self.refuse_asleep(pool)?;
        let mut req = Request::new(size, &self.rules)?;
        let capturing = self.capture.status(stream)?.is_capturing();
        let shard = self.shards.get_or_create(pool, stream);
        if let Some(align) = shard.source.as_ref().map(|s| s.split_alignment).filter(|&a| a > 0) {
            req = req.aligned(align)?;
        }
        if shard.lock().released {
            return Err(Error::InvalidValue(format!("pool {pool} was released on device {}", self.device)));
        }
        let ptr = self.malloc_req(&shard, &req, false, capturing).map_err(|e| *e)?;
        self.note_pool_peak(pool);
        Ok(ptr)
    }

    /// Raises the pool's peaks to its current values.
    pub(super) fn note_pool_peak(&self, pool: u64) {
        let (current, _, _) = sum_pool(&self.shards, pool);
        let mut ps = self.pools.state.lock();
        if let Some(e) = ps.pools.get_mut(&pool) {
            for (p, c) in e.peak.iter_mut().zip(current) {
                *p = (*p).max(c);
            }
        }
    }

    /// Sets each pool's peaks to their current values (with the device's,
    /// `reset_peak_stats`).
    pub(in crate::caching) fn reset_pool_peaks(&self) {
        let ids: Vec<u64> = self.pools.state.lock().pools.keys().copied().collect();
        for pool in ids {
            let (current, _, _) = sum_pool(&self.shards, pool);
            if let Some(e) = self.pools.state.lock().pools.get_mut(&pool) {
                e.peak = current;
            }
        }
    }

    /// `f()` unless `pool` was released on this device (`None` then), under the pools' lock:
    /// [`DeviceAllocator::prune_released`] forgets a released pool's budget under the same lock,
    /// so what `f` sets for a pool not released yet cannot outlive its release (a limit set while
    /// the pool is released and forgotten, `tests/fallback/hostile_limits.rs`).
    pub(in crate::caching) fn unless_released<T>(&self, pool: u64, f: impl FnOnce() -> T) -> Option<T> {
        let ps = self.pools.state.lock();
        (!ps.is_released(pool)).then(f)
    }

    /// The statistics of `pool` on this device: zero when it was never used here.
    pub fn pool_stats(&self, pool: u64) -> PoolStats {
        let (current, allocated, freed) = sum_pool(&self.shards, pool);
        let mut ps = self.pools.state.lock();
        let routes = ps.routes.iter().filter(|r| r.pool == pool).count();
        let (peak, released) = match ps.pools.get_mut(&pool) {
            Some(e) => {
                for (p, c) in e.peak.iter_mut().zip(current) {
                    *p = (*p).max(c);
                }
                (e.peak, e.released)
            }
            None => (current, ps.released.contains(&pool)),
        };
        let t = Totals { peak, current, allocated, freed, ..Totals::default() };
        let mut stats = counters::collect(&t, &DeviceCounters::default(), self.max_split_size);
        stats.max_split_size = i64::try_from(self.max_split_size).unwrap_or(i64::MAX);
        stats.sleeping_bytes = self.sleepers.pool_stat(pool);
        PoolStats { pool, stats: DeviceStats { pool_limit: self.pool_limit(pool), ..stats }, released, routes }
    }

    /// Every pool routed to on this device, by id, with its statistics.
    pub fn all_pool_stats(&self) -> Vec<PoolStats> {
        self.prune_released();
        let mut ids: Vec<u64> = self.pools.state.lock().pools.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter().map(|p| self.pool_stats(p)).collect()
    }

    /// The pool-level invariants: the route count matches the routes; no route to a released
    /// pool; every private shard's pool is known, and released exactly when its pool is; a
    /// segment is kept for a graph only in a live private pool.
    pub(in crate::caching) fn check_pools(
        &self,
        list: &[Arc<Shard>],
        states: &[&crate::caching::shard::ShardState],
    ) -> Result<(), String> {
        let ps = self.pools.state.lock();
        if self.capture.routed() != ps.routes.len() {
            return Err(format!("{} routes counted, {} active", self.capture.routed(), ps.routes.len()));
        }
        for r in &ps.routes {
            if ps.pools.get(&r.pool).is_none_or(|p| p.released) || ps.released.contains(&r.pool) {
                return Err(format!("a route leads to pool {}, which is released or unknown", r.pool));
            }
        }
        for (shard, st) in list.iter().zip(states) {
            let graph = st.graph_segments();
            if shard.pool == 0 {
                if graph != 0 || st.released {
                    return Err(format!(
                        "stream {:#x} of the default pools is marked as a private pool's",
                        shard.stream
                    ));
                }
                continue;
            }
            let released = match ps.pools.get(&shard.pool) {
                Some(p) => p.released,
                None if ps.released.contains(&shard.pool) => {
                    if st.segment_count() != 0 {
                        return Err(format!(
                            "pool {} was forgotten, but stream {:#x} holds memory of it",
                            shard.pool, shard.stream
                        ));
                    }
                    true
                }
                None => {
                    return Err(format!(
                        "stream {:#x} holds memory of pool {}, which is unknown",
                        shard.stream, shard.pool
                    ));
                }
            };
            if released != st.released {
                return Err(format!(
                    "pool {}: stream {:#x} disagrees on whether it is released",
                    shard.pool, shard.stream
                ));
            }
            if st.released && graph != 0 {
                return Err(format!("released pool {} still keeps {graph} segment(s) for a graph", shard.pool));
            }
        }
        Ok(())
    }
}

/// Takes the routes to `pool` out of `routes`, in order.
fn take_routes(routes: &mut Vec<Route>, pool: u64) -> Vec<Route> {
    let (ended, kept): (Vec<Route>, Vec<Route>) = routes.drain(..).partition(|r| r.pool == pool);
    *routes = kept;
    ended
}

/// The current, allocated and freed sums of `pool`'s shards, each locked in turn.
fn sum_pool(shards: &ShardTable, pool: u64) -> ([i64; CELLS], [i64; CELLS], [i64; CELLS]) {
    let (mut current, mut allocated, mut freed) = ([0; CELLS], [0; CELLS], [0; CELLS]);
    for shard in shards.of_pool(pool) {
        let st = shard.lock();
        for (i, c) in (0..CELLS).map(|i| st.counters.cell(i)).enumerate() {
            current[i] += c.current();
            allocated[i] += c.allocated;
            freed[i] += c.freed;
        }
    }
    (current, allocated, freed)
}
