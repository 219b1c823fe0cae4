//! A pool's sleep and wake on one device (`gpupool_sleep`, `gpupool_wake`; see
//! `caching::sleep`): the pool's streams (shards) one at a time, in two passes each way, so
//! that a failure before the point of no return changes nothing; the memory limit kept to the
//! physical bytes; and the rules a sleeping pool follows (no allocation, no release).
//!
//! Sleep: the pool is marked asleep first (allocations from it are refused from then on);
//! then each stream's work is waited for and, with offload, its live blocks copied to host
//! memory through the staging ring, on copy streams of gpupool's own (`copy`); only once every
//! copy has completed are the pages unmapped and their handles given back. Wake: every page
//! mapped again, all or nothing (the memory limit charged first; a device out of memory
//! releases the cache of the other pools and tries once more); then the copies put back; then
//! the host memory unmapped.
//!
//! Each shard's lock is held only while that shard is worked on, and no other pool's lock is
//! taken: other pools allocate and free throughout.

use std::sync::Arc;

use super::shard::ShardSleep;
use super::sleepers::{SleepMode, sleepable};
use crate::caching::capture;
use crate::caching::device::{DeviceAllocator, expandable_policy};
use crate::caching::shard::{ExpandablePolicy, Request, Shard};
use crate::driver::{DriverError, PhysHandle};
use crate::error::Error;

/// A sleepable pool's layout: `base` with the small and the large pool mapped in pages of
/// `page` bytes (`GPUPOOL_SLEEP_PAGE`, 64 MiB by default, rounded up to the driver's
/// granularity), for every request, not PyTorch's 2 MiB of the small pool (`kSmallBuffer`) nor
/// its 20 MiB of the large one (`kLargeBuffer`), and no ladder of larger pages.
///
/// Why: a sleep unmaps and releases every page and a wake creates and maps every page again,
/// driver calls whose cost is per page, whatever its size (one H200, 4 GiB: 205 pages of 20 MiB
/// took 3.6-5.2 ms to unmap and 3.8-6.7 ms to release, one page of 4 GiB 0.09 and 2 ms:
/// `examples/c/vmm_unmap_cost.c`), and which the driver serialises (on an H100, 49-67 us a page
/// to map and 42-68 us to unmap, from 1 to 16 threads alike). At 2 MiB a page, 40 GiB of blocks
/// of 1 MiB were 20,480 pages, 0.86 s to unmap and 1.14 s to map against 0.78 s for the copy at
/// the bus's speed. At 20 MiB a pinned sleep of 4 GiB ran at 0.84-0.86 of the pinned copy
/// bandwidth and its wake at 0.86; at 64 MiB at 0.91-0.94 and 0.91-0.93; at 160 MiB 0.94 and
/// 0.91-0.92 (one H200, 2026-11-29, `test_sleep bench`, docs/sleep.md). What it costs: a
/// stream's last page of each pool holds up to a page where 2 MiB would do, and a page goes back
/// to the driver (at `empty_cache`) only once all of it is free; for the weights and caches that
/// pools made to sleep hold (gigabytes), a small share; a pool of a few MiB reserves a page of
/// each of its pools.
pub(crate) fn sleepable_layout(base: ExpandablePolicy, page: usize) -> ExpandablePolicy {
    // The driver's granularity divides the default pools' 2 MiB page. The parser takes pages up
    // to `usize::MAX` bytes, whose rounding would pass it (a wrapped page of 0 divided by zero
    // in the first malloc), and the budgets and statistics count bytes as i64, past which a
    // page was refused as over a budget never set: a page is at most the largest multiple of
    // the granularity within i64, which no device maps (its requests are out of memory).
    let small = base.small_page;
    let page = page.clamp(small, i64::MAX as usize / small * small).next_multiple_of(small);
    ExpandablePolicy { small_page: page, large_page: page, huge_page: page, huge_from: usize::MAX, ..base }
}

impl DeviceAllocator {
    /// The expandable layout of sleepable private pools: the default pools' (or one found for
    /// them when the default pools use ordinary segments) with every page `GPUPOOL_SLEEP_PAGE`
    /// bytes ([`sleepable_layout`]); `None` when the driver cannot map memory on the device.
    pub(in crate::caching) fn sleep_policy(&self) -> Option<&ExpandablePolicy> {
        self.sleep_policy
            .get_or_init(|| {
                let base = self.expandable.or_else(|| expandable_policy(&*self.driver, self.device, true, 0))?;
                Some(sleepable_layout(base, self.sleep_page))
            })
            .as_ref()
    }

