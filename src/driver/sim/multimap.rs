//! What an allocator that leaves pages mapped at several addresses at once (GMLake, ASPLOS'24:
//! a handle may stay mapped wherever it was, one of those addresses owning it at a time) would
//! have been spared of the maps made: a measure, not a behaviour; no call acts differently.
//!
//! Each successful `mem_map` of a handle at an address is classified against the handle last
//! mapped over that address, 2 MiB granule by granule ([`SimCounts::map_same`],
//! [`SimCounts::map_returnable`], [`SimCounts::map_new`]), and each run of maps granted access
//! by one `mem_set_access` (one growth of an expandable segment) against whether every map of
//! it was spared ([`SimCounts::map_runs`], [`SimCounts::map_runs_spared`]). The count is per
//! map and optimistic: a handle left behind at several addresses counts as returnable at each
//! of them, though it could be given back to only one at a time.
//!
//! [`SimCounts::map_same`]: super::SimCounts::map_same
//! [`SimCounts::map_returnable`]: super::SimCounts::map_returnable
//! [`SimCounts::map_new`]: super::SimCounts::map_new
//! [`SimCounts::map_runs`]: super::SimCounts::map_runs
//! [`SimCounts::map_runs_spared`]: super::SimCounts::map_runs_spared

use std::collections::BTreeMap;

use super::{DevicePtr, SIM_GRANULARITY, State};

/// The driver's memory of past maps, by address.
#[derive(Default)]
pub(super) struct LastMapped {
    /// Each granule of device address space ever mapped, and not freed since -> the handle
    /// last mapped over it and the granule's index in that handle.
    at: BTreeMap<DevicePtr, (u64, usize)>,
    /// The maps since the last access grant: how many, and whether each was spared.
    run: (u64, bool),
}

impl State {
    /// Classifies a successful map of `handle` (`size` bytes) at `ptr`, then records it as the
    /// last map over its granules.
    pub(super) fn classify_map(&mut self, ptr: DevicePtr, size: usize, handle: u64) {
        let g = SIM_GRANULARITY as u64;
        let granules = size / SIM_GRANULARITY;
        let last: Vec<_> = (0..granules).map(|i| self.last_mapped.at.get(&(ptr + i as u64 * g)).copied()).collect();
        let old = last[0].map(|(h, _)| h);
        // The same handle over the same granules in the same order: the whole handle, once.
        let whole = |h: u64| last.iter().enumerate().all(|(i, l)| *l == Some((h, i)));
        // Returnable: the old handle alive, mapped nowhere and no other size (the device's
        // page pool holds it); a multi-mapping allocator would have kept it here.
        let returnable = |h: u64| self.handles.get(&h).is_some_and(|o| o.mapped_at.is_none() && o.size == size);
        let spared = match old {
            Some(h) if h == handle && whole(h) => {
                self.counts.map_same += 1;
                true
            }
            Some(h) if whole(h) && returnable(h) => {
                self.counts.map_returnable += 1;
                true
            }
            None => {
                self.counts.map_new += 1;
                self.counts.map_fresh += 1;
                false
            }
            _ => {
                self.counts.map_new += 1;
                false
            }
        };
        self.counts.va_pages_first_mapped += last.iter().filter(|l| l.is_none()).count() as u64;
        for i in 0..granules {
            self.last_mapped.at.insert(ptr + i as u64 * g, (handle, i));
        }
        let run = &mut self.last_mapped.run;
        *run = (run.0 + 1, (run.0 == 0 || run.1) && spared);
    }

    /// Closes the run of maps made since the last grant, when there is one: a successful
    /// `mem_set_access` granting access (a peer's grant over mapped pages closes none).
    pub(super) fn close_map_run(&mut self) {
        let (maps, spared) = std::mem::take(&mut self.last_mapped.run);
        if maps > 0 {
            self.counts.map_runs += 1;
            self.counts.map_runs_spared += spared as u64;
        }
    }

    /// Forgets the maps over `[ptr, ptr + size)`, an address range freed: an address reserved
    /// again later is new.
    pub(super) fn forget_maps(&mut self, ptr: DevicePtr, size: usize) {
        let tail = self.last_mapped.at.split_off(&ptr);
        self.last_mapped.at.extend(tail.into_iter().filter(|(a, _)| *a >= ptr + size as u64));
    }
}
