//! A shard's side of the registration for transports (`caching::registration`): the mapped
//! run around a pointer inside a live block, read under the shard's lock.

use super::MappedRange;
use crate::caching::block::{BlockState, NIL};
use crate::caching::shard::ShardState;
use crate::driver::DevicePtr;
use crate::error::Error;

impl ShardState {
    /// The mapped run around `ptr` in the segment that starts at `base` (device, stream and
    /// pool are the caller's to fill).
    ///
    /// Errors: [`Error::InvalidPointer`] when `ptr` lies in no allocated block of that segment
    /// (a freed block, unmapped address space, or a segment this shard does not hold);
    /// [`Error::InvalidValue`] while the shard's pool sleeps (its pages are gone).
    pub fn mapped_run(&self, base: DevicePtr, ptr: DevicePtr) -> Result<MappedRange, Error> {
        if self.is_asleep() {
            return Err(Error::InvalidValue(format!(
                "pointer {ptr:#x} is in a pool that sleeps (gpupool_sleep): its memory is unmapped until \
                 gpupool_wake, and a transport must not register it"
            )));
        }
        let seg = self.segments.get(&base).ok_or_else(|| Error::InvalidPointer(unknown(ptr)))?;
        let mut id = seg.head;
        while id != NIL {
            let b = &self.blocks[id];
            if b.addr <= ptr && ptr < b.addr + b.size as u64 {
                break;
            }
            id = b.next;
        }
        if id == NIL || self.blocks[id].state != BlockState::Allocated {
            let what = if id == NIL { "no block" } else { "a block that is not allocated (freed or unmapped)" };
            return Err(Error::InvalidPointer(format!(
                "pointer {ptr:#x} lies in {what} of the segment at {base:#x}: only memory of a live allocation \
                 has a mapped range to register"
            )));
        }
        let (run_base, bytes) = match &seg.exp {
            None => (base, seg.size),
            Some(exp) => {
                let table = exp.page_table();
                let at = (ptr - exp.base) as usize / exp.page;
                let mapped = |i: usize| table.get(i).is_some_and(Option::is_some);
                if !mapped(at) {
                    return Err(Error::Internal(format!("the live block at {ptr:#x} lies on an unmapped page")));
                }
                let mut lo = at;
                while lo > 0 && mapped(lo - 1) {
                    lo -= 1;
                }
                let mut hi = at + 1;
                while mapped(hi) {
                    hi += 1;
                }
                (exp.base + (lo * exp.page) as u64, (hi - lo) * exp.page)
            }
        };
        Ok(MappedRange {
            device: 0,
            base: run_base,
            bytes,
            segment_base: base,
            segment_bytes: seg.size,
            expandable: seg.exp.is_some(),
            stream: 0,
            pool: 0,
        })
    }
}

/// The message of a pointer no segment of gpupool's holds.
pub(super) fn unknown(ptr: DevicePtr) -> String {
    format!("pointer {ptr:#x} was not allocated by gpupool (it lies in none of its segments)")
}
