//! The pinned host C API (`gpupool_host_*`) fuzzed from Rust: random sequences of every call
//! with arbitrary arguments (NULL, stack and garbage pointers, pointers into blocks, freed
//! pointers, zero and huge sizes, random streams, held streams, a `gpupool_host_stats_t` of any
//! `size`). After every call: no panic reached the boundary, the status is the one the header
//! documents, outputs were written only on success and never past the caller's `size`, the
//! host allocator's invariant checker holds, and no live block lost its contents.
//!
//! The process allocator reads `GPUPOOL_*` once: proptest runs the test in a process of its own
//! (`fork`), which sets them before any call.

use std::collections::BTreeMap;
use std::ffi::c_void;

use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::host::{
    gpupool_host_empty_cache, gpupool_host_free, gpupool_host_malloc, gpupool_host_record_event,
    gpupool_host_reset_peak_stats, gpupool_host_stats, gpupool_host_stats_t,
};
use gpupool::ffi::sim::{gpupool_sim_hold_stream, gpupool_sim_release_stream};
use gpupool::ffi::status::gpupool_status;
use proptest::prelude::*;

use gpupool_status::*;

#[derive(Clone, Debug)]
enum Addr {
    Null,
    Live(usize),
    Interior(usize, usize),
    Freed(usize),
    Stack,
    Garbage(usize),
}

#[derive(Clone, Debug)]
enum Call {
    Malloc { out_null: bool, size: usize },
    Free(Addr),
    Record(Addr, usize),
    EmptyCache,
    Stats { null: bool, size: u32 },
    ResetPeak,
    Hold(usize),
    Release(usize),
}

fn addr() -> impl Strategy<Value = Addr> {
    prop_oneof![
        1 => Just(Addr::Null),
        6 => any::<usize>().prop_map(Addr::Live),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, o)| Addr::Interior(i, o)),
        2 => any::<usize>().prop_map(Addr::Freed),
        1 => Just(Addr::Stack),
        1 => prop_oneof![Just(1usize), Just(usize::MAX), Just(0x1000), any::<usize>()].prop_map(Addr::Garbage),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    let size = prop_oneof![
        1 => Just(0usize),
        8 => 1usize..(8 << 20),
        1 => prop_oneof![Just(usize::MAX), Just((1usize << 63) + 1), Just(1usize << 63)],
    ];
    let stream = prop_oneof![Just(0usize), Just(0x10), Just(0x20)];
    prop_oneof![
        8 => (prop::bool::weighted(0.05), size).prop_map(|(out_null, size)| Call::Malloc { out_null, size }),
        7 => addr().prop_map(Call::Free),
        4 => (addr(), stream.clone()).prop_map(|(a, s)| Call::Record(a, s)),
        1 => Just(Call::EmptyCache),
        1 => (prop::bool::weighted(0.1), prop_oneof![0u32..16, 16u32..200, Just(u32::MAX)])
            .prop_map(|(null, size)| Call::Stats { null, size }),
        1 => Just(Call::ResetPeak),
        1 => stream.clone().prop_map(Call::Hold),
        1 => stream.prop_map(Call::Release),
    ]
}

#[derive(Default)]
struct Model {
    /// Live blocks: address -> (rounded size, cookie).
    live: BTreeMap<usize, (usize, u64)>,
    freed: Vec<usize>,
    cookie: u64,
}

impl Model {
    fn pick(&self, i: usize) -> Option<(usize, usize)> {
        (!self.live.is_empty()).then(|| self.live.iter().nth(i % self.live.len()).map(|(&p, &(s, _))| (p, s)))?
    }

    fn resolve(&self, a: &Addr, stack: &u64) -> usize {
        match *a {
            Addr::Null => 0,
            Addr::Live(i) => self.pick(i).map_or(0, |(p, _)| p),
            Addr::Interior(i, o) => self.pick(i).map_or(0x2000, |(p, s)| p + 1 + o % s.max(2).saturating_sub(1).max(1)),
            Addr::Freed(i) => self.freed.get(i % self.freed.len().max(1)).copied().unwrap_or(0x3000),
            Addr::Stack => stack as *const u64 as usize,
            Addr::Garbage(g) => g,
        }
    }
}

fn check(got: gpupool_status, want: &[gpupool_status], call: &Call) {
    assert_ne!(got, GPUPOOL_ERROR_INTERNAL, "{call:?}: a panic reached the boundary");
    assert!(want.contains(&got), "{call:?}: {got:?}, expected {want:?}");
    gpupool::ffi::process_host_allocator().unwrap().check_invariants();
}

