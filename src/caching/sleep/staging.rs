//! Each device's staging ring for `gpupool_sleep` and `gpupool_wake` with offload: a few
//! pinned host buffers (`cuMemHostAlloc`, [`StagingSettings::buffers`] of
//! [`StagingSettings::chunk`] bytes) and one event each, through which `copy` moves
//! a pool's blocks between the device and their pageable host copy. Pinned once, at the first
//! offload or restore of the device, and kept (pinning costs about a second per 10 GiB, the
//! copies themselves a fifth of that), until `gpupool_empty_cache` gives the ring back; its
//! bytes are [`Staging::bytes`] (`gpupool_sleep_staging_bytes`).
//!
//! One sleep or wake of the device uses the ring at a time: a second waits for it. A leaf of
//! the lock order: taken with no shard lock held (a shard's is taken under it), and
//! `empty_cache` only tries it.

use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};

use crate::config::Config;
use crate::driver::{Driver, DriverError, EventHandle, HostPtr};

/// How sleep and wake stage their copies (`GPUPOOL_SLEEP_*`, see `config::options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StagingSettings {
    /// Bytes of each buffer: the most one copy carries.
    pub chunk: usize,
    /// Buffers in the ring, at least 2 (one filled while the others are copied).
    pub buffers: usize,
    /// CPU threads of the host copies (0: the cores the process may use, at most 16).
    pub threads: usize,
    /// Whether the host copy asks for transparent huge pages.
    pub huge_pages: bool,
}

impl StagingSettings {
    /// The settings of `config`.
    pub fn from_config(config: &Config) -> StagingSettings {
        StagingSettings {
            chunk: config.sleep_chunk.max(1),
            buffers: config.sleep_buffers.max(2),
            threads: config.sleep_threads,
            huge_pages: config.sleep_huge_pages,
        }
    }
}

/// The pinned buffers of a ring and their events.
pub(crate) struct Ring {
    /// (buffer, the event recorded after its last copy).
    pub slots: Vec<(HostPtr, EventHandle)>,
    pub chunk: usize,
}

/// A device's ring, made on first use.
pub(crate) struct Staging {
    pub settings: StagingSettings,
    ring: Mutex<Option<Ring>>,
}

impl Staging {
    pub fn new(settings: StagingSettings) -> Staging {
        Staging { settings, ring: Mutex::new(None) }
    }

    /// The device's ring, pinned now if it is not, held by the caller until the guard drops
    /// (another sleep or wake of the device waits meanwhile).
    ///
    /// Errors: the driver's ([`DriverError::OutOfMemory`] when the host cannot pin the
    /// buffers); what was pinned or created is given back.
    pub fn lock(&self, driver: &dyn Driver, device: i32) -> Result<MappedMutexGuard<'_, Ring>, DriverError> {
        let mut g = self.ring.lock();
        if g.is_none() {
            *g = Some(self.make(driver, device)?);
        }
        Ok(MutexGuard::map(g, |r| r.as_mut().expect("made above")))
    }

    fn make(&self, driver: &dyn Driver, device: i32) -> Result<Ring, DriverError> {
        let chunk = self.settings.chunk;
        let mut ring = scopeguard::guard(Ring { slots: Vec::new(), chunk }, |r| free(driver, device, r));
        for _ in 0..self.settings.buffers {
            let buf = driver.host_alloc(device, chunk)?;
            let ev = match driver.event_create(device) {
                Ok(ev) => ev,
                Err(e) => {
                    let _ = quietly(|| driver.host_free(device, buf));
                    return Err(e);
                }
            };
            ring.slots.push((buf, ev));
        }
        Ok(scopeguard::ScopeGuard::into_inner(ring))
    }

    /// Gives the ring back to the driver (`gpupool_empty_cache`) unless a sleep or wake uses
    /// it now. Never panics: a driver call that fails or unwinds leaks what it held.
    pub fn release(&self, driver: &dyn Driver, device: i32) {
        if let Some(mut g) = self.ring.try_lock()
            && let Some(r) = g.take()
        {
            free(driver, device, r);
        }
    }

    /// Bytes of pinned host memory the ring holds now (0 before the first offload and after
    /// `empty_cache`); while a sleep or wake uses it, what it held before.
    pub fn bytes(&self) -> usize {
        match self.ring.try_lock() {
            Some(g) => g.as_ref().map_or(0, |r| r.slots.len().saturating_mul(r.chunk)),
            None => self.settings.buffers.saturating_mul(self.settings.chunk),
        }
    }
}

/// Frees a ring's buffers and events; the caller has waited for every copy that used them.
fn free(driver: &dyn Driver, device: i32, ring: Ring) {
    for (buf, ev) in ring.slots {
        let _ = quietly(|| driver.host_free(device, buf));
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.event_destroy(device, ev)));
    }
}

/// Runs a driver call whose failure the caller ignores, a panic included (a destructor's, or
/// one that frees what holds nothing of the device).
pub(crate) fn quietly<T>(call: impl FnOnce() -> Result<T, DriverError>) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).ok()?.ok()
}
