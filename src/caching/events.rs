//! The events of `record_stream`: per stream that used a freed block, the events recorded
//! there in order (PyTorch `cuda_events`), and the completed events kept for reuse (PyTorch
//! `EventPool`). One per shard, behind the shard's lock.
//!
//! PyTorch keeps its event pool for the life of the process; gpupool destroys the idle events
//! at `empty_cache` ([`StreamEvents::destroy_idle`]) and when the allocator is dropped.

use std::collections::VecDeque;

use super::block::BlockId;
use crate::driver::{Driver, DriverError, EventHandle, StreamHandle};

#[derive(Default)]
pub(crate) struct StreamEvents {
    /// Per stream, its events in recording order with the block each one holds back.
    pending: Vec<(StreamHandle, VecDeque<(EventHandle, BlockId)>)>,
    /// Events in `pending`.
    count: usize,
    /// Completed events kept for reuse.
    idle: Vec<EventHandle>,
}

impl StreamEvents {
    /// Whether no event is pending (the hit path's test: then no driver call is made).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether no event is pending or kept idle: nothing to give back to the driver.
    pub fn is_unused(&self) -> bool {
        self.count == 0 && self.idle.is_empty()
    }

    /// An event recorded on `stream` now, reusing an idle one when there is one (PyTorch
    /// `create_event_internal` and `cudaEventRecord`). On failure the event, if any, goes
    /// back to the idle ones.
    pub fn record(
        &mut self,
        driver: &dyn Driver,
        device: i32,
        stream: StreamHandle,
    ) -> Result<EventHandle, DriverError> {
        let ev = match self.idle.pop() {
            Some(ev) => ev,
            None => driver.event_create(device)?,
        };
        // Back to the idle events unless recorded, unwinding included.
        let idle = scopeguard::guard(&mut self.idle, |idle| idle.push(ev));
        driver.event_record(device, ev, stream)?;
        scopeguard::ScopeGuard::into_inner(idle);
        Ok(ev)
    }

    /// Takes back events recorded by [`StreamEvents::record`] but never queued (a free that
    /// failed part way and was undone).
    pub fn unused(&mut self, events: impl IntoIterator<Item = EventHandle>) {
        self.idle.extend(events);
    }

    /// Queues `event`, recorded on `stream`, as holding back `block`.
    pub fn push(&mut self, stream: StreamHandle, event: EventHandle, block: BlockId) {
        match self.pending.iter_mut().find(|q| q.0 == stream) {
            Some(q) => q.1.push_back((event, block)),
            None => self.pending.push((stream, VecDeque::from([(event, block)]))),
        }
        self.count += 1;
    }

    /// PyTorch `process_events` (`wait` false: never blocks) and `synchronize_and_free_events`
    /// (`wait` true): each stream's events in order, stopping at the first that has not
    /// completed; `done` is called with each completed event's block at once (once per event:
    /// a block held back by several streams is named once for each), so that a driver call
    /// that unwinds later leaves every event either pending or handled.
    ///
    /// Errors: the driver's, when a query or wait fails; that event stays pending.
    pub fn drain(&mut self, driver: &dyn Driver, wait: bool, mut done: impl FnMut(BlockId)) -> Result<(), DriverError> {
        let mut result = Ok(());
        'queues: for q in &mut self.pending {
            while let Some(&(ev, id)) = q.1.front() {
                let complete = if wait { driver.event_synchronize(ev).map(|_| true) } else { driver.event_query(ev) };
                match complete {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        result = Err(e);
                        break 'queues;
                    }
                }
                q.1.pop_front();
                self.count -= 1;
                self.idle.push(ev);
                done(id);
            }
        }
        self.pending.retain(|q| !q.1.is_empty());
        result
    }

    /// The blocks of the events that [`StreamEvents::drain`] without waiting would handle now
    /// (each stream's events in order, up to the first not complete; a block once per such
    /// event), found by `cuEventQuery` alone: nothing changes.
    ///
    /// Errors: the driver's, when a query fails (as `drain` would fail).
    pub fn completed(&self, driver: &dyn Driver) -> Result<Vec<BlockId>, DriverError> {
        let mut done = Vec::new();
        for (_, q) in &self.pending {
            for &(ev, id) in q {
                if !driver.event_query(ev)? {
                    break;
                }
                done.push(id);
            }
        }
        Ok(done)
    }

    /// Destroys the idle events (`cuEventDestroy`).
    pub fn destroy_idle(&mut self, driver: &dyn Driver, device: i32) {
        for ev in self.idle.drain(..) {
            driver.event_destroy(device, ev);
        }
    }

    /// How many pending events hold back each block, and the pending count (for the
    /// consistency check).
    pub fn per_block(&self) -> (rustc_hash::FxHashMap<BlockId, u32>, usize) {
        let mut queued = rustc_hash::FxHashMap::<BlockId, u32>::default();
        for (_, q) in &self.pending {
            for &(_, id) in q {
                *queued.entry(id).or_default() += 1;
            }
        }
        (queued, self.count)
    }
}