    /// `e` with a sentence on the page of a sleepable pool, when that page is larger than the
    /// request: its requests map whole pages (`GPUPOOL_SLEEP_PAGE`), so one that fails may
    /// have asked the driver for far more than "Tried to allocate" says, with the device's
    /// memory free (a page larger than the device fails every request).
    pub(in crate::caching) fn sleep_page_note(&self, pool: u64, req: &Request, e: Error) -> Error {
        let page = match self.sleep_policy() {
            Some(p) if pool != 0 && sleepable(pool) => p.large_page,
            _ => return e,
        };
        match e {
            Error::OutOfMemory(m) if page > req.rounded => Error::OutOfMemory(format!(
                "{m} Pool {pool:#x} is sleepable: each of its requests maps whole pages of {} (GPUPOOL_SLEEP_PAGE, \
                 {page} bytes); a smaller page may fit.",
                crate::stats::summary::format_size(page as u64)
            )),
            e => e,
        }
    }

    /// What the messages call `pool`.
    pub(super) fn pool_name(&self, pool: u64) -> String {
        match pool {
            0 => format!("the default pools of device {}", self.device),
            p => format!("pool {p} on device {}", self.device),
        }
    }

    /// Whether `pool` sleeps, or its sleep or wake is under way (from the moment a sleep
    /// begins, before it checks for exported blocks: `gpupool_ipc_export` asks this under the
    /// export table's lock, the sleep reads that table after it began).
    pub(crate) fn sleep_begun(&self, pool: u64) -> bool {
        self.sleepers.is_asleep(pool)
    }

    /// [`Error::InvalidValue`] when `pool` sleeps: nothing may be allocated from it, and it
    /// may not be released, until it wakes.
    pub(in crate::caching) fn refuse_asleep(&self, pool: u64) -> Result<(), Error> {
        if !self.sleepers.is_asleep(pool) {
            return Ok(());
        }
        Err(Error::InvalidValue(format!(
            "{} sleep (gpupool_sleep): nothing can be allocated from them, nor released, until gpupool_wake",
            self.pool_name(pool)
        )))
    }

    /// Why `pool` cannot sleep at all on this device, if it cannot: its memory is not on the
    /// virtual memory API.
    pub(super) fn cannot_sleep(&self, pool: u64) -> Option<String> {
        let name = self.pool_name(pool);
        if pool != 0 && !sleepable(pool) {
            return Some(format!(
                "{name} cannot sleep: its segments are ordinary device memory (cuMemAlloc), whose physical memory \
                 cannot be given back while its addresses are kept; create the pool with \
                 gpupool_pool_create_sleepable, whose segments are on the virtual memory API"
            ));
        }
        let vmm = if pool == 0 { self.expandable.is_some() } else { self.sleep_policy().is_some() };
        if !vmm {
            let why = if pool == 0 && self.driver.vmm_granularity(self.device).ok().flatten().is_some() {
                "expandable_segments is off (GPUPOOL_CONF), so its segments are ordinary device memory (cuMemAlloc)"
            } else {
                "the driver cannot map memory there (no virtual memory management), so its segments are ordinary"
            };
            return Some(format!("{name} cannot sleep: {why}"));
        }
        None
    }

