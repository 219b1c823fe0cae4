//! Helpers of the page ladder's tests (`vmm/page_ladder.rs`, `vmm/ladder_hostile.rs`).

use gpupool::config::Config;

/// Expandable segments with large pages, a request of 20 MiB or more mapping at most
/// `per_request` pages (`GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST`; 0: 20 MiB pages at any size).
pub fn ladder(per_request: usize) -> Config {
    Config {
        expandable_segments: true,
        expandable_large_pages: true,
        expandable_pages_per_request: per_request,
        ..Config::default()
    }
}

/// Writes `byte` at each end of the `size` bytes at `ptr` and reads them back: the simulated
/// device's memory is host memory reserved lazily, so a page not mapped faults here, and a
/// block of gigabytes is not written whole.
pub fn touch_ends(ptr: u64, size: usize, byte: u8) {
    // SAFETY: the callers pass a live block of at least `size` bytes handed out by the
    // allocator on the simulated device, whose addresses are host memory.
    unsafe {
        let p = ptr as *mut u8;
        p.write(byte);
        p.add(size - 1).write(byte);
        assert_eq!((*p, *p.add(size - 1)), (byte, byte));
    }
}
