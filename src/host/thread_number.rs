//! Each thread's number for choosing its stripe, found without `__tls_get_addr`.
//!
//! The stripe of a thread is its number (given round robin at its first call) modulo the
//! stripes. Kept in a `thread_local!`, the number cost the pinned hit pair two calls of
//! `__tls_get_addr` (a shared library's thread-locals are reached through it: Rust has no
//! stable way to ask for the initial-exec model, and that model would make `dlopen` of the
//! library fail where the static TLS space is spent), about 17 instructions a call (callgrind,
//! `tests/c/hit_loop.c host`). Here a table keyed by the thread pointer (one register read:
//! `%fs:0` on x86-64, which the x86-64 TLS ABI sets to the thread control block's own address;
//! `tpidr_el0` on AArch64) holds the numbers of the threads that claimed a slot; a thread whose
//! slot another holds, or a platform without the register, reads the `thread_local!`.
//!
//! Any number is correct for any thread: a stripe is only where a thread's hit path looks
//! first, and every stripe is locked. A slot is one word, the thread pointer (64-byte aligned
//! on both platforms: the thread control block's alignment) with the number's low 6 bits in its
//! low bits, so that a claim is one store and a read one load; there are at most 64 stripes
//! (`HostAllocator::new`), so those bits choose the stripe. A slot whose thread exited keeps its
//! number for the next thread whose thread pointer hashes there (a thread pointer is often
//! reused, with its stack, by a later thread).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Slots of the table: a power of two.
const SLOTS: usize = 1024;

/// The bits of a slot that hold the number: stripes are at most `NUMBER_BITS + 1`.
pub(super) const NUMBER_BITS: usize = 63;

static TABLE: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];

static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's number, given at its first call (`usize::MAX` until then), and whether it
    /// tried to claim a slot yet.
    static NUMBER: Cell<(usize, bool)> = const { Cell::new((usize::MAX, false)) };
}

/// The calling thread's thread pointer, where one register holds it.
#[inline(always)]
fn thread_pointer() -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        let tp: usize;
        // SAFETY: reads the first word of the thread control block, which the x86-64 TLS ABI
        // sets to the block's own address for every thread; no memory is written.
        unsafe {
            std::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tp, options(nostack, readonly, preserves_flags))
        };
        Some(tp)
    }
    #[cfg(all(target_arch = "aarch64", target_os = "linux"))]
    {
        let tp: usize;
        // SAFETY: reads the thread pointer register, which every thread has; no memory access.
        unsafe { std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp, options(nostack, nomem, preserves_flags)) };
        Some(tp)
    }
    #[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_os = "linux")))]
    {
        None
    }
}

/// The slot of thread pointer `tp`: its bits mixed into the top ones (Fibonacci hashing).
#[inline(always)]
fn slot_of(tp: usize) -> &'static AtomicUsize {
    let h = (tp as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS.trailing_zeros());
    &TABLE[h as usize]
}

/// The calling thread's number (see the module's doc).
#[inline(always)]
pub(super) fn current() -> usize {
    match claimed() {
        Some(n) => n,
        None => current_slow(),
    }
}

/// The calling thread's number if it holds its slot: [`current`] without the thread-local, for
/// a caller that makes no call on its fast path (`host::hit`).
#[inline(always)]
pub(super) fn claimed() -> Option<usize> {
    let tp = thread_pointer()?;
    // The slot is `tp | number` where this thread holds it: then the exclusive or leaves the
    // number, and otherwise a value above `NUMBER_BITS`.
    let n = slot_of(tp).load(Ordering::Relaxed) ^ tp;
    (n <= NUMBER_BITS).then_some(n)
}

/// [`current`] from the thread-local: the number given at the thread's first call, and the
/// thread's slot claimed once (an empty one, or one another thread holds: a thread that
/// exited, or a live one that then reads its thread-local; each thread claims at most once, so
/// two threads never take a slot from each other back and forth). A thread pointer with any
/// of the number's bits set (not seen on either platform) claims none.
#[cold]
#[inline(never)]
fn current_slow() -> usize {
    let Ok((mut number, tried)) = NUMBER.try_with(Cell::get) else {
        // The thread-local is gone (a destructor at the thread's exit): any number will do.
        return 0;
    };
    if number == usize::MAX {
        number = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    if !tried
        && let Some(tp) = thread_pointer()
        && tp & NUMBER_BITS == 0
    {
        slot_of(tp).store(tp | (number & NUMBER_BITS), Ordering::Relaxed);
    }
    let _ = NUMBER.try_with(|n| n.set((number, true)));
    number
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_its_number_and_threads_get_different_ones() {
        let mine = current();
        assert_eq!(current(), mine, "the same number at each call");
        let others: Vec<(usize, usize)> =
            (0..8).map(|_| std::thread::spawn(|| (current(), current())).join().unwrap()).collect();
        for (a, b) in &others {
            assert_eq!(a, b);
        }
        let mut all: Vec<usize> = others.iter().map(|p| p.0).collect();
        all.push(mine);
        all.sort_unstable();
        all.dedup();
        // Round robin: numbers are distinct unless a later thread reused an exited one's thread
        // pointer and so its slot (then it reads the exited thread's number, which is free).
        assert!(all.len() >= 2, "threads got numbers {all:?}");
    }

    #[test]
    fn live_threads_have_distinct_stripes() {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(16));
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let b = barrier.clone();
                std::thread::spawn(move || {
                    let n = current() & NUMBER_BITS;
                    b.wait();
                    let again = current() & NUMBER_BITS;
                    b.wait();
                    (n, again)
                })
            })
            .collect();
        let mut nums: Vec<usize> = threads
            .into_iter()
            .map(|t| t.join().unwrap())
            // A thread may read a number twice and get two (any number is correct, see the
            // module's doc): its first read found its thread pointer in a slot an exited thread
            // claimed, a thread with a colliding pointer took that slot, and its next read gave
            // it a number of its own. The first is what it used; both are counted.
            .flat_map(|(a, b)| [a, b])
            .collect();
        nums.sort_unstable();
        nums.dedup();
        // Distinct modulo 64 unless the round robin passed a multiple of 64 between them, which
        // the other tests' threads (up to 16 here at once) cannot make it do more than once.
        assert!(nums.len() >= 15, "16 live threads at once got the stripes {nums:?}");
        assert!(nums.len() <= 32, "at most two numbers a thread: {nums:?}");
    }
}
