//! What the expandable segments' tests share: the configurations (expandable segments, with the
//! high-water rule), the page size, a CUDA error, and the checks that a block's pages are
//! mapped and that the driver has everything back.

use crate::common;

use common::check;
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::SIM_GRANULARITY;

pub(crate) const PAGE: usize = SIM_GRANULARITY;

pub(crate) fn expandable() -> Config {
    Config { expandable_segments: true, expandable_large_pages: false, ..Config::default() }
}

/// Empties the cache (every block is freed) and checks that the driver has everything back:
/// no memory, no page handle, no address range, no ordinary segment.
pub(crate) fn all_given_back(a: &gpupool::Allocator, drv: &gpupool::driver::sim::SimDriver) {
    a.empty_cache(0).unwrap();
    check(a);
    assert_eq!((drv.used(0), drv.live_vmm(), drv.live_allocations()), (0, (0, 0), 0));
    assert_eq!(a.stats(0).unwrap().segment.all.current, 0);
}

/// Writes `byte` over `size` bytes at `ptr` and reads it back (the simulated device's memory
/// is host memory: an unmapped page would fault here).
pub(crate) fn touch(ptr: u64, size: usize, byte: u8) {
    // SAFETY: `ptr` is a live block of at least `size` bytes handed out by the allocator.
    unsafe {
        let p = ptr as *mut u8;
        p.write_bytes(byte, size);
        assert_eq!(*p.add(size - 1), byte);
    }
}

pub(crate) fn reclaiming() -> Config {
    Config { expandable_reclaim: true, ..expandable() }
}

pub(crate) fn cuda(call: &'static str) -> DriverError {
    DriverError::Cuda { call, code: 999, name: "CUDA_ERROR_UNKNOWN".into() }
}
