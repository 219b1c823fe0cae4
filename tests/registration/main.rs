//! Registration for transports on the simulated device (`gpupool_segment_mapped_range`,
//! `caching::registration`): the mapped range of ordinary and expandable segments and its
//! dma-buf descriptor, growth and shrink told by the segment observers, the driver's rules
//! (`cuMemGetHandleForAddressRange`), faults injected, bad arguments, and threads allocating
//! while others ask. One test binary, a module per file.

#[path = "../common/mod.rs"]
mod common;

mod capi;
mod driver;
mod hostile;
mod ranges;

/// The size of the file behind `fd` as `lseek(fd, 0, SEEK_END)` reads it: what a transport
/// checks a dma-buf against.
pub fn fd_size(fd: &std::os::fd::OwnedFd) -> u64 {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on a descriptor the caller owns.
    let end = unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_END) };
    assert!(end >= 0, "lseek failed: {}", std::io::Error::last_os_error());
    end as u64
}

/// The mapped run around `ptr` as the simulated driver holds it: its pieces with access set,
/// joined where they touch. The oracle the allocator's answer is checked against.
pub fn driver_run(drv: &gpupool::driver::sim::SimDriver, device: i32, ptr: u64) -> Option<(u64, usize)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (a, s, _) in drv.access_map(device) {
        match runs.last_mut() {
            Some(last) if last.1 == a => last.1 = a + s as u64,
            _ => runs.push((a, a + s as u64)),
        }
    }
    runs.into_iter().find(|&(a, b)| a <= ptr && ptr < b).map(|(a, b)| (a, (b - a) as usize))
}
