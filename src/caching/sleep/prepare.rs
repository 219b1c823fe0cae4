//! A pool's host memory made ready before its first sleep (`gpupool_sleep_prepare`): with
//! [`SleepMode::OffloadPinned`], a pinned host copy per stream of the pool, sized to the
//! stream's live bytes now, pinned as the sleep pins (mapped, faulted in by the copy threads,
//! registered: `pinned_copies::pin`) and put with the copies the pool keeps between its sleeps
//! (`pinned_copies`), so that the first sleep finds them there and copies at the bus's speed
//! as the next ones do; with [`SleepMode::Offload`], the device's staging ring pinned
//! (`staging`); with [`SleepMode::Discard`], nothing (it copies nothing). Not in PyTorch; vLLM
//! allocates its pinned CPU backup before the first sleep likewise (PR #58066).
//!
//! A stream whose live bytes grow past its prepared copy (or fall under half of it,
//! `pinned_copies::SLACK`) before the sleep pins a new one at the sleep, as with no prepare;
//! the sleep gives back the prepared copies it did not use.

use super::copy_threads::{Crew, crew_size};
use super::pinned_copies::{self, Pinned};
use super::sleepers::SleepMode;
use crate::caching::device::DeviceAllocator;
use crate::driver::DriverError;
use crate::error::Error;

impl DeviceAllocator {
    /// Makes `pool`'s (0: the default pools) host memory ready for a sleep in `mode` (see the
    /// module) and returns the pinned bytes the pool keeps now (`mode` pinned) or the staging
    /// ring's (offload), 0 for discard. A stream already keeping a copy that fits pins nothing:
    /// a second prepare, or one after a sleep in the pinned mode, makes no driver call.
    ///
    /// Errors, each leaving the pool awake and its kept copies as they were:
    /// [`Error::InvalidValue`] when the pool cannot sleep (as [`DeviceAllocator::sleep`] says
    /// why), was released, or sleeps (its copy is in use); [`Error::OutOfMemory`] when the host
    /// cannot map or pin a copy (or the ring); [`Error::Cuda`] when registering fails.
    pub(crate) fn sleep_prepare(&self, pool: u64, mode: SleepMode) -> Result<usize, Error> {
        let name = self.pool_name(pool);
        if let Some(why) = self.cannot_sleep(pool) {
            return Err(Error::InvalidValue(why));
        }
        if pool != 0 && self.pool_stats(pool).released {
            return Err(Error::InvalidValue(format!("{name} was released: it holds nothing to prepare a sleep for")));
        }
        if self.sleepers.is_asleep(pool) {
            return Err(Error::InvalidValue(format!(
                "{name} sleep (or a sleep or wake is under way): its host copy is in use; prepare before gpupool_sleep"
            )));
        }
        match mode {
            SleepMode::Discard => return Ok(0),
            SleepMode::Offload => {
                drop(self.staging.lock(&*self.driver, self.device).map_err(|e| self.staging_error(e))?);
                return Ok(self.staging.bytes());
            }
            SleepMode::OffloadPinned => {}
        }
        // Each stream's live bytes now, read under its lock (one lock at a time).
        let needs: Vec<usize> =
            self.shards.of_pool(pool).iter().map(|s| s.lock().live_bytes()).filter(|&n| n > 0).collect();
        // Copies taken out of the store (already kept, or pinned now): on a failure, or a
        // driver call that unwinds, the kept ones go back and the new ones are unpinned.
        let mut held = scopeguard::guard(Vec::<(Pinned, bool)>::with_capacity(needs.len()), |held| {
            for (copy, new) in held {
                if new {
                    let _ = pinned_copies::unpin(&*self.driver, self.device, copy);
                } else {
                    self.keep(pool, copy);
                }
            }
        });
        let huge = self.staging.settings.huge_pages;
        let r = std::thread::scope(|scope| -> Result<(), DriverError> {
            let crew = Crew::new(scope, crew_size(self.staging.settings.threads));
            for &need in &needs {
                match self.kept.take(pool, need) {
                    Some(copy) => held.push((copy, false)),
                    None => held.push((pinned_copies::pin(&*self.driver, self.device, need, huge, &crew)?, true)),
                }
            }
            Ok(())
        });
        if r.is_ok() {
            for (copy, _) in scopeguard::ScopeGuard::into_inner(held) {
                self.keep(pool, copy);
            }
        } else {
            drop(held);
        }
        r.map_err(|e| match e {
            DriverError::OutOfMemory => Error::OutOfMemory(format!(
                "the host cannot pin the copy of {name}'s live bytes ({} bytes over {} streams) for \
                 gpupool_sleep_prepare; nothing changed",
                needs.iter().sum::<usize>(),
                needs.len()
            )),
            e => Error::driver(e, "pinning a pool's host copy before its sleep (gpupool_sleep_prepare)"),
        })?;
        Ok(self.kept.bytes(Some(pool)))
    }

    /// Puts `copy` with the copies `pool` keeps; unpins it when the pool was released meanwhile.
    fn keep(&self, pool: u64, copy: Pinned) {
        if let Some(copy) = self.kept.put(pool, copy) {
            let _ = pinned_copies::unpin(&*self.driver, self.device, copy);
        }
    }
}
