//! The C API fuzzed from Rust: long random sequences of calls of every `extern "C"` function of
//! `gpupool::ffi::{memory, stats, status, sim}` with arbitrary arguments (NULL and garbage
//! pointers, pointers into blocks, freed pointers, zero and huge sizes, devices -2 to 3, random
//! stream handles, memory fractions that are NaN, negative or above 1, buffers too small for
//! the memory summary, a `gpupool_stats_t` with any `size`).
//!
//! After every call: no panic reached the boundary (no `GPUPOOL_ERROR_INTERNAL`), the status
//! is the one the header documents for those arguments, outputs were written only on success
//! and never past the caller's buffer, and the process allocator's invariant checker holds. A
//! model of the live blocks checks that no two overlap and that each keeps its contents.
//!
//! The process allocator reads `GPUPOOL_*` once, at its first use: proptest runs the test in a
//! process of its own (`fork`), which sets them before any call, so no other test shares the
//! allocator.//!
//! The calls and their strategies are in `fuzz_calls.rs`, the model and the checks after each
//! call in `fuzz_model.rs`; the proptest stays here, where its regression file
//! (tests/proptest-regressions/fuzz.txt) is keyed.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Once;

use gpupool::ffi::memory::{gpupool_empty_cache, gpupool_free, gpupool_set_memory_fraction};
use gpupool::ffi::sim::{gpupool_sim_release_stream, gpupool_sim_set_device};
use proptest::prelude::*;

use crate::fuzz_calls::{CAPACITY, DEVICES, call};
use crate::fuzz_model::{Model, drain, run_call, stream_t};

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the only test of its process calls this before any other thread of the test
        // reads the environment, and before the process allocator starts.
        unsafe {
            std::env::set_var("GPUPOOL_DRIVER", "sim");
            std::env::set_var("GPUPOOL_SIM_CAPACITY", CAPACITY);
            std::env::set_var("GPUPOOL_SIM_DEVICES", DEVICES.to_string());
            std::env::remove_var("GPUPOOL_MAX_SPLIT_SIZE_MB");
        }
    });
}

/// A case's model; if the case fails, gives back what it can without checking anything, so
/// that the runs proptest makes to shrink the failure start from an empty allocator too.
struct Case(Model);

impl Drop for Case {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let m = &mut self.0;
        for &s in &m.held {
            gpupool_sim_release_stream(stream_t(s));
        }
        for &p in m.live.keys() {
            // SAFETY: gpupool_free never dereferences its argument.
            unsafe { gpupool_free(p as *mut c_void) };
        }
        for d in 0..DEVICES {
            gpupool_set_memory_fraction(1.0, d);
        }
        gpupool_sim_set_device(0);
        gpupool_empty_cache(-1);
    }
}

fn cases() -> u32 {
    std::env::var("GPUPOOL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 4096, fork: true, ..ProptestConfig::default() })]

    #[test]
    fn c_api_survives_any_sequence_of_calls(calls in proptest::collection::vec(call(), 1..400)) {
        setup();
        let mut case = Case(Model { live: BTreeMap::new(), freed: Vec::new(), current: 0, held: Vec::new(), cookie: 0 });
        for c in &calls {
            run_call(&mut case.0, c);
        }
        drain(&mut case.0);
    }
}
