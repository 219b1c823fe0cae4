//! The simulated devices' physical memory: one `memfd` per device, sparse, of which every
//! allocation (`mem_alloc`) and every physical handle (`mem_create`) is an extent, mapped
//! shared wherever the allocation or the handle is mapped.
//!
//! Why a file from the start: memory that another process may map must be a file's, and
//! memory first made anonymous and turned into a file's at its first export had to be copied
//! into the file and the file mapped over it, a window in which another thread's writes to the
//! same page (a neighbouring block) were lost (issue 40). Backed by the file from its creation,
//! a page's bytes never move, and an export only hands out a descriptor. One file per device,
//! not one per allocation: the suite makes tens of thousands of allocations, and a process may
//! hold only so many descriptors.
//!
//! Extents are multiples of the host page, taken first fit from the extents given back
//! (coalesced), else at the file's end (the file grows, sparse: it costs memory only as it is
//! written). An extent given back has its pages dropped (`FALLOC_FL_PUNCH_HOLE`): the host gets
//! the memory back, and the next allocation there reads zeros; the file shrinks when its last
//! extent goes.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::os::{mapping, memfd};

/// The host's page size, which every extent's offset and length are multiples of.
pub(super) fn host_page() -> u64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64
}

/// One device's physical memory.
pub(super) struct DeviceFile {
    fd: OwnedFd,
    /// The file's length: the end of the last extent handed out.
    len: u64,
    /// Extents given back and not yet handed out again: offset -> length, none touching another.
    free: BTreeMap<u64, u64>,
}

impl DeviceFile {
    pub(super) fn new() -> io::Result<DeviceFile> {
        Ok(DeviceFile { fd: memfd::create("gpupool-sim-device", 0)?, len: 0, free: BTreeMap::new() })
    }

    /// The descriptor, for a simulated `cuIpcGetMemHandle` (the importer takes it by number).
    pub(super) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// An extent of `size` bytes (rounded up to the host page): its offset.
    ///
    /// Errors: the system's, when the file cannot grow.
    pub(super) fn take(&mut self, size: u64) -> io::Result<u64> {
        let size = size.next_multiple_of(host_page());
        let fit = self.free.iter().find(|&(_, &len)| len >= size).map(|(&at, &len)| (at, len));
        if let Some((at, len)) = fit {
            self.free.remove(&at);
            if len > size {
                self.free.insert(at + size, len - size);
            }
            return Ok(at);
        }
        let at = self.len;
        // SAFETY: a plain system call on our descriptor.
        if unsafe { libc::ftruncate(self.fd.as_raw_fd(), (at + size) as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        self.len = at + size;
        Ok(at)
    }

    /// Gives back the extent of `size` bytes at `offset` (as [`DeviceFile::take`] gave it): its
    /// pages dropped, the host's memory freed.
    pub(super) fn give_back(&mut self, offset: u64, size: u64) {
        let mut at = offset;
        let mut len = size.next_multiple_of(host_page());
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // The system call itself, not glibc's wrapper: that one is a cancellation point, and a
        // free must not end a thread that `pthread_cancel` asked to end (the C tests cancel
        // threads inside gpupool). A failure leaves the pages in place, holding what they held.
        // SAFETY: a plain system call on our descriptor.
        let punched = unsafe {
            libc::syscall(libc::SYS_fallocate, self.fd.as_raw_fd(), mode, at as libc::off_t, len as libc::off_t)
        } == 0;
        if !punched {
            // Not handed out again: the next allocation there must read zeros, as a new one.
            return;
        }
        if let Some((&before, &blen)) = self.free.range(..at).next_back()
            && before + blen == at
        {
            self.free.remove(&before);
            (at, len) = (before, blen + len);
        }
        if let Some(after) = self.free.remove(&(at + len)) {
            len += after;
        }
        if at + len == self.len {
            // The last extent: the file shrinks.
            // SAFETY: a plain system call on our descriptor.
            if unsafe { libc::ftruncate(self.fd.as_raw_fd(), at as libc::off_t) } == 0 {
                self.len = at;
                return;
            }
        }
        self.free.insert(at, len);
    }

    /// Maps `size` bytes of the file from `offset` shared at `at` (over host address space the
    /// caller owns) with `prot`, or anywhere when `at` is `None`; returns where.
    pub(super) fn map(&self, at: Option<u64>, offset: u64, size: usize, prot: libc::c_int) -> Option<u64> {
        map_fd(&self.fd, at, offset, size, prot)
    }

    /// Maps `size` bytes of the file from `offset` shared, readable and writable, at an address
    /// that is a multiple of `align` (a power of two): `cuMemAlloc` returns allocations of 2
    /// MiB and more on a 2 MiB boundary, and programs (and tests) count on it. Address space
    /// `align` larger is reserved, and what is not used of it given back.
    pub(super) fn map_aligned(&self, offset: u64, size: usize, align: u64) -> Option<u64> {
        let at = mapping::reserve_aligned(size, align as usize)? as u64;
        let mapped = self.map(Some(at), offset, size, libc::PROT_READ | libc::PROT_WRITE);
        if mapped.is_none() {
            // SAFETY: the reservation just made, ours, unused.
            let _ = unsafe { mapping::unmap(at as usize, size) };
        }
        mapped
    }

    /// A descriptor of its own (a new open file description of the same file, not a
    /// duplicate) positioned at `offset`: what a simulated `cuMemExportToShareableHandle` hands
    /// out. The importer reads the position back with `lseek` ([`imported_extent`]): the
    /// descriptor alone names the extent, as a real one names its allocation.
    pub(super) fn export(&self, offset: u64) -> io::Result<OwnedFd> {
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid C string; the result is checked.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor the kernel just opened for us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a plain system call on our descriptor.
        if unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, libc::SEEK_SET) } != offset as libc::off_t {
            return Err(io::Error::last_os_error());
        }
        Ok(fd)
    }
}

