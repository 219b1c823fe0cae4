//! The copying half of a pool's sleep and wake on one device (see `device`): each
//! stream's live blocks to a host copy of its own and back, and where each host copy comes
//! from and goes back to. [`SleepMode::Offload`]: pageable memory (`driver::pageable`),
//! mapped at sleep, copied through the device's pinned staging ring (`copy`, `staging`), and
//! unmapped at wake. [`SleepMode::OffloadPinned`]: pinned memory the pool keeps between its
//! sleeps (`pinned_copies`), copied to and from directly (`copy_direct`).

use std::sync::Arc;

use super::copy::{Copier, Copies, HostCopy, Way, free_host};
use super::copy_direct::Direct;
use super::copy_threads::{Crew, crew_size};
use super::pinned_copies::{self, Pinned};
use super::shard::{ShardSleep, SleepHost};
use super::sleepers::SleepMode;
use crate::caching::device::DeviceAllocator;
use crate::caching::shard::{Shard, ShardState};
use crate::driver::DriverError;
use crate::error::Error;

impl DeviceAllocator {
    /// The copying half of a sleep that offloads (`mode`): each stream's work waited for and
    /// its live blocks copied to a host copy of its own; what each stream will keep asleep
    /// appended to `into` as soon as it is made (the caller gives the host copies back if
    /// anything fails). Returns once every copy has completed.
    ///
    /// Errors: [`Error::OutOfMemory`] when the host cannot pin the ring or give a host copy;
    /// [`Error::Cuda`] when waiting, pinning or copying fails.
    pub(super) fn offload(
        &self,
        pool: u64,
        mode: SleepMode,
        shards: &[Arc<Shard>],
        into: &mut Vec<(Arc<Shard>, ShardSleep)>,
    ) -> Result<(), Error> {
        let fail = |e| Error::driver(e, "copying a pool's live blocks to host memory");
        let settings = self.staging.settings;
        let ring = match mode {
            SleepMode::OffloadPinned => None,
            _ => Some(self.staging.lock(&*self.driver, self.device).map_err(|e| self.staging_error(e))?),
        };
        // Host copies of streams whose copies could not be queued: given back once the copy
        // streams are synchronised (direct copies queued into a pinned one may still run, and
        // another thread's `sleep_release_kept` would unmap it under them).
        let failed = scopeguard::guard(std::cell::RefCell::new(Vec::new()), |f| {
            for h in f.into_inner() {
                self.give_host(pool, h);
            }
        });
        let r = std::thread::scope(|scope| {
            let crew = Crew::new(scope, crew_size(settings.threads));
            let mut copies: Box<dyn Copies> = match &ring {
                Some(ring) => {
                    Box::new(Copier::new(&*self.driver, self.device, Way::Offload, ring, &crew).map_err(fail)?)
                }
                None => Box::new(Direct::new(&*self.driver, self.device, Way::Offload).map_err(fail)?),
            };
            for shard in shards {
                let ctx = self.ctx(shard);
                let mut st = self.shards.lock_for_change(shard);
                let r = st.wait_for_work(&ctx).and_then(|()| {
                    let need = st.live_bytes();
                    // Given back if the copies cannot be queued, or a driver call unwinds.
                    let host =
                        scopeguard::guard(self.host_copy(pool, mode, need, &crew)?, |h| failed.borrow_mut().push(h));
                    let prep = st.prepare_sleep(&mut *copies, mode, *host)?;
                    scopeguard::ScopeGuard::into_inner(host);
                    Ok(prep)
                });
                self.finish(st, ());
                into.push((shard.clone(), r?));
            }
            copies.finish().map_err(fail)
        });
        drop(failed);
        r?;
        // Copies the pool kept and this sleep did not use (its streams hold less, or fewer
        // streams hold memory) go back; the sleep goes through from here.
        self.release_kept(pool);
        Ok(())
    }

    /// A host copy of `need` bytes for a stream of `pool` sleeping in `mode`: pageable memory
    /// mapped now, or a pinned copy the pool keeps (the smallest that holds `need`), or one
    /// pinned now with `crew`.
    fn host_copy(&self, pool: u64, mode: SleepMode, need: usize, crew: &Crew) -> Result<SleepHost, Error> {
        if need == 0 {
            return Ok(SleepHost::default());
        }
        let huge = self.staging.settings.huge_pages;
        let oom = |e| match e {
            DriverError::OutOfMemory => Error::OutOfMemory(format!(
                "the host cannot give {need} bytes of memory for the copy of a pool's live blocks (gpupool_sleep); \
                 nothing changed"
            )),
            e => Error::driver(e, "making the host memory of a pool's copy"),
        };
        if mode != SleepMode::OffloadPinned {
            let copy = HostCopy::new(&*self.driver, need, huge).map_err(oom)?;
            let (ptr, used) = copy.keep();
            return Ok(SleepHost { ptr, used, pinned: 0 });
        }
        let copy = match self.kept.take(pool, need) {
            Some(c) => c,
            None => pinned_copies::pin(&*self.driver, self.device, need, huge, crew).map_err(oom)?,
        };
        Ok(SleepHost { ptr: copy.ptr, used: need, pinned: copy.size })
    }

