//! Blocks held back while queued copies read them (PyTorch `record_stream`/`free`,
//! `process_events` and the background thread of `CachingHostAllocatorImpl` in
//! `aten/src/ATen/core/CachingHostAllocator.h`): a free records one event per stream named by
//! `record_event`, and the block goes back to its free list once every one has completed, found
//! by polling (never blocking), on the allocation path or by the background thread.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Inner;
use super::blocks::{Block, Pending, Stripe};
use crate::caching::fork;
use crate::driver::StreamHandle;
use crate::error::Error;

/// How often the background thread polls events (PyTorch: 100 µs).
const BACKGROUND_PERIOD: Duration = Duration::from_micros(100);

impl Inner {
    /// A freed block, with the streams that used it: back to its home stripe's free list, or
    /// into its event queue with one event per stream.
    pub(super) fn give_back(&self, st: &mut Stripe, block: Arc<Block>, streams: Vec<(StreamHandle, i32)>) {
        if streams.is_empty() {
            return Self::to_free_list(st, block);
        }
        let mut recorded = 0;
        let mut stranded = Vec::new();
        for (stream, device) in streams {
            let ev = match st.idle_events.iter().rposition(|&(d, _)| d == device) {
                Some(i) => Ok(st.idle_events.swap_remove(i).1),
                None => self.driver.event_create(device),
            };
            let recorded_ok = ev.and_then(|ev| match self.driver.event_record(device, ev, stream) {
                Ok(()) => Ok(ev),
                Err(e) => {
                    st.idle_events.push((device, ev));
                    Err(e)
                }
            });
            match recorded_ok {
                Ok(ev) => {
                    st.pending.push_back(Pending { event: ev, device, block: block.clone() });
                    recorded += 1;
                }
                // No event: waiting for the whole device is as safe (PyTorch's free throws).
                Err(_) => {
                    if self.driver.device_synchronize(device).is_err() {
                        stranded.push(device);
                    }
                }
            }
        }
        if !stranded.is_empty() {
            // Events already recorded for this free are left to complete; the block waits
            // for `empty_cache` to synchronise the devices that failed.
            if recorded > 0 {
                let mut kept = Vec::new();
                st.pending.retain(|p| {
                    let mine = Arc::ptr_eq(&p.block, &block);
                    if mine {
                        kept.push((p.device, p.event));
                    }
                    !mine
                });
                stranded.extend(kept.iter().map(|&(d, _)| d));
                st.idle_events.extend(kept);
            }
            let mut slow = self.slow.lock();
            stranded.sort_unstable();
            stranded.dedup();
            slow.stranded.extend(stranded.into_iter().map(|d| (d, block.clone())));
            return;
        }
        if recorded == 0 {
            Self::to_free_list(st, block);
        } else {
            st.waiting.insert(block.ptr, recorded);
        }
    }

    /// Polls the pending events of stripe `s` (locked by the caller), oldest first: a block
    /// whose last event completed goes back to the free list. With `stop_at_busy` (the
    /// allocation path, PyTorch `process_events`), stops at the first event not completed;
    /// otherwise polls them all. Completed events are kept for reuse.
    ///
    /// Errors: [`Error::Cuda`] when a query fails (the event stays pending).
    pub(super) fn process_events(&self, st: &mut Stripe, stop_at_busy: bool) -> Result<(), Error> {
        let mut i = 0;
        while i < st.pending.len() {
            let p = &st.pending[i];
            let done = self
                .driver
                .event_query(p.event)
                .map_err(|e| Error::driver_call(e, "polling the event of a freed pinned block"))?;
            if !done {
                if stop_at_busy {
                    return Ok(());
                }
                i += 1;
                continue;
            }
            let p = st.pending.remove(i).expect("in range");
            st.idle_events.push((p.device, p.event));
            let left = st.waiting.get_mut(&p.block.ptr).expect("a pending block is waiting");
            *left -= 1;
            if *left == 0 {
                st.waiting.remove(&p.block.ptr);
                Self::to_free_list(st, p.block);
            }
        }
        Ok(())
    }
}

/// The background thread of `pinned_use_background_threads`: polls every stripe's events
/// every 100 µs (PyTorch's loop in `allocate`), until the allocator is dropped. Stripes busy
/// with their own thread are skipped for that round.
pub(super) fn start_background(inner: Weak<Inner>) {
    let spawned = std::thread::Builder::new().name("gpupool-host-events".into()).spawn(move || {
        loop {
            let Some(inner) = inner.upgrade() else { return };
            if fork::check().is_err() {
                return;
            }
            for stripe in inner.stripes.iter() {
                if let Some(mut st) = stripe.0.try_lock()
                    && !st.pending.is_empty()
                {
                    // A failed query leaves the event pending; the next round tries again.
                    let _ = inner.process_events(&mut st, false);
                }
            }
            drop(inner);
            std::thread::sleep(BACKGROUND_PERIOD);
        }
    });
    // Without the thread, events are still polled at every miss: nothing is lost but speed.
    drop(spawned);
}
