//! Random operation sequences on the simulated device, with every invariant checked after every
//! operation: live blocks never overlap and keep their contents, every byte of a segment
//! belongs to one block, statistics (peaks included) equal a recount, reserved equals what the
//! driver handed out, and after freeing everything and `empty_cache` reserved is 0.
//!
//! The same with driver faults: errors and panics (cudarc panics when `libcuda.so.1` lacks a
//! symbol) injected into random calls of every kind. After each operation, whatever it
//! returned or however it unwound, the invariants hold and the driver holds exactly what the
//! allocator counts as reserved; once the faults stop, everything can be freed, the cache
//! emptied, and the memory fraction's whole allowance allocated again. And an allocator that is
//! dropped gives the driver back all its memory and events.
//!
//! With the allocation history on, the same, and after every operation a snapshot that agrees
//! with the statistics and with a replay of the whole trace (faults and panics included: no
//! event for what was undone).
//!
//! The operations include private pools (routes by stream and by thread, release) and CUDA
//! graph captures on the simulated device: gpupool never makes a call that CUDA forbids during
//! capture (the simulated driver counts them), every capture ends valid, and a released pool
//! gives its memory back.
//!
//! The proptests are here, the runners in `run.rs` and `faults.rs`: proptest keys its
//! regression file (tests/proptest-regressions/sequences.txt) by this file's name.

use proptest::prelude::*;

use crate::common::MIB;
use crate::faults::{fault_op, run_with_faults};
use crate::ops::op;
use crate::run::run;

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_after_every_operation(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, usize::MAX, false, false);
    }

    #[test]
    fn invariants_hold_with_expandable_segments(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, usize::MAX, true, false);
    }

    #[test]
    fn invariants_hold_with_max_split_size(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, 24 * MIB, false, false);
    }

    #[test]
    fn invariants_hold_with_history_on(ops in proptest::collection::vec(op(), 1..160)) {
        run(ops, 24 * MIB, true, true);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 2048, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_driver_faults_and_panics(ops in proptest::collection::vec(fault_op(), 1..160)) {
        run_with_faults(ops, usize::MAX, None, false, false);
    }

    #[test]
    fn invariants_hold_under_driver_faults_and_panics_with_expandable_segments(
        ops in proptest::collection::vec(fault_op(), 1..160)
    ) {
        run_with_faults(ops, usize::MAX, Some(0.75), true, false);
    }

    #[test]
    fn invariants_hold_under_driver_faults_and_panics_with_a_memory_fraction(
        ops in proptest::collection::vec(fault_op(), 1..160)
    ) {
        run_with_faults(ops, 24 * MIB, Some(0.5), false, false);
    }

    #[test]
    fn invariants_hold_under_driver_faults_and_panics_with_history_on(
        ops in proptest::collection::vec(fault_op(), 1..160)
    ) {
        run_with_faults(ops, usize::MAX, Some(0.75), true, true);
    }
}
