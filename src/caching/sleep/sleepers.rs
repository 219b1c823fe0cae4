//! Sleep and wake (`gpupool_sleep`, `gpupool_wake`): a pool gives its device memory back to the
//! driver and gets it back later at the same addresses, its live blocks' contents kept in
//! host memory meanwhile ([`SleepMode::Offload`]) or dropped ([`SleepMode::Discard`]).
//! Not in PyTorch; what vLLM's sleep mode (`CuMemAllocator`), SGLang's torch_memory_saver and
//! TensorRT-LLM's `releaseWithTag` do beside an allocator, done inside one.
//!
//! Which memory can sleep: memory on the virtual memory API (expandable segments), whose
//! physical pages can be unmapped and released while the addresses stay reserved. The default
//! pools' segments are expandable when `expandable_segments` is on (the default) and the
//! driver can map memory; a private pool's are when it was made with
//! `gpupool_pool_create_sleepable` (its id carries [`SLEEPABLE_BIT`]), captured graphs
//! included. A pool that holds an ordinary segment (`cuMemAlloc`) cannot sleep, and
//! `gpupool_sleep` says so, changing nothing.
//!
//! Here: the modes, which pools may sleep, and each device's record of its sleeping pools
//! ([`Sleepers`]). The mechanism: `shard` (one stream's share: waiting, copying, unmapping,
//! mapping again), `device` (a pool: its streams, all or nothing, the memory limit), `copy`
//! (the copies, pipelined), `staging` (the pinned ring), `copy_threads` (the CPU threads).
//! The rules are in docs/sleep.md.

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::stats::Stat;

/// The bit of a private pool's id that says it may sleep (its segments are expandable): set
/// by `gpupool_pool_create_sleepable`, so that which pools may sleep costs no lookup.
pub(crate) const SLEEPABLE_BIT: u64 = 1 << 62;

/// Whether private pool `pool`'s segments are expandable, so that it may sleep.
#[inline]
pub(crate) fn sleepable(pool: u64) -> bool {
    pool & SLEEPABLE_BIT != 0
}

/// What a sleep does with the contents of the pool's live blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepMode {
    /// Copied to host memory before the memory goes, and back at wake, bit for bit
    /// (weights).
    Offload,
    /// Dropped: after wake the blocks hold whatever the new memory holds (KV cache,
    /// activations).
    Discard,
    /// As [`SleepMode::Offload`], into pinned host memory that the copy engines write and read
    /// directly, and that the pool keeps after wake for its next sleep (see `pinned_copies`):
    /// from the second sleep on, sleep and wake copy at the bus's speed; meanwhile the pool's
    /// live bytes stay pinned in host memory.
    OffloadPinned,
}

impl SleepMode {
    /// Whether the live blocks' contents are copied to host memory and back.
    pub fn offloads(self) -> bool {
        self != SleepMode::Discard
    }
}

/// One sleeping pool of a device.
#[derive(Clone, Copy, Debug)]
struct PoolSleep {
    /// Bytes of pages given back (the pool's reserved bytes when it went to sleep); 0 until
    /// its pages are unmapped.
    bytes: usize,
    /// A sleep or a wake of the pool is under way: another is refused.
    busy: bool,
}

#[derive(Default)]
struct SleepersState {
    pools: FxHashMap<u64, PoolSleep>,
    /// Sleeping bytes of the device: pages given back by sleeping pools.
    stat: Stat,
    /// Each pool's sleeping bytes, kept after it wakes (its peak and totals), from its first
    /// sleep on.
    per_pool: FxHashMap<u64, Stat>,
}

/// Adds `change` bytes to `s` (a sleep gave pages back, or a failed wake's pages went again,
/// when positive; a wake took them when negative).
fn account(s: &mut Stat, change: i64) {
    s.current += change;
    if change >= 0 {
        s.allocated += change;
    } else {
        s.freed -= change;
    }
    s.peak = s.peak.max(s.current);
}

/// A device's sleeping pools (0: the default pools) and their statistic. A leaf of the lock
/// order: taken with or without a shard's lock, never held while taking another.
#[derive(Default)]
pub(crate) struct Sleepers {
    state: Mutex<SleepersState>,
}

impl Sleepers {
    /// Whether `pool` sleeps (or is going to sleep, or waking).
    pub fn is_asleep(&self, pool: u64) -> bool {
        self.state.lock().pools.contains_key(&pool)
    }

    /// Marks `pool` asleep, with no bytes yet and its sleep under way; false when it was
    /// asleep already.
    pub fn begin(&self, pool: u64) -> bool {
        let mut st = self.state.lock();
        if st.pools.contains_key(&pool) {
            return false;
        }
        st.pools.insert(pool, PoolSleep { bytes: 0, busy: true });
        true
    }

    /// Marks the wake of `pool` under way. `Err(true)`: it does not sleep; `Err(false)`: a
    /// sleep or wake of it is under way already.
    pub fn begin_wake(&self, pool: u64) -> Result<(), bool> {
        let mut st = self.state.lock();
        match st.pools.get_mut(&pool) {
            None => Err(true),
            Some(p) if p.busy => Err(false),
            Some(p) => {
                p.busy = true;
                Ok(())
            }
        }
    }

    /// The sleep or the failed wake of `pool` is over: it sleeps, and may be woken.
    pub fn settle(&self, pool: u64) {
        if let Some(p) = self.state.lock().pools.get_mut(&pool) {
            p.busy = false;
        }
    }

    /// Sets the sleeping bytes of `pool` (the pages its streams gave back), and the device's
    /// with them.
    pub fn set_bytes(&self, pool: u64, bytes: usize) {
        let mut st = self.state.lock();
        if let Some(p) = st.pools.get_mut(&pool) {
            let change = bytes as i64 - std::mem::replace(&mut p.bytes, bytes) as i64;
            account(&mut st.stat, change);
            account(st.per_pool.entry(pool).or_default(), change);
        }
    }

    /// `pool` is awake: forgets it and its bytes.
    pub fn end(&self, pool: u64) {
        let mut st = self.state.lock();
        if let Some(p) = st.pools.remove(&pool) {
            account(&mut st.stat, -(p.bytes as i64));
            account(st.per_pool.entry(pool).or_default(), -(p.bytes as i64));
        }
    }

    /// The sleeping bytes of `pool` as a statistic: now, its peak (since its first sleep, or
    /// the last [`Sleepers::reset_peak`]) and the bytes its sleeps gave back and its wakes took
    /// again; zeros for a pool that never slept.
    pub fn pool_stat(&self, pool: u64) -> Stat {
        self.state.lock().per_pool.get(&pool).copied().unwrap_or_default()
    }

    /// Forgets the statistic of `pool` (released: its id names nothing any more).
    pub fn forget(&self, pool: u64) {
        self.state.lock().per_pool.remove(&pool);
    }

    /// The device's statistic of sleeping bytes.
    pub fn stat(&self) -> Stat {
        self.state.lock().stat
    }

    /// The peaks, the device's and each pool's, start again from the current value (PyTorch
    /// `resetPeakStats`).
    pub fn reset_peak(&self) {
        let mut st = self.state.lock();
        st.stat.peak = st.stat.current;
        for s in st.per_pool.values_mut() {
            s.peak = s.current;
        }
    }
}
