//! Issue 40's sleep race attacked again, with a fault at every driver call a sleep or a wake
//! makes: a block of the sleeping pool is freed, and the cache emptied, by a hook of the
//! simulated driver between the first stream's copies and the second stream's, then the
//! `k`-th call of one driver function fails. Whatever fails, nothing may be lost: a sleep that
//! fails before its pages go leaves every stream's free pages releasable again (a stream left
//! marked as keeping its pages would hold them for good), a sleep past that point wakes, a
//! wake that fails leaves the pool asleep and wakeable, and the live blocks keep their bytes.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::sleep::asleep;
use common::{MIB, check, sim_with};
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimFault, SimOp};
use gpupool::{Allocator, SleepMode};

const S: usize = 0x10;
const S2: usize = 0x20;
/// Block sizes of stream `S` (stream `S2` holds one of 1 MiB): the middle one, in the large
/// pool (the others are in the small one), spans a whole 20 MiB page of the sleepable layout,
/// so that freeing it leaves a page empty_cache may release (`reference` checks that one goes).
/// One page, not two: each of the few hundred cases copies the pool out and back, and the
/// simulated device's page faults were most of this file's CPU time.
const SIZES: [usize; 3] = [MIB, 20 * MIB, MIB];
/// Every this many bytes a block carries a stamp (the whole block is copied all the same).
const STRIDE: usize = 64 << 10;

fn stamp(p: u64, n: usize, seed: u64) {
    for at in (0..n).step_by(STRIDE).chain([n - 8]) {
        // SAFETY: a live block of `n` bytes, mapped by the simulated driver.
        unsafe { ((p as usize + at) as *mut u64).write_unaligned(seed ^ at as u64) };
    }
}

fn stamped(p: u64, n: usize, seed: u64) -> bool {
    // SAFETY: as in `stamp`; the pool is awake.
    (0..n)
        .step_by(STRIDE)
        .chain([n - 8])
        .all(|at| unsafe { ((p as usize + at) as *const u64).read_unaligned() } == seed ^ at as u64)
}

struct Setup {
    a: Arc<Allocator>,
    sim: Arc<SimDriver>,
    pool: u64,
    /// (address, bytes, stream) of every block; the middle one of stream `S` is the one freed.
    blocks: Vec<(u64, usize)>,
    freed: Arc<AtomicBool>,
}

const FREED: usize = 1;

/// Expandable segments, and a small staging ring (2 MiB chunks, two of them) so that each of
/// the few hundred allocators pins little.
/// Pages of 20 MiB in sleepable pools (`GPUPOOL_SLEEP_PAGE`): `SIZES` puts the middle block on
/// pages of its own.
fn config() -> Config {
    Config {
        expandable_segments: true,
        sleep_chunk: 2 * MIB,
        sleep_buffers: 2,
        sleep_threads: 1,
        sleep_page: 20 * MIB,
        ..Config::default()
    }
}

fn setup() -> Setup {
    let (a, sim) = sim_with(1, 256 * MIB, config());
    let a = Arc::new(a);
    let pool = a.pool_create_sleepable();
    let mut blocks = Vec::new();
    for (stream, sizes) in [(S, &SIZES[..]), (S2, &[MIB][..])] {
        a.begin_allocate_to_pool(0, pool, stream).unwrap();
        for &n in sizes {
            let p = a.malloc(n, 0, stream).unwrap();
            stamp(p, n, blocks.len() as u64 + 1);
            blocks.push((p, n));
        }
        a.end_allocate_to_pool(0, pool).unwrap();
    }
    Setup { a, sim, pool, blocks, freed: Arc::new(AtomicBool::new(false)) }
}

impl Setup {
    /// The hook: once every copy is queued (no lock held: the stream synchronisation that
    /// waits for them), the first stream's middle block freed and the cache emptied. A
    /// discarding sleep copies nothing: no hook.
    fn arm(&self, mode: SleepMode) {
        if !mode.offloads() {
            return;
        }
        let (a, freed, p) = (self.a.clone(), self.freed.clone(), self.blocks[FREED].0);
        self.sim.on_call(SimOp::StreamSynchronize, 0, move || {
            a.free(p).unwrap();
            let _ = a.empty_cache(0);
            freed.store(true, Ordering::SeqCst);
        });
    }

    fn reserved(&self) -> i64 {
        self.a.pool_stats(0, self.pool).unwrap().stats.reserved_bytes.all.current
    }

    /// Wakes the pool if it sleeps (with no fault left), checks every live block, frees the
    /// middle block if the hook did not, empties the cache and returns the pool's reserved
    /// bytes.
    fn settle(&self, what: &str, offloads: bool, slept_before: bool) -> i64 {
        self.sim.clear_hooks();
        check(&self.a);
        let slept = asleep(&self.a, self.pool);
        if slept {
            self.a.wake(0, self.pool).unwrap_or_else(|e| panic!("{what}: the pool could not wake: {e}"));
        }
        check(&self.a);
        for (i, &(p, n)) in self.blocks.iter().enumerate() {
            if i != FREED && (offloads || !(slept || slept_before)) {
                assert!(stamped(p, n, i as u64 + 1), "{what}: block {i} lost its contents");
            }
        }
        if !self.freed.load(Ordering::SeqCst) {
            self.a.free(self.blocks[FREED].0).unwrap();
        }
        self.a.empty_cache(0).unwrap_or_else(|e| panic!("{what}: empty_cache failed: {e}"));
        check(&self.a);
        self.reserved()
    }
}