    /// Puts `pool` (0: the default pools) to sleep (see the module and `caching::sleep`).
    ///
    /// Errors, each leaving everything as it was: [`Error::InvalidValue`] when the pool cannot
    /// sleep (its memory is not on the virtual memory API, naming why, or it holds an ordinary
    /// segment), sleeps already, or was released; [`Error::Capture`] while a capture may be
    /// under way; [`Error::OutOfMemory`] when the host cannot pin the ring or give the copy; [`Error::Cuda`]
    /// when waiting or copying fails. Once every copy has completed the pool sleeps whatever
    /// happens: a page the driver would not unmap stays mapped, a handle it would not release
    /// stays held by the device, and the error ([`Error::Cuda`]) says the pool sleeps.
    ///
    /// `refuse` runs once the sleep has begun (so that no export of the pool can begin after
    /// it: `DeviceAllocator::sleep_begun`), before anything is copied; its error ends the
    /// sleep with nothing changed.
    pub fn sleep(&self, pool: u64, mode: SleepMode, refuse: impl FnOnce() -> Result<(), Error>) -> Result<(), Error> {
        let name = self.pool_name(pool);
        if let Some(why) = self.cannot_sleep(pool) {
            return Err(Error::InvalidValue(why));
        }
        if pool != 0 && self.pool_stats(pool).released {
            return Err(Error::InvalidValue(format!("{name} was released: it holds nothing to put to sleep")));
        }
        if self.capture.any_underway() {
            return Err(capture::refused_during_capture(self.device, "putting a pool to sleep"));
        }
        let shards = self.shards.of_pool(pool);
        for shard in &shards {
            if let Some((base, size)) = shard.lock().ordinary_segment() {
                return Err(Error::InvalidValue(format!(
                    "{name} cannot sleep: it holds an ordinary segment at {base:#x} ({size} bytes, made with cuMemAlloc \
                     when the virtual memory calls failed), whose memory cannot be given back while its address is \
                     kept; free its blocks and call gpupool_empty_cache first"
                )));
            }
        }
        if !self.sleepers.begin(pool) {
            return Err(Error::InvalidValue(format!(
                "{name} sleep already: a second gpupool_sleep changes nothing; call gpupool_wake first"
            )));
        }
        self.capture.set_default_asleep(self.capture.default_asleep() || pool == 0);
        // Awake again if anything fails before the pages go.
        let awake = scopeguard::guard((), |()| self.end_sleep(pool));
        refuse()?;
        if shards.iter().any(|s| s.lock().has_deferred_sync()) {
            // Blocks freed with free_after_device_sync: the streams that used them are unknown.
            self.release_deferred()?;
        }
        let mut prepared: Vec<(Arc<Shard>, ShardSleep)> = Vec::with_capacity(shards.len());
        // The host copies made so far are unmapped if a later step fails.
        let mut copies = scopeguard::guard(&mut prepared, |p| {
            for (shard, s) in p.drain(..) {
                shard.lock().abandon_sleep();
                self.give_host(pool, s.discard());
            }
        });
        match mode {
            SleepMode::Offload | SleepMode::OffloadPinned => self.offload(pool, mode, &shards, &mut copies)?,
            SleepMode::Discard => {
                for shard in &shards {
                    let ctx = self.ctx(shard);
                    let mut st = self.shards.lock_for_change(shard);
                    st.wait_for_work(&ctx)?;
                    let prep = st.prepare_discard();
                    self.finish(st, ());
                    copies.push((shard.clone(), prep));
                }
            }
        }
        let prepared = std::mem::take(&mut *scopeguard::ScopeGuard::into_inner(copies));
        scopeguard::ScopeGuard::into_inner(awake);
        if mode != SleepMode::OffloadPinned {
            // The pool sleeps in another mode: it keeps no pinned copy any more.
            self.release_kept(pool);
        }
        // The point of no return: the pages go. What was unmapped is accounted for whatever
        // happens, a driver call that unwinds included.
        // Every stream goes to sleep, even after one whose driver call unwound.
        let (mut handles, mut failure, mut gone) = (Vec::new(), None, Ok(()));
        for (shard, prep) in prepared {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let ctx = self.ctx(&shard);
                let mut st = self.shards.lock_for_change(&shard);
                // Frees that came meanwhile with record_stream may have queued events.
                let _ = st.synchronize_events(&ctx);
                if let Err(e) = st.sleep_pages(&ctx, prep, &mut handles) {
                    failure.get_or_insert(e);
                }
                self.finish(st, ());
            }));
            gone = gone.and(r);
        }
        let slept: usize = shards.iter().map(|s| s.lock().slept_bytes()).sum();
        self.sleepers.set_bytes(pool, slept);
        self.sleepers.settle(pool);
        if let Some(e) = self.give_back(&mut handles) {
            failure.get_or_insert(e);
        }
        if let Err(panic) = gone {
            std::panic::resume_unwind(panic);
        }
        match failure {
            None => Ok(()),
            Some(e) => Err(Error::driver(
                e,
                "giving a sleeping pool's pages back to the driver (the pool sleeps all the same: wake it with \
                 gpupool_wake; what the driver kept stays mapped or held)",
            )),
        }
    }

    /// Bytes of pinned host memory the device's staging ring holds (see `staging`).
    pub fn staging_bytes(&self) -> usize {
        self.staging.bytes()
    }

    /// Marks `pool` awake in the device's records.
    fn end_sleep(&self, pool: u64) {
        self.sleepers.end(pool);
        if pool == 0 {
            self.capture.set_default_asleep(false);
        }
    }

    /// Gives the handles of `handles` (page bytes, handle), mapped nowhere and counted by the
    /// memory limit, back to the driver (`cuMemRelease`), each uncharged once the driver has
    /// it; one the driver refuses, and those left when a call unwinds, go to the device's page
    /// pool, still counted, for the next release. Returns the first failure.
    fn give_back(&self, handles: &mut Vec<(usize, PhysHandle)>) -> Option<DriverError> {
        let hold = |rest: Vec<(usize, PhysHandle)>| {
            for (page, h) in rest {
                self.pages.put(page, &mut vec![h]);
            }
        };
        let mut rest = scopeguard::guard(std::mem::take(handles), hold);
        let mut failure = None;
        while let Some((page, h)) = rest.last().copied() {
            match self.driver.mem_release(self.device, h) {
                Ok(()) => {
                    rest.pop();
                    self.limit.uncharge(page);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                    rest.pop();
                    self.pages.put(page, &mut vec![h]);
                }
            }
        }
        failure
    }

    /// Wakes `pool` (0: the default pools; see the module). A device out of memory first
    /// releases the cache of the device's other pools (as `empty_cache`) and tries again.
    ///
    /// Errors, each leaving the pool asleep with its host copy: [`Error::InvalidValue`] when
    /// it does not sleep; [`Error::Capture`] while a capture may be under way;
    /// [`Error::OutOfMemory`] when the device (or its memory fraction) cannot give the pages;
    /// [`Error::Cuda`] when mapping or copying fails.
    pub fn wake(&self, pool: u64) -> Result<(), Error> {
        if self.capture.any_underway() {
            return Err(capture::refused_during_capture(self.device, "waking a pool"));
        }
        if let Err(asleep) = self.sleepers.begin_wake(pool) {
            let name = self.pool_name(pool);
            return Err(Error::InvalidValue(match asleep {
                true => format!("{name} do not sleep: nothing to wake (a second gpupool_wake changes nothing)"),
                false => format!("{name} are being put to sleep or woken by another thread: nothing done"),
            }));
        }
        // Asleep still, and wakeable, if anything fails (unwinding included).
        let busy = scopeguard::guard((), |()| self.sleepers.settle(pool));
        let r = match self.try_wake(pool) {
            Err(Error::OutOfMemory(_)) => {
                let _ = self.release_cached_blocks();
                self.try_wake(pool)
            }
            r => r,
        };
        if r.is_ok() {
            // Awake: its record is gone, and one there now is a sleep another thread began
            // since, busy until that sleep settles it (settling it here let a wake run beside
            // that sleep's copies: tests/sleep/faults.rs, two threads).
            scopeguard::ScopeGuard::into_inner(busy);
        }
        r
    }

    /// One attempt of [`DeviceAllocator::wake`].
    fn try_wake(&self, pool: u64) -> Result<(), Error> {
        let shards: Vec<Arc<Shard>> = self.shards.of_pool(pool).into_iter().filter(|s| s.lock().is_asleep()).collect();
        let need: usize = shards.iter().map(|s| s.lock().slept_bytes()).sum();
        let oom = || {
            Error::OutOfMemory(format!(
                "waking {} needs {need} bytes of device memory, which the device (or its memory fraction) cannot \
                 give even after its cache was released: the pool still sleeps, its host copy intact; free memory \
                 and call gpupool_wake again",
                self.pool_name(pool)
            ))
        };
        let charge = self.limit.try_charge(need).ok_or_else(oom)?;
        let mapped = |shards: &[Arc<Shard>]| shards.iter().map(|s| s.lock().mapped_bytes() as isize).sum::<isize>();
        let before = mapped(&shards);
        let mut spare = Vec::new();
        // A driver call that unwinds is undone as a failure is, then the unwinding goes on.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for shard in &shards {
                let ctx = self.ctx(shard);
                let mut st = self.shards.lock_for_change(shard);
                let r = st.map_slept(&ctx, &mut spare);
                self.finish(st, ());
                r.map_err(|e| match e {
                    DriverError::OutOfMemory => oom(),
                    e => Error::driver(e, "mapping a sleeping pool's pages again"),
                })?;
            }
            if shards.iter().any(|s| s.lock().offloaded()) {
                self.restore(&shards)?;
            }
            Ok(())
        }));
        if !matches!(result, Ok(Ok(()))) {
            // Asleep again, all of it: the pages mapped go back, the host copies stay.
            // Every stream, even after one whose driver call unwound; the first panic goes on
            // once the accounts are settled.
            let mut unwound = None;
            for shard in shards.iter().rev() {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let ctx = self.ctx(shard);
                    let mut st = self.shards.lock_for_change(shard);
                    let _ = st.unmap_woken(&ctx, &mut spare);
                    self.finish(st, ());
                }));
                if let Err(p) = r {
                    unwound.get_or_insert(p);
                }
            }
            // The handles go back through the page pool, counted until the driver has them.
            let held: usize = spare.iter().map(|s| s.0).sum();
            charge.settle(mapped(&shards) - before + held as isize);
            // Pages a failed sleep had left mapped may be slept now. Counted before the
            // handles go back, whose release may unwind.
            self.sleepers.set_bytes(pool, shards.iter().map(|s| s.lock().slept_bytes()).sum());
            self.give_back(&mut spare);
            return match (result, unwound) {
                (Err(panic), _) | (Ok(_), Some(panic)) => std::panic::resume_unwind(panic),
                (Ok(r), None) => r,
            };
        }
        charge.settle(mapped(&shards) - before);
        let (pinned, pageable): (Vec<_>, Vec<_>) =
            shards.iter().map(|s| s.lock().finish_wake()).partition(|h| h.pinned != 0);
        // Pinned copies go back to the pool's kept ones while it still sleeps (no driver
        // call): a sleep in another mode or a `release_pool` that begins once it is awake finds
        // them there and gives them back (given back after, one stayed pinned beside a pool
        // asleep in another mode, or released: tests/sleep/pinned_hostile.rs).
        for host in pinned {
            self.give_host(pool, host);
        }
        self.end_sleep(pool);
        // Pageable host copies go last, once the pool is awake (`munmap` takes a while).
        for host in pageable {
            self.give_host(pool, host);
        }
        Ok(())
    }
}

