//! Blocks and stripes (PyTorch `HostBlock` and the per-size free lists of
//! `CachingHostAllocatorImpl` in `aten/src/ATen/core/CachingHostAllocator.h`): what a pinned
//! block is and where its memory came from, the stripes whose free lists (one per size class of
//! `classes`) serve the hit path without a lock shared between threads, and handing a block out
//! of a free list and back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use super::classes::CLASSES;
use super::free_list::{FreeList, Linked};
use super::handed_out::HandedOutSet;
use super::stats::StripeStat;
use super::{HostAllocator, Inner};
use crate::driver::{EventHandle, HostPtr};
use crate::error::Error;

/// Where a block's memory came from, so that it goes back the same way (PyTorch keeps
/// `use_host_register` per pointer for the same reason: the configuration may differ between
/// the allocation and the release of a block only for the Rust API, but the rule costs nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// `cuMemHostAlloc` in `device`'s primary context.
    HostAlloc { device: i32 },
    /// `posix_memalign` and `cuMemHostRegister` in `device`'s primary context.
    Registered { device: i32 },
    /// Carved from the reserve segment; never released.
    Reserve,
}

/// One block: one whole allocation of its class's size (PyTorch `HostBlock`).
pub(super) struct Block {
    pub(super) ptr: HostPtr,
    pub(super) size: usize,
    pub(super) class: usize,
    pub(super) origin: Origin,
    /// The stripe that handed the block out last: where it goes back to, and where it is
    /// listed while handed out.
    pub(super) home: AtomicU32,
    /// The next block of the free list that lists this one (`free_list`): read and written
    /// only under that list's stripe lock.
    pub(super) next: AtomicPtr<Block>,
}

impl Linked for Block {
    #[inline(always)]
    fn next(&self) -> &AtomicPtr<Block> {
        &self.next
    }
}

impl Block {
    /// A block of `size` bytes at `ptr`, of `class`, from `origin`; its home stripe 0 until it
    /// is handed out.
    pub(super) fn new(ptr: HostPtr, size: usize, class: usize, origin: Origin) -> Block {
        Block { ptr, size, class, origin, home: AtomicU32::new(0), next: AtomicPtr::new(std::ptr::null_mut()) }
    }
}

/// A freed block's event on one stream that has not been seen completed yet.
pub(super) struct Pending {
    pub(super) event: EventHandle,
    pub(super) device: i32,
    pub(super) block: Arc<Block>,
}

/// One stripe: what its threads use on the hit path, under one lock.
pub(super) struct Stripe {
    /// Free blocks per size class, most recently freed last (PyTorch pops the back too).
    pub(super) free: [FreeList<Block>; CLASSES],
    /// Blocks this stripe handed out, by address: a free by a thread of the stripe finds its
    /// block here, under the lock it takes anyway, and a block is allocated exactly while it
    /// is listed in its home stripe.
    pub(super) handed_out: HandedOutSet<Block>,
    /// Events of freed blocks of this stripe, oldest first.
    pub(super) pending: VecDeque<Pending>,
    /// How many pending events each block still waits for, by block address.
    pub(super) waiting: rustc_hash::FxHashMap<usize, u32>,
    /// Created events kept for reuse, with their device (PyTorch's `EventPool`, per stripe).
    pub(super) idle_events: Vec<(i32, EventHandle)>,
    pub(super) active_requests: StripeStat,
    pub(super) active_bytes: StripeStat,
}

impl Default for Stripe {
    fn default() -> Self {
        Stripe {
            free: std::array::from_fn(|_| FreeList::default()),
            handed_out: Default::default(),
            pending: VecDeque::new(),
            waiting: Default::default(),
            idle_events: Vec::new(),
            active_requests: StripeStat::default(),
            active_bytes: StripeStat::default(),
        }
    }
}

/// Cache-line padding, so that stripes never share a line.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct Padded<T>(pub(super) T);

