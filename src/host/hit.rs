//! The pinned hit path: a malloc served from the calling thread's stripe's free list, and a
//! free of a block that stripe handed out lately, each in code that makes no call.
//!
//! A function that may call keeps its values in callee-saved registers, which it saves and
//! restores: six pushes, six pops and a stack adjustment each way, 28 of the pinned pair's 213
//! instructions (callgrind, `tests/c/hit_loop.c host`, 2026-11-27). Here everything that would
//! call (taking a contended lock, polling events, a thread without its slot, a spill of the
//! handed-out stack, a class above 1 MiB, an error) is left to the full path instead:
//! [`HostAllocator::malloc_hit`] and [`HostAllocator::free_hit`] answer `Err`, having
//! changed nothing, and the caller (the C exports, [`HostAllocator::malloc`] and
//! [`HostAllocator::free`]) goes on with the full path (`malloc_in_parent`, `free_in_parent`).
//! The only call left is the lock's release when another thread waits (parking_lot's
//! `unlock_slow`), which the caller makes where it holds no value ([`StripeLock`]).
//!
//! The rules are the full path's (see the module's doc): the same stripe, free list, handed-out
//! stack and statistics, under the same lock, so that whatever either path does the other
//! sees.

use super::blocks::Stripe;
use super::{HostAllocator, Inner, classes, thread_number};
use crate::driver::HostPtr;

/// The calling thread's stripe, locked by the hit path: released when dropped. The hit path
/// hands it to its caller, hit or miss, so that the release (which calls parking_lot's
/// `unlock_slow` when another thread waits) comes where no value of the call is still needed:
/// after the caller's last store, or in the full path, which drops it first.
pub(crate) struct StripeLock<'a>(#[allow(dead_code)] parking_lot::MutexGuard<'a, Stripe>);

/// What the hit path did: `Ok` served, `Err` not (nothing changed), with the stripe's lock if
/// it was taken. Either way the lock is held until the value is dropped.
pub(crate) type HitResult<'a> = Result<StripeLock<'a>, Option<StripeLock<'a>>>;

impl HostAllocator {
    /// A cache hit of `size` bytes (1 to 1 MiB) in the calling thread's stripe: its block is
    /// handed out and `put` given its address. `Err`, and nothing changed, when the full path
    /// is needed (see the module's doc). Thread-safe.
    #[inline(always)]
    pub(crate) fn malloc_hit(&self, size: usize, put: impl FnOnce(HostPtr)) -> HitResult<'_> {
        if size.wrapping_sub(1) >= classes::SMALL_MAX {
            return Err(None);
        }
        self.in_own_stripe(|me, st| {
            // Each test its own branch: joined, they were computed into flags first (4
            // instructions more, callgrind).
            if !st.pending.is_empty() {
                return false;
            }
            if !st.handed_out.has_room() {
                return false;
            }
            let Some(b) = st.free[classes::small_class(size)].pop() else {
                return false;
            };
            let ptr = Inner::count_out(st, me, &b);
            // SAFETY: room checked above, under the same lock.
            unsafe { st.handed_out.push(ptr, b) };
            put(ptr);
            true
        })
    }

    /// The free of the block at `ptr` if the calling thread's stripe handed it out lately
    /// (its handed-out stack holds it: no stream named for it): back to its free list.
    /// `Err`, and nothing changed, otherwise. Thread-safe.
    #[inline(always)]
    pub(crate) fn free_hit(&self, ptr: HostPtr) -> HitResult<'_> {
        self.in_own_stripe(|_, st| match st.handed_out.take_recent(ptr) {
            Some(block) => {
                Inner::to_free_list(st, block);
                true
            }
            None => false,
        })
    }

    /// `f(stripe number, stripe)` under the lock of the calling thread's stripe, if the thread
    /// holds its slot (`thread_number::claimed`) and the lock is free.
    #[inline(always)]
    fn in_own_stripe(&self, f: impl FnOnce(usize, &mut Stripe) -> bool) -> HitResult<'_> {
        let Some(n) = thread_number::claimed() else {
            return Err(None);
        };
        let (me, stripe) = self.inner.stripe(n);
        let Some(mut st) = stripe.try_lock() else {
            return Err(None);
        };
        if f(me, &mut st) { Ok(StripeLock(st)) } else { Err(Some(StripeLock(st))) }
    }
}