/// An error at every call; out of memory at the calls that make memory.
fn faults(op: SimOp) -> Vec<(&'static str, SimFault)> {
    let err = DriverError::Cuda { call: "injected", code: 999, name: "CUDA_ERROR_UNKNOWN".into() };
    let mut f = vec![("error", SimFault::Fail(err))];
    if matches!(op, SimOp::MemCreate | SimOp::MemMap | SimOp::HostAlloc | SimOp::HostMap | SimOp::HostRegister) {
        f.push(("out of memory", SimFault::Fail(DriverError::OutOfMemory)));
    }
    f
}

/// The driver functions a sleep or a wake calls (the others of `SimOp::ALL` fire in neither).
const OPS: [SimOp; 21] = [
    SimOp::EventCreate,
    SimOp::EventRecord,
    SimOp::EventSynchronize,
    SimOp::EventDestroy,
    SimOp::DeviceSynchronize,
    SimOp::StreamCreate,
    SimOp::StreamSynchronize,
    SimOp::StreamDestroy,
    SimOp::MemcpyDtoH,
    SimOp::MemcpyHtoD,
    SimOp::HostAlloc,
    SimOp::HostFree,
    SimOp::HostRegister,
    SimOp::HostUnregister,
    SimOp::HostMap,
    SimOp::HostUnmap,
    SimOp::MemCreate,
    SimOp::MemMap,
    SimOp::MemSetAccess,
    SimOp::MemUnmap,
    SimOp::MemRelease,
];

/// The first calls of each driver function a fault is put at (the first three cover every call
/// of a stream's sleep and wake here but the copies' chunks, of which they are a sample).
const SKIPS: u32 = 3;

/// The modes that copy, whose copies a free and a release could break (a discarding sleep has
/// no copy window: `sleep.rs` and the fault proptest cover its failures).
const MODES: [SleepMode; 2] = [SleepMode::Offload, SleepMode::OffloadPinned];

/// What the pool reserves once the middle block is freed and the cache emptied, no fault.
fn reference(mode: SleepMode) -> i64 {
    let s = setup();
    let before = s.reserved();
    s.arm(mode);
    s.a.sleep(0, s.pool, mode).unwrap();
    assert_eq!(s.freed.load(Ordering::SeqCst), mode.offloads(), "the hook ran inside the sleep");
    let after = s.settle("reference", mode.offloads(), true);
    assert_eq!(after, before - (20 * MIB) as i64, "the middle block's page went back");
    after
}

#[test]
fn a_sleep_failing_at_any_call_after_a_free_inside_it_leaves_its_pages_releasable() {
    let mut fired = 0;
    for mode in MODES {
        let want = reference(mode);
        for op in OPS {
            for (name, fault) in faults(op) {
                for skip in 0..SKIPS {
                    let s = setup();
                    s.arm(mode);
                    s.sim.inject(op, skip, fault.clone());
                    let r = s.a.sleep(0, s.pool, mode);
                    let pending = s.sim.clear_faults();
                    let what = format!("{mode:?}, {op:?} #{skip} ({name}): sleep {r:?}");
                    let got = s.settle(&what, mode.offloads(), false);
                    assert_eq!(got, want, "{what}: the pages of the block freed stay reserved after empty_cache");
                    if pending != 0 {
                        break;
                    }
                    fired += 1;
                }
            }
        }
    }
    eprintln!("sleep faults fired: {fired}");
    assert!(fired > 30, "faults fired: {fired}");
}

#[test]
fn a_wake_failing_at_any_call_after_a_free_during_the_sleep_wakes_later() {
    let mut fired = 0;
    for mode in MODES {
        let want = reference(mode);
        for op in OPS {
            for (name, fault) in faults(op) {
                for skip in 0..SKIPS {
                    let s = setup();
                    s.arm(mode);
                    s.a.sleep(0, s.pool, mode).unwrap();
                    s.sim.inject(op, skip, fault.clone());
                    let r = s.a.wake(0, s.pool);
                    let pending = s.sim.clear_faults();
                    let what = format!("{mode:?}, {op:?} #{skip} ({name}): wake {r:?}");
                    assert_eq!(r.is_err(), asleep(&s.a, s.pool), "{what}: a failed wake leaves the pool asleep");
                    let got = s.settle(&what, mode.offloads(), true);
                    assert_eq!(got, want, "{what}: the pages of the block freed stay reserved after empty_cache");
                    if pending != 0 {
                        break;
                    }
                    fired += 1;
                }
            }
        }
    }
    eprintln!("wake faults fired: {fired}");
    assert!(fired > 20, "faults fired: {fired}");
}