impl HostAllocator {
    /// The calling thread's stripe: its number (`thread_number`) modulo the stripes, a power
    /// of two.
    #[inline(always)]
    pub(super) fn stripe_index(&self) -> usize {
        self.inner.stripe(super::thread_number::current()).0
    }
}

impl Inner {
    /// The block that starts at `ptr`, for the operation `doing`.
    pub(super) fn block_at(&self, ptr: HostPtr, doing: &str) -> Result<Arc<Block>, Error> {
        self.index.with_segment(ptr as u64, |e| match e {
            Some(e) if e.base == ptr as u64 => Ok(e.owner.clone()),
            Some(e) => Err(Error::InvalidPointer(format!(
                "cannot {doing} {ptr:#x}: it is inside the pinned block at {:#x} ({} bytes), not its start",
                e.base, e.size
            ))),
            None => Err(Error::InvalidPointer(format!(
                "cannot {doing} {ptr:#x}: it is not pinned host memory from gpupool_host_malloc"
            ))),
        })
    }

    /// Pops a free block of `class` from stripe `me` and hands it out.
    #[inline(always)]
    pub(super) fn take(&self, st: &mut Stripe, me: usize, class: usize) -> Option<HostPtr> {
        let b = st.free[class].pop()?;
        Some(self.hand_out(st, me, b))
    }

    /// Marks `b` allocated by stripe `me` (whose lock the caller holds) and counts it.
    #[inline(always)]
    pub(super) fn hand_out(&self, st: &mut Stripe, me: usize, b: Arc<Block>) -> HostPtr {
        let ptr = Self::count_out(st, me, &b);
        st.handed_out.insert(ptr, b);
        ptr
    }

    /// What [`Inner::hand_out`] does but listing the block: its home set to stripe `me`, and
    /// counted active. Returns its address.
    #[inline(always)]
    pub(super) fn count_out(st: &mut Stripe, me: usize, b: &Block) -> HostPtr {
        b.home.store(me as u32, Ordering::Relaxed);
        st.active_requests.increase(1);
        st.active_bytes.increase(b.size as i64);
        b.ptr
    }

    /// Stripe `n` modulo the stripes (a power of two), without a bound check (its panic is a
    /// call, which gave the hit path a stack frame).
    #[inline(always)]
    pub(super) fn stripe(&self, n: usize) -> (usize, &parking_lot::Mutex<Stripe>) {
        let me = n & self.stripe_mask;
        debug_assert!(self.stripes.len().is_power_of_two() && self.stripe_mask == self.stripes.len() - 1);
        // SAFETY: the stripes are a power of two, at least 8 (`HostAllocator::new`): `me` is
        // below their count.
        (me, unsafe { &self.stripes.get_unchecked(me).0 })
    }

    /// The stripe that handed out (or last handed out) the block at `ptr`, locked.
    ///
    /// Errors: as [`Inner::block_at`].
    pub(super) fn home_of(
        &self,
        ptr: HostPtr,
        doing: &str,
    ) -> Result<(usize, parking_lot::MutexGuard<'_, Stripe>), Error> {
        let block = self.block_at(ptr, doing)?;
        let home = block.home.load(Ordering::Relaxed) as usize;
        Ok((home, self.stripes[home].0.lock()))
    }

    /// A block becomes free in stripe `st`: it no longer counts as active.
    #[inline(always)]
    pub(super) fn to_free_list(st: &mut Stripe, block: Arc<Block>) {
        st.active_requests.decrease(1);
        st.active_bytes.decrease(block.size as i64);
        let class = block.class;
        debug_assert!(class < CLASSES);
        // SAFETY: a block's class is one of `classes`' (`classes::round`), below `CLASSES`;
        // checked, the bound's panic is a call that gave the hit path's free a stack frame.
        unsafe { st.free.get_unchecked_mut(class) }.push(block);
    }
}
