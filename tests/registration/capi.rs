//! The C call, `gpupool_segment_mapped_range`, through the process-wide allocator on the
//! simulated device: NULL and foreign arguments refused with a status and a message naming
//! the problem and nothing written, the range and its descriptor (owned by the caller, of the
//! range's size), growth of an expandable segment seen by asking again. In a process of its
//! own (`common::process::alone`): the process-wide allocator reads `GPUPOOL_*` once.

use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};

use crate::common::{last_error, process::alone_on_sim};
use crate::fd_size;
use gpupool::ffi::memory::{gpupool_free, gpupool_malloc};
use gpupool::ffi::registration::{gpupool_mapped_range_t, gpupool_segment_mapped_range};
use gpupool::ffi::status::gpupool_status::*;

fn blank() -> gpupool_mapped_range_t {
    gpupool_mapped_range_t {
        address: 7 as *mut c_void,
        bytes: 7,
        segment_address: 7 as *mut c_void,
        segment_bytes: 7,
        device: 7,
        expandable: 7,
        stream: 7 as *mut _,
        pool: 7,
    }
}

#[test]
fn the_c_call_refuses_bad_arguments_and_hands_out_a_range_and_its_descriptor() {
    if !alone_on_sim("256MiB") {
        return;
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    let mut range = blank();
    let mut fd: c_int = -7;
    // SAFETY (every call below): NULL or writable storage, as the header asks.
    unsafe {
        assert_eq!(gpupool_malloc(&mut p, 3 << 20, 0, std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_segment_mapped_range(p, std::ptr::null_mut(), &mut fd), GPUPOOL_ERROR_INVALID_VALUE);
        let m = last_error();
        assert!(m.starts_with("gpupool_segment_mapped_range") && m.contains("range is NULL"), "{m}");
        for bad in [std::ptr::null(), 64 as *const c_void] {
            assert_eq!(gpupool_segment_mapped_range(bad, &mut range, &mut fd), GPUPOOL_ERROR_INVALID_POINTER);
            assert!(last_error().contains("was not allocated by gpupool"), "{}", last_error());
        }
        assert_eq!((range.bytes, fd), (7, -7), "nothing written on error");

        // Without a descriptor: the range alone.
        assert_eq!(gpupool_segment_mapped_range(p, &mut range, std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!((range.device, range.expandable, range.pool, range.stream as usize), (0, 1, 0, 0));
        assert_eq!(range.bytes, 4 << 20, "two 2 MiB pages under a 3 MiB block");
        assert!(range.address as usize <= p as usize);
        let first = range;

        // Growth: a second block maps more pages; asked again, the run covers both.
        let mut q: *mut c_void = std::ptr::null_mut();
        assert_eq!(gpupool_malloc(&mut q, 8 << 20, 0, std::ptr::null_mut()), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_segment_mapped_range(q, &mut range, &mut fd), GPUPOOL_SUCCESS);
        assert_eq!((range.address, range.bytes), (first.address, 12 << 20));
        assert!(fd >= 0);
        let owned = OwnedFd::from_raw_fd(fd);
        assert_eq!(fd_size(&owned), range.bytes as u64, "the descriptor is the caller's, of the range's size");
        drop(owned);

        // A freed block is refused, its neighbour still answers.
        assert_eq!(gpupool_free(q), GPUPOOL_SUCCESS);
        let mut after = blank();
        assert_eq!(gpupool_segment_mapped_range(q, &mut after, &mut fd), GPUPOOL_ERROR_INVALID_POINTER);
        assert!(last_error().contains("not allocated"), "{}", last_error());
        assert_eq!(after.bytes, 7);
        assert_eq!(
            gpupool_segment_mapped_range((p as usize + 100) as *const c_void, &mut after, std::ptr::null_mut()),
            GPUPOOL_SUCCESS
        );
        assert_eq!(after.address, first.address);
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
    }
}