    /// Gives a host copy back: a pinned one to the pool's kept copies, a pageable one to the
    /// system. Never panics.
    pub(super) fn give_host(&self, pool: u64, host: SleepHost) {
        match host.pinned {
            0 => free_host(&*self.driver, (host.ptr, host.used)),
            size => {
                // A pool released meanwhile keeps nothing: the copy goes back to the system.
                if let Some(copy) = self.kept.put(pool, Pinned { ptr: host.ptr, size }) {
                    let _ = pinned_copies::unpin(&*self.driver, self.device, copy);
                }
            }
        }
    }

    /// Unpins and unmaps every pinned copy `pool` keeps (see `pinned_copies`): none is in use (a
    /// sleeping pool's copy is not in the store). Returns the bytes unpinned (a copy the driver
    /// would not unregister stays pinned, leaked, and is not counted).
    pub(crate) fn release_kept(&self, pool: u64) -> usize {
        let copies = self.kept.drain(pool);
        copies.into_iter().filter(|&c| pinned_copies::unpin(&*self.driver, self.device, c)).map(|c| c.size).sum()
    }

    /// As [`DeviceAllocator::release_kept`] for a released pool, which keeps no copy from
    /// now on: one its wake or failed sleep gives back later (a sleep that began before the
    /// release marked it) is unpinned then.
    pub(in crate::caching) fn close_kept(&self, pool: u64) {
        for c in self.kept.close(pool) {
            let _ = pinned_copies::unpin(&*self.driver, self.device, c);
        }
    }

    /// Bytes of pinned host memory kept for `pool`'s next sleep (`None`: every pool of the
    /// device); a sleeping pool's copy is in use, not kept, and not counted.
    pub(crate) fn kept_bytes(&self, pool: Option<u64>) -> usize {
        self.kept.bytes(pool)
    }

    /// Puts the host copies of `shards` back (see `ShardState::restore`) and waits for them:
    /// directly from pinned copies, through the staging ring from pageable ones.
    ///
    /// Errors: [`Error::OutOfMemory`] when the ring cannot be pinned; [`Error::Cuda`] when a
    /// copy fails.
    pub(super) fn restore(&self, shards: &[Arc<Shard>]) -> Result<(), Error> {
        let fail = |e| Error::driver(e, "copying a sleeping pool's blocks back from host memory");
        let (pinned, pageable): (Vec<&Arc<Shard>>, Vec<&Arc<Shard>>) =
            shards.iter().partition(|s| s.lock().pinned_copy());
        if !pinned.is_empty() {
            let mut direct = Direct::new(&*self.driver, self.device, Way::Restore).map_err(fail)?;
            for shard in &pinned {
                shard.lock().restore(&mut direct).map_err(fail)?;
            }
            direct.finish().map_err(fail)?;
        }
        if pageable.iter().all(|s| !s.lock().offloaded()) {
            return Ok(());
        }
        let ring = self.staging.lock(&*self.driver, self.device).map_err(|e| self.staging_error(e))?;
        std::thread::scope(|scope| {
            let crew = Crew::new(scope, crew_size(self.staging.settings.threads));
            let mut copier = Copier::new(&*self.driver, self.device, Way::Restore, &ring, &crew).map_err(fail)?;
            for shard in &pageable {
                shard.lock().restore(&mut copier).map_err(fail)?;
            }
            copier.finish().map_err(fail)
        })
    }

    /// The kept copies' part of the device's consistency check: no two of them, nor one and
    /// a sleeping stream's host copy, share a byte (a copy owned twice would be written by two
    /// sleeps, or unpinned under one); a pool asleep in a mode other than
    /// [`SleepMode::OffloadPinned`] keeps none (its sleep gave them back).
    pub(in crate::caching) fn check_kept(&self, list: &[Arc<Shard>], states: &[&ShardState]) -> Result<(), String> {
        let kept = self.kept.all();
        let mut ranges: Vec<(usize, usize, String)> =
            kept.iter().map(|(p, c)| (c.ptr, c.size, format!("a pinned copy pool {p:#x} keeps"))).collect();
        for (shard, st) in list.iter().zip(states) {
            let Some((mode, host)) = st.sleep_host() else { continue };
            if mode != SleepMode::OffloadPinned && kept.iter().any(|(p, _)| *p == shard.pool) {
                return Err(format!("pool {:#x} sleeps in mode {mode:?}, but keeps a pinned copy", shard.pool));
            }
            if host.ptr != 0 {
                let what = format!("the host copy of sleeping stream {:#x}", shard.stream);
                ranges.push((host.ptr, host.pinned.max(host.used), what));
            }
        }
        if let Some((p, _)) = kept.iter().find(|(p, _)| self.kept.closed(*p)) {
            return Err(format!("pool {p:#x} was released, but keeps a pinned copy"));
        }
        ranges.sort_unstable_by_key(|r| r.0);
        for w in ranges.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!("{} at {:#x} overlaps {} at {:#x}", w[0].2, w[0].0, w[1].2, w[1].0));
            }
        }
        Ok(())
    }

    /// The error of a staging ring the driver would not give.
    pub(super) fn staging_error(&self, e: DriverError) -> Error {
        let s = self.staging.settings;
        match e {
            DriverError::OutOfMemory => Error::OutOfMemory(format!(
                "the host cannot pin the staging buffers of device {} for gpupool_sleep and gpupool_wake ({} of {} \
                 bytes, GPUPOOL_SLEEP_BUFFERS and GPUPOOL_SLEEP_CHUNK); nothing changed",
                self.device, s.buffers, s.chunk
            )),
            e => Error::driver(e, "pinning the staging buffers of sleep and wake"),
        }
    }
}