/// The extent an exported descriptor ([`DeviceFile::export`]) names: its position, if `size`
/// bytes from there lie in the file and the position is a multiple of `align`.
pub(super) fn imported_extent(fd: &OwnedFd, size: usize, align: u64) -> Option<u64> {
    // SAFETY: a plain system call on a descriptor we hold.
    let at = unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_CUR) };
    let len = memfd::file_size(fd).ok()? as u64;
    let at = u64::try_from(at).ok()?;
    (at % align == 0 && at.checked_add(size as u64).is_some_and(|end| end <= len)).then_some(at)
}

/// Maps `size` bytes of `fd` from `offset`, shared, with `prot`, at `at` (replacing what the
/// driver had there) or anywhere; returns where.
pub(super) fn map_fd(fd: &OwnedFd, at: Option<u64>, offset: u64, size: usize, prot: libc::c_int) -> Option<u64> {
    let (hint, fixed) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: with MAP_FIXED, `at` lies in host address space the simulated driver owns
    // (checked by the callers), so only its pages are replaced; the result is checked.
    let p = unsafe { libc::mmap(hint, size, prot, libc::MAP_SHARED | fixed, fd.as_raw_fd(), offset as libc::off_t) };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

/// Maps the pages of the shared mapping at `hold` (`size` bytes) again at `at`, readable and
/// writable, replacing what the driver had there: the same memory, with no descriptor (an
/// imported handle keeps none, as a real one; `mremap` with an old size of 0 duplicates a
/// shared mapping).
pub(super) fn map_again(hold: u64, at: u64, size: usize) -> bool {
    let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
    // SAFETY: `hold` is a shared mapping of the driver's of `size` bytes, and `at` lies in a
    // range the driver reserved (checked by the callers); the results are checked.
    unsafe {
        let p = libc::mremap(hold as *mut libc::c_void, 0, size, flags, at as *mut libc::c_void);
        p != libc::MAP_FAILED && libc::mprotect(p, size, libc::PROT_READ | libc::PROT_WRITE) == 0
    }
}
