//! The owner's record of one export, in shared memory (a `memfd` mapped by the owner and by
//! each importer, which takes its descriptor with `pidfd_getfd`): what the export is (owner,
//! export id, kind, size, offset), the owner's descriptors of its pages, whether the owner
//! freed the block, and a count of uses per importer process (PyTorch keeps one reference
//! count per shared block in a shared-memory file, `CudaIPCRefCountersFile`; here a count per
//! importer, with its pid and start time, so that the owner drops a dead importer's uses).
//!
//! The protocol between an importer's use and the owner's free is lock-free: the importer
//! adds its use, then reads the freed flag, and backs out if set; the owner sets the flag,
//! then sums the uses. Both sequentially consistent, so at least one of them sees the other:
//! never an import of a block the owner reuses.
//!
//! A dead importer's slot is cleared by whoever finds it first: the owner when it sums the
//! uses (a free, a reclaim, a listing), or another importer whose import finds every slot
//! taken (so that 64 importers killed while the owner does nothing do not close the export
//! to every later one). Several processes may clear at once, so a clear first takes the slot
//! by its generation (odd while cleared, [`reap`]): of two clearers one wins, and neither can
//! clear a slot given back and claimed again since it was read.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use crate::os::memfd;
use crate::os::process::{self, Identity};

const MAGIC: u64 = u64::from_le_bytes(*b"GPIPCREC");
/// 2: a slot is given back by its process's last release (`Slot::generation`). 3: importers
/// clear dead importers' slots too, each clear taking the slot by its generation first (a
/// version-2 owner would clear without it, under a version-3 importer's clear).
const VERSION: u32 = 3;
/// Importer processes one export can have at once.
pub(crate) const MAX_IMPORTERS: usize = 64;
/// Pages one export can have (a block of 1 TiB in 2 MiB pages).
pub(crate) const MAX_PAGES: u64 = 1 << 19;
const FREED: u64 = 1;

/// Serialises this process's [`Record::acquire`] and [`Record::release`] (of every record: an
/// import is rare, and held briefly): another thread of this process never finds its slot
/// given back under it. Other processes only claim free slots, and the owner clears only the
/// slots of processes that exited.
static SLOTS: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

#[repr(C)]
struct Slot {
    pid: AtomicU32,
    /// Odd while the slot's process gives it back, or while another process clears it (its
    /// process died); bumped twice by each, so that a clearer never takes a pid and a start
    /// time read across a give-back for a process that exited, and two clearers never both
    /// clear (the second's claim of the generation fails).
    generation: AtomicU32,
    start: AtomicU64,
    count: AtomicU64,
}

#[repr(C)]
pub(crate) struct Header {
    magic: u64,
    version: u32,
    pub kind: u32,
    pub owner_pid: u32,
    pub device: i32,
    pub owner_start: u64,
    pub export_id: u64,
    state: AtomicU64,
    pub size: u64,
    pub offset: u64,
    pub page_size: u64,
    pub page_count: u64,
    slots: [Slot; MAX_IMPORTERS],
}

/// One export's record, mapped in this process. Thread-safe: its shared fields are atomics.
pub(crate) struct Record {
    /// The owner's descriptor (the number its handle carries); `None` in an importer, which
    /// needs only the mapping.
    fd: Option<OwnedFd>,
    at: *mut Header,
    len: usize,
}

// SAFETY: the mapping is shared memory whose mutable fields are atomics.
unsafe impl Send for Record {}
// SAFETY: as above.
unsafe impl Sync for Record {}

/// Why a use could not be added.
#[derive(Debug)]
pub(crate) enum AcquireError {
    /// The owner freed the block.
    Freed,
    /// [`MAX_IMPORTERS`] other processes hold it.
    Full,
}

