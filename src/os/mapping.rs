//! Anonymous memory mappings (`mmap(MAP_ANONYMOUS)`, `munmap`): host memory gpupool takes
//! straight from the kernel rather than from a heap, so that unmapping it truly gives it back.
//! Three users: the pageable host copies of sleeping pools (`driver::pageable`), the simulated
//! driver's pinned host memory, and the simulated device's address space (ranges reserved
//! without access, aligned as the driver aligns its own). One place for the call and its
//! failure check; `MAP_FIXED` remappings of ranges a caller already owns stay with that caller.

use std::ffi::{c_int, c_void};
use std::io;

/// Maps `size` bytes (more than 0) of zeroed anonymous private memory with protection `prot`
/// (`PROT_READ | PROT_WRITE`, or `PROT_NONE` for address space alone) anywhere; `noreserve`
/// adds `MAP_NORESERVE` (no swap is reserved: the simulated device's memory, mostly never
/// touched). Returns the mapping's address, or `None` when the kernel refuses (no address space,
/// overcommit refused it, a size of 0). Thread-safe; the caller owns the mapping and gives it
/// back with [`unmap`].
pub(crate) fn anonymous(size: usize, prot: c_int, noreserve: bool) -> Option<usize> {
    if size == 0 {
        return None;
    }
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if noreserve { libc::MAP_NORESERVE } else { 0 };
    // SAFETY: a new anonymous mapping with no address hint, which replaces nothing; the result
    // is checked.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), size, prot, flags, -1, 0) };
    (p != libc::MAP_FAILED).then_some(p as usize)
}

/// Reserves `size` bytes (more than 0) of address space without access (`PROT_NONE`,
/// `MAP_NORESERVE`) at an address that is a multiple of `align` (a power of two), as
/// `cuMemAddressReserve` and `cuMemAlloc` align theirs: `align` bytes more are reserved and what
/// is not used of them given back at once. Returns the aligned address, or `None` when the
/// kernel refuses. Thread-safe; the caller owns `[address, address + size)` and gives it back
/// with [`unmap`] (or maps over it with `MAP_FIXED`).
pub(crate) fn reserve_aligned(size: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    let span = size.checked_add(align)?;
    let start = anonymous(span, libc::PROT_NONE, true)?;
    let at = start.next_multiple_of(align);
    let end = at + size;
    // SAFETY: both pieces lie in the mapping just made, outside `[at, end)`, and nothing else
    // knows of them; a failure to trim leaves address space reserved, never a fault.
    unsafe {
        if at > start {
            let _ = unmap(start, at - start);
        }
        if start + span > end {
            let _ = unmap(end, start + span - end);
        }
    }
    Some(at)
}

/// Unmaps `size` bytes at `address`, giving the pages (and the address space) back to the
/// kernel. Errors: the kernel's (`EINVAL` for an address that is not page-aligned), as
/// [`io::Error`]. Thread-safe.
///
/// # Safety
/// `[address, address + size)` is a mapping (or part of one) of the caller's, from
/// [`anonymous`] or [`reserve_aligned`] or mapped over one of those, that nothing reads or
/// writes any more.
pub(crate) unsafe fn unmap(address: usize, size: usize) -> io::Result<()> {
    // SAFETY: per this function's contract.
    if unsafe { libc::munmap(address as *mut c_void, size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_anonymous_mapping_is_zeroed_writable_and_given_back() {
        let size = 3 * 4096;
        let p = anonymous(size, libc::PROT_READ | libc::PROT_WRITE, false).unwrap();
        // SAFETY: the mapping just made, readable and writable, `size` bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, size) };
        assert!(bytes.iter().all(|&b| b == 0));
        bytes[size - 1] = 7;
        // SAFETY: our mapping, no longer used.
        unsafe { unmap(p, size) }.unwrap();
        assert_eq!(anonymous(0, libc::PROT_NONE, true), None);
    }

    #[test]
    fn reserved_address_space_is_aligned_and_its_trim_leaves_only_it() {
        for align in [4096usize, 2 << 20, 64 << 20] {
            let at = reserve_aligned(5 << 20, align).unwrap();
            assert_eq!(at % align, 0);
            // SAFETY: exactly the reservation made.
            unsafe { unmap(at, 5 << 20) }.unwrap();
        }
        assert_eq!(reserve_aligned(usize::MAX - 10, 4096), None);
        // An address that is not page-aligned: the kernel's EINVAL, not a fault.
        // SAFETY: munmap refuses the unaligned address before touching anything.
        assert!(unsafe { unmap(1, 4096) }.is_err());
    }
}
