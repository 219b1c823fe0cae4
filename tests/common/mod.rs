//! Helpers shared by the integration tests: an allocator over a fresh simulated device.
#![allow(dead_code)]

pub mod history;
pub mod ladder;
pub mod process;
pub mod sleep;

use std::sync::Arc;

use gpupool::Allocator;
use gpupool::config::Config;
use gpupool::driver::sim::SimDriver;

pub const MIB: usize = 1 << 20;

/// The calling thread's last error message from the C API (`gpupool_last_error_message`), for
/// the tests that go through the exports.
pub fn last_error() -> String {
    // SAFETY: gpupool's message, NUL-terminated and alive until this thread's next failing call.
    unsafe { std::ffi::CStr::from_ptr(gpupool::ffi::status::gpupool_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Device 0's pinned host bytes kept for sleep (`gpupool_sleep_host_bytes`'s `kept`).
pub fn sleep_kept() -> usize {
    let mut k = usize::MAX;
    // SAFETY: NULL and a writable size_t.
    let st = unsafe { gpupool::ffi::sleep::gpupool_sleep_host_bytes(0, std::ptr::null_mut(), &mut k) };
    assert_eq!(st, gpupool::ffi::status::gpupool_status::GPUPOOL_SUCCESS);
    k
}

/// The next number of a xorshift64 generator (Marsaglia), for the tests' reproducible random
/// calls: `state` must not be 0.
pub fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// An allocator under PyTorch's defaults ([`Config::pytorch`]: ordinary segments), whose
/// rules most tests check one for one against PyTorch's.
pub fn sim(devices: i32, capacity: usize) -> (Allocator, Arc<SimDriver>) {
    sim_with(devices, capacity, Config::pytorch())
}

pub fn sim_with(devices: i32, capacity: usize, config: Config) -> (Allocator, Arc<SimDriver>) {
    let driver = Arc::new(SimDriver::new(devices, capacity));
    (Allocator::new(driver.clone(), config), driver)
}

/// Panics with the checker's finding if any invariant is broken.
pub fn check(a: &Allocator) {
    if let Err(e) = a.check_invariants() {
        panic!("invariant broken: {e}");
    }
}

/// Whether every byte of `b` is `byte(i)` at its index `i`: a piece at a time into a buffer,
/// then compared whole (`memcmp`), since a byte-by-byte `all` does not vectorise and the sleep
/// and IPC tests check hundreds of MiB so.
pub fn holds_pattern(b: &[u8], byte: impl Fn(usize) -> u8) -> bool {
    const PIECE: usize = 64 << 10;
    let mut want = vec![0u8; PIECE.min(b.len())];
    b.chunks(PIECE).enumerate().all(|(k, got)| {
        let want = &mut want[..got.len()];
        for (j, x) in want.iter_mut().enumerate() {
            *x = byte(k * PIECE + j);
        }
        got == want
    })
}
