//! Anonymous shared-memory files (`memfd_create`) and the size of the file behind a
//! descriptor: an IPC export's record, and the simulated device's memory, which other
//! processes map through descriptors they take with `pidfd_getfd` (`super::process`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// A new anonymous shared-memory file of `size` bytes (`memfd_create`, close-on-exec), sparse:
/// it takes memory only as it is written.
pub fn create(name: &str, size: usize) -> io::Result<OwnedFd> {
    let name = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `name` is a valid C string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just opened for us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The size in bytes of the file behind `fd` (`fstat`).
pub fn file_size(fd: &OwnedFd) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: fstat writes one struct stat, zeroed first.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: our descriptor and a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_size as usize)
}