impl Drop for Record {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map`.
        unsafe { libc::munmap(self.at.cast(), self.len) };
    }
}

fn map(fd: OwnedFd, len: usize) -> io::Result<Record> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new shared mapping of our descriptor, anywhere; the result is checked.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Record { fd: Some(fd), at: p.cast(), len })
}

fn bytes_for(pages: usize) -> usize {
    (size_of::<Header>() + pages * 4).next_multiple_of(4096)
}

/// What a new record says.
pub(crate) struct Fields {
    pub kind: u32,
    pub owner: Identity,
    pub device: i32,
    pub export_id: u64,
    pub size: u64,
    pub offset: u64,
    pub page_size: u64,
}

impl Record {
    /// A new record of an export with `pages` (the owner's descriptors of its pages).
    ///
    /// Errors: the system's, when the memfd cannot be made or mapped.
    pub fn create(f: &Fields, pages: &[RawFd]) -> io::Result<Record> {
        let len = bytes_for(pages.len());
        let r = map(memfd::create("gpupool-ipc-export", len)?, len)?;
        // SAFETY: a fresh mapping of `len` bytes, zero-filled, holding a Header and the pages;
        // nobody else has it yet.
        unsafe {
            let h = &mut *r.at;
            (h.magic, h.version, h.kind, h.owner_pid, h.device) = (MAGIC, VERSION, f.kind, f.owner.pid, f.device);
            (h.owner_start, h.export_id, h.size, h.offset) = (f.owner.start, f.export_id, f.size, f.offset);
            (h.page_size, h.page_count) = (f.page_size, pages.len() as u64);
            let list = r.at.add(1).cast::<i32>();
            for (i, &fd) in pages.iter().enumerate() {
                list.add(i).write(fd);
            }
        }
        Ok(r)
    }

    /// Maps a record whose descriptor was taken from its owner, checking its shape.
    ///
    /// Errors: a message saying what is wrong (not a record, or cut short).
    pub fn open(fd: OwnedFd) -> Result<Record, String> {
        let len = memfd::file_size(&fd).map_err(|e| format!("its size cannot be read ({e})"))?;
        if len < size_of::<Header>() {
            return Err("the descriptor the handle names is not an export record".into());
        }
        let mut r = map(fd, len).map_err(|e| format!("it cannot be mapped ({e})"))?;
        r.fd = None;
        let h = r.header();
        if h.magic != MAGIC || h.version != VERSION {
            return Err("the descriptor the handle names is not an export record".into());
        }
        if h.page_count > MAX_PAGES || bytes_for(h.page_count as usize) > len {
            return Err("the export record is cut short".into());
        }
        Ok(r)
    }

    /// The record's fixed fields and importer slots, as the owner wrote them.
    pub fn header(&self) -> &Header {
        // SAFETY: the mapping holds a Header for as long as `self` lives.
        unsafe { &*self.at }
    }

    /// The owner's descriptor of the record (the number the handle carries); -1 in an importer.
    pub fn fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// The owner's descriptors of the pages.
    pub fn page_fds(&self) -> &[i32] {
        // SAFETY: `open` and `create` checked that the mapping holds `page_count` of them.
        unsafe { std::slice::from_raw_parts(self.at.add(1).cast::<i32>(), self.header().page_count as usize) }
    }

    /// Adds a use by `me`; returns its slot.
    ///
    /// A process's acquires and releases of every record are serialised ([`SLOTS`]), so that
    /// its threads share one slot per record and a release that empties the slot may give it
    /// back: a slot is held by a process only while it holds a use (a process that imported
    /// and closed leaves room for another).
    pub fn acquire(&self, me: Identity) -> Result<usize, AcquireError> {
        let _serial = SLOTS.lock();
        let slots = &self.header().slots;
        let mine = slots.iter().position(|s| s.pid.load(SeqCst) == me.pid && s.start.load(SeqCst) == me.start);
        let claim = || slots.iter().position(|s| s.pid.compare_exchange(0, me.pid, SeqCst, SeqCst).is_ok());
        let slot = match mine {
            Some(i) => i,
            None => {
                // Every slot taken: those of importers that died are cleared here, so that an
                // export whose owner calls nothing still takes new importers. Claimed again
                // whoever cleared them: another importer's reap may have cleared every dead
                // slot between this one's first claim and its own reap, which then clears none.
                let free = claim().or_else(|| {
                    self.reap_dead();
                    claim()
                });
                let i = free.ok_or(AcquireError::Full)?;
                slots[i].start.store(me.start, SeqCst);
                i
            }
        };
        slots[slot].count.fetch_add(1, SeqCst);
        if self.header().state.load(SeqCst) & FREED != 0 {
            self.give_back(slot);
            return Err(AcquireError::Freed);
        }
        Ok(slot)
    }

    /// Drops a use added by [`Record::acquire`]; the last use of this process gives its slot
    /// back (start first, then pid: the owner reads a slot with a pid and no start as being
    /// claimed, and counts its zero uses).
    pub fn release(&self, slot: usize) {
        let _serial = SLOTS.lock();
        self.give_back(slot);
    }

    /// [`Record::release`], [`SLOTS`] held.
    fn give_back(&self, slot: usize) {
        let s = &self.header().slots[slot];
        if s.count.fetch_sub(1, SeqCst) == 1 {
            s.generation.fetch_add(1, SeqCst);
            s.start.store(0, SeqCst);
            s.pid.store(0, SeqCst);
            s.generation.fetch_add(1, SeqCst);
        }
    }

    /// The owner frees the block: no use may be added from now on.
    pub fn mark_freed(&self) {
        self.header().state.fetch_or(FREED, SeqCst);
    }

    /// Uses held by importers that still run; a dead importer's slot is cleared first.
    pub fn holders(&self) -> u64 {
        let mut total = 0;
        for s in &self.header().slots {
            if !reap(s) {
                total += s.count.load(SeqCst);
            }
        }
        total
    }

    /// Clears the slots of importers that died (exited, killed, zombies); returns how many.
    pub fn reap_dead(&self) -> usize {
        self.header().slots.iter().filter(|s| reap(s)).count()
    }
}

/// Clears slot `s` if the process that holds it has died; returns whether it did.
///
/// The pid and start time are taken only as read within one even generation: a slot given
/// back and claimed again while it was read (a pid of one process, a start time of the next),
/// or one with a start time of 0 (being claimed now), is left alone. The clear then takes the
/// slot by moving its generation from that even value to the odd one after: it fails if the
/// slot was given back since (the generation moved on) or another process clears it (odd).
/// Nothing else moves the generation while it is odd: the slot's process is dead, and claims
/// take only slots with no pid, which this one keeps until its last step.
fn reap(s: &Slot) -> bool {
    let seen = s.generation.load(SeqCst);
    let pid = s.pid.load(SeqCst);
    if pid == 0 || seen % 2 != 0 {
        return false;
    }
    let start = s.start.load(SeqCst);
    if start == 0 || s.generation.load(SeqCst) != seen || process::alive(Identity { pid, start }) {
        return false;
    }
    if s.generation.compare_exchange(seen, seen.wrapping_add(1), SeqCst, SeqCst).is_err() {
        return false;
    }
    s.count.store(0, SeqCst);
    s.start.store(0, SeqCst);
    s.generation.store(seen.wrapping_add(2), SeqCst);
    // Last: from now on the slot may be claimed.
    s.pid.store(0, SeqCst);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let owner = process::me();
        let f = Fields { kind: 1, owner, device: 0, export_id: 1, size: 1, offset: 0, page_size: 0 };
        Record::create(&f, &[]).unwrap()
    }

    /// A process that does not run: this one's pid with another start time.
    fn dead(i: u64) -> Identity {
        let me = process::me();
        Identity { pid: me.pid, start: me.start + 1 + i }
    }

    #[test]
    fn a_full_table_of_dead_importers_takes_a_new_one() {
        let r = record();
        for i in 0..MAX_IMPORTERS as u64 {
            r.acquire(dead(i)).unwrap();
        }
        assert_eq!(r.reap_dead(), MAX_IMPORTERS, "the owner's reap clears every dead importer");
        for i in 0..MAX_IMPORTERS as u64 {
            r.acquire(dead(i)).unwrap();
        }
        // No owner call in between: the import clears the dead importers itself.
        let slot = r.acquire(process::me()).unwrap();
        assert_eq!(r.holders(), 1);
        assert_eq!(r.reap_dead(), 0, "the import cleared them all");
        r.release(slot);
        assert_eq!(r.holders(), 0);
    }

    #[test]
    fn a_slot_given_back_and_claimed_again_is_not_cleared_by_a_stale_read() {
        let r = record();
        let s = &r.header().slots[0];
        let slot = r.acquire(process::me()).unwrap();
        assert_eq!(slot, 0);
        // A clearer that read the generation before a give-back fails to take the slot.
        let seen = s.generation.load(SeqCst);
        r.release(slot);
        r.acquire(process::me()).unwrap();
        assert!(s.generation.compare_exchange(seen, seen + 1, SeqCst, SeqCst).is_err());
        assert!(!reap(s), "a live importer's slot stays");
        assert_eq!(r.holders(), 1);
    }
}
