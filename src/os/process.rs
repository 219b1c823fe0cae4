//! Processes and their file descriptors, for sharing memory between processes: who a process
//! is (pid and start time, so that a reused pid is never taken for the process it replaced),
//! whether it still runs, and taking a copy of one of its descriptors (`pidfd_open` +
//! `pidfd_getfd`, Linux 5.6, as PyTorch's expandable segments do in `ExpandableSegment::import`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// A process: its pid and its start time in clock ticks since boot (`/proc/PID/stat`, field
/// 22), which together name it for as long as the machine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub pid: u32,
    pub start: u64,
}

/// The start time of process `pid`, or `None` when it does not run: no such process, or one
/// that exited and waits to be reaped (a zombie, state `Z` or `X`).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces or parentheses: the
    // fields after it follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `state` was field 3; the start time is field 22.
    fields.nth(18)?.parse().ok()
}

/// The calling process.
pub fn me() -> Identity {
    // SAFETY: getpid cannot fail.
    let pid = unsafe { libc::getpid() } as u32;
    Identity { pid, start: start_time(pid).unwrap_or(0) }
}

/// Whether `who` still runs (the same pid with the same start time, not a zombie).
pub fn alive(who: Identity) -> bool {
    start_time(who.pid) == Some(who.start)
}

/// Why a descriptor of another process could not be taken.
#[derive(Debug)]
pub enum FetchError {
    /// The process has exited (or its pid now names another process).
    Exited,
    /// The kernel refused: `pidfd_getfd` needs ptrace permission over the process (same user,
    /// and Yama's `ptrace_scope` allowing it), and a kernel of 5.6 or later; the error says.
    Refused(io::Error),
    /// The process has no such descriptor open.
    NoSuchFd,
}

/// `pidfd_open(pid)`, checked against `who`'s start time after it is open, so that the pidfd
/// names `who` and not a process that reused its pid.
pub fn open(who: Identity) -> Result<OwnedFd, FetchError> {
    // SAFETY: a plain system call with two integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, who.pid as libc::pid_t, 0) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ESRCH) { FetchError::Exited } else { FetchError::Refused(e) });
    }
    // SAFETY: a descriptor the kernel just opened for us.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    if !alive(who) {
        return Err(FetchError::Exited);
    }
    Ok(pidfd)
}

/// A copy of descriptor `fd` of the process behind `pidfd` (`pidfd_getfd`), close-on-exec.
pub fn getfd(pidfd: &OwnedFd, fd: RawFd) -> Result<OwnedFd, FetchError> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call with integer arguments.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EBADF) => FetchError::NoSuchFd,
            Some(libc::ESRCH) => FetchError::Exited,
            _ => FetchError::Refused(e),
        });
    }
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

/// Descriptor `fd` of process `who`: [`open`] then [`getfd`].
pub fn fetch(who: Identity, fd: RawFd) -> Result<OwnedFd, FetchError> {
    getfd(&open(who)?, fd)
}
