//! The invariant checker (`Allocator::check_invariants`) after every call of random sequences
//! on the simulated device, with faults and panics injected at every driver call kind. A test
//! binary of its own, small enough for AddressSanitizer to build and run it alone
//! (scripts/test.sh).

#[path = "../common/mod.rs"]
mod common;

mod dropping;
mod faults;
mod ops;
mod panicking_driver;
mod run;
mod sequences;