fn run(m: &mut Model, call: &Call) {
    let stack = 0u64;
    match *call {
        Call::Malloc { out_null, size } => {
            let mut out = 0x5eed as *mut c_void;
            let ptr = if out_null { std::ptr::null_mut() } else { &raw mut out };
            // SAFETY: NULL or a writable `void *`.
            let st = unsafe { gpupool_host_malloc(ptr, size) };
            let too_big = size > 1 << 63;
            let want: &[_] = if out_null || too_big {
                &[GPUPOOL_ERROR_INVALID_VALUE]
            } else if size >= 1 << 40 {
                // More than the host can map: the driver's out of memory.
                &[GPUPOOL_ERROR_OUT_OF_MEMORY]
            } else {
                &[GPUPOOL_SUCCESS]
            };
            check(st, want, call);
            if st != GPUPOOL_SUCCESS {
                assert_eq!(out, 0x5eed as *mut c_void, "an output written on failure");
            } else if size == 0 {
                assert!(out.is_null());
            } else {
                let p = out as usize;
                let host = gpupool::ffi::process_host_allocator().unwrap();
                let rounded = host.block_size(p).expect("allocated");
                assert!(rounded >= size, "{size} bytes got a block of {rounded}");
                for (&q, &(s, _)) in &m.live {
                    assert!(p + rounded <= q || q + s <= p, "{p:#x} overlaps the live block at {q:#x}");
                }
                m.cookie += 1;
                // SAFETY: a live pinned block of `rounded` bytes, at least 1.
                unsafe {
                    std::ptr::copy_nonoverlapping(m.cookie.to_le_bytes().as_ptr(), out.cast::<u8>(), rounded.min(8))
                };
                m.live.insert(p, (rounded, m.cookie));
                m.freed.retain(|&f| f != p);
            }
        }
        Call::Free(ref a) => {
            let p = m.resolve(a, &stack);
            // SAFETY: any value is safe: only compared with gpupool's blocks.
            let st = unsafe { gpupool_host_free(p as *mut c_void) };
            let live = m.live.contains_key(&p);
            check(st, if p == 0 || live { &[GPUPOOL_SUCCESS] } else { &[GPUPOOL_ERROR_INVALID_POINTER] }, call);
            if let Some((size, cookie)) = m.live.remove(&p) {
                let n = size.min(8);
                let mut head = [0u8; 8];
                // SAFETY: the block was live until this free and stays pinned (cached).
                unsafe { std::ptr::copy_nonoverlapping(p as *const u8, head.as_mut_ptr(), n) };
                assert_eq!(head[..n], cookie.to_le_bytes()[..n], "the block at {p:#x} was overwritten while live");
                m.freed.push(p);
            }
        }
        Call::Record(ref a, s) => {
            let p = m.resolve(a, &stack);
            // SAFETY: any value is safe.
            let st = unsafe { gpupool_host_record_event(p as *mut c_void, s as gpupool_stream_t) };
            let ok = p == 0 || m.live.contains_key(&p);
            check(st, if ok { &[GPUPOOL_SUCCESS] } else { &[GPUPOOL_ERROR_INVALID_POINTER] }, call);
        }
        Call::EmptyCache => check(gpupool_host_empty_cache(), &[GPUPOOL_SUCCESS], call),
        Call::Stats { null, size } => {
            #[repr(C)]
            struct Padded {
                stats: gpupool_host_stats_t,
                guard: [u8; 64],
            }
            let mut buf = Padded { stats: gpupool_host_stats_t::default(), guard: [0xee; 64] };
            buf.stats.size = size;
            buf.stats.version = 0xdead;
            let out = if null { std::ptr::null_mut() } else { &raw mut buf.stats };
            // SAFETY: NULL or a struct with 64 guard bytes after it; `size` is clamped by
            // gpupool to its own sizeof, so a larger value stays inside.
            let st = unsafe { gpupool_host_stats(out) };
            let want: &[_] = if null || size < 8 { &[GPUPOOL_ERROR_INVALID_VALUE] } else { &[GPUPOOL_SUCCESS] };
            check(st, want, call);
            assert_eq!(buf.guard, [0xee; 64], "written past the struct");
            if st == GPUPOOL_SUCCESS {
                let full = size_of::<gpupool_host_stats_t>() as u32;
                assert_eq!(buf.stats.size, size.min(full));
                assert_eq!(buf.stats.version, 1);
                if size >= full {
                    // Live blocks are active; so are freed ones whose events are not yet seen.
                    assert!(buf.stats.active_requests.current as usize >= m.live.len());
                }
            } else {
                assert_eq!(buf.stats.version, 0xdead, "an output written on failure");
            }
        }
        Call::ResetPeak => check(gpupool_host_reset_peak_stats(), &[GPUPOOL_SUCCESS], call),
        Call::Hold(s) => check(gpupool_sim_hold_stream(s as gpupool_stream_t), &[GPUPOOL_SUCCESS], call),
        Call::Release(s) => check(gpupool_sim_release_stream(s as gpupool_stream_t), &[GPUPOOL_SUCCESS], call),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, fork: true, ..ProptestConfig::default() })]
    #[test]
    fn every_host_call_answers_as_documented(calls in prop::collection::vec(call(), 1..150)) {
        // SAFETY: the only test of its process sets them before its first call.
        unsafe {
            std::env::set_var("GPUPOOL_DRIVER", "sim");
            std::env::set_var("GPUPOOL_SIM_DEVICES", "2");
        }
        let mut m = Model::default();
        for c in &calls {
            run(&mut m, c);
        }
        for s in [0usize, 0x10, 0x20] {
            gpupool_sim_release_stream(s as gpupool_stream_t);
        }
        for &p in m.live.keys() {
            // SAFETY: a live block of this case.
            assert_eq!(unsafe { gpupool_host_free(p as *mut c_void) }, GPUPOOL_SUCCESS);
        }
        assert_eq!(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
        let mut s = gpupool_host_stats_t { size: size_of::<gpupool_host_stats_t>() as u32, ..Default::default() };
        // SAFETY: a whole struct.
        assert_eq!(unsafe { gpupool_host_stats(&mut s) }, GPUPOOL_SUCCESS);
        assert_eq!((s.active_requests.current, s.allocations.current), (0, 0));
    }
}