impl DeviceAllocator {
    /// The sleep's part of the device's consistency check: a private pool that may not sleep
    /// holds no expandable segment; the shards of a sleeping pool sleep (but those that hold
    /// nothing) and those of a pool awake do not; the device's sleeping bytes are the pages its
    /// shards slept. Returns those bytes.
    pub(in crate::caching) fn check_sleepers(
        &self,
        list: &[Arc<Shard>],
        states: &[&crate::caching::shard::ShardState],
    ) -> Result<i64, String> {
        let mut slept = 0;
        for (shard, st) in list.iter().zip(states) {
            let p = shard.pool;
            if p != 0 && !sleepable(p) && st.mapped_bytes() + st.slept_bytes() != 0 {
                return Err(format!("pool {p} may not sleep, but holds expandable segments"));
            }
            let asleep = self.sleepers.is_asleep(p);
            if st.keeps_pages() && !st.is_asleep() && !asleep {
                return Err(format!(
                    "{}: stream {:#x} keeps its pages for a sleep, but its pool is not going to sleep",
                    self.pool_name(p),
                    shard.stream
                ));
            }
            if st.is_asleep() != asleep && (st.is_asleep() || st.segment_count() != 0) {
                return Err(format!(
                    "{}: stream {:#x} says it sleeps: {}, its pool: {asleep}",
                    self.pool_name(p),
                    shard.stream,
                    st.is_asleep()
                ));
            }
            slept += st.slept_bytes();
        }
        let stat = self.sleepers.stat().current;
        if stat != slept as i64 {
            return Err(format!("{slept} bytes of pages sleep, but the statistic says {stat}"));
        }
        Ok(stat)
    }
}
