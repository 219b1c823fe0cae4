//! Calls to CUDA memory functions that the shim does not serve, counted by name for the exit
//! report (`GPUPOOL_PRELOAD_STATS`): so that a run says what gpupool missed, as XLA's device
//! allocator (JAX 0.10 and later), which maps every buffer with CUDA's virtual memory calls
//! (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, ...) instead of calling `cuMemAlloc`.
//!
//! A lookup of one of [`NAMES`] (by `dlsym` in the driver's or the runtime's handle,
//! `cuGetProcAddress`, `cudaGetDriverEntryPoint`) that the shim passes through gets, instead
//! of the driver's function, a *trampoline*: two instructions that count the call and jump
//! to the driver's function with every register and the stack as the program left them, so
//! it behaves as the driver's whatever its signature. One trampoline per distinct driver
//! function ([`SLOTS`] of them); when they are all taken, later lookups get the driver's
//! function unchanged and the report says how many. Functions the shim serves (`cuMemAlloc`,
//! `cudaMalloc`, ...) are never wrapped, even where a lookup of them passes through (the
//! per-thread stream's `cuMemAllocAsync`): their pointers stay the driver's.
//!
//! Only on x86-64 Linux with glibc, as `dlsym.rs`; elsewhere nothing is wrapped or counted.
//! Calls made through the dynamic symbols (`-lcuda` calling `cuMemCreate` directly) are not
//! seen: the shim does not define those symbols. Its own module, importing none of the
//! others.

use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

/// The memory functions whose passed-through calls are counted, by base name (without the
/// `_v2`, `_v3`, `_ptsz`, `_ptds` suffixes, as `cuGetProcAddress` names them): those that
/// allocate, map or free device, managed or pinned memory and that the shim does not serve.
pub(crate) const NAMES: [&str; 31] = [
    // The driver's virtual memory management: how XLA allocates.
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemImportFromShareableHandle",
    // The driver's other allocations.
    "cuMemAllocManaged",
    "cuMemAllocPitch",
    "cuMemAllocFromPoolAsync",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolImportPointer",
    "cuMemHostRegister",
    "cuMemHostUnregister",
    "cuArrayCreate",
    "cuArrayDestroy",
    // The runtime's.
    "cudaMallocManaged",
    "cudaMallocPitch",
    "cudaMalloc3D",
    "cudaMallocArray",
    "cudaMalloc3DArray",
    "cudaMallocMipmappedArray",
    "cudaMallocFromPoolAsync",
    "cudaFreeArray",
    "cudaFreeMipmappedArray",
    "cudaMemPoolCreate",
    "cudaMemPoolDestroy",
    "cudaMemPoolImportPointer",
    "cudaHostRegister",
    "cudaHostUnregister",
];

/// How many distinct driver or runtime functions can be counted.
pub(crate) const SLOTS: usize = 128;

/// The function slot `i`'s trampoline jumps to; null while the slot is free. Read by the
/// trampolines' assembly, so a plain pointer-sized array.
static REAL: [AtomicPtr<c_void>; SLOTS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];
/// Calls through slot `i`'s trampoline (incremented by its assembly, `lock inc`).
static CALLS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
/// Slot `i`'s index in [`NAMES`]; `usize::MAX` until set (just after `REAL[i]`).
static NAME: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(usize::MAX) }; SLOTS];
/// Lookups of [`NAMES`] left unwrapped because every slot was taken.
static UNCOUNTED: AtomicU64 = AtomicU64::new(0);

/// `name` without its version and per-thread stream suffixes: `cuMemAllocPitch_v2` ->
/// `cuMemAllocPitch`, `cudaMallocFromPoolAsync_ptsz` -> `cudaMallocFromPoolAsync`.
pub(crate) fn base_name(mut name: &[u8]) -> &[u8] {
    loop {
        let stripped = [&b"_ptsz"[..], b"_ptds", b"_v2", b"_v3"].iter().find_map(|s| name.strip_suffix(*s));
        match stripped {
            Some(rest) => name = rest,
            None => return name,
        }
    }
}

/// The index in [`NAMES`] of the function `name` (exported or base name), if counted.
pub(crate) fn index(name: &[u8]) -> Option<usize> {
    let base = base_name(name);
    NAMES.iter().position(|n| n.as_bytes() == base)
}

/// What a passed-through lookup of `name` that found `real` returns: a trampoline that counts
/// the calls and jumps to `real` if `name` is one of [`NAMES`], `real` otherwise (null, a
/// function not counted, no slot left, or already a trampoline: `cudaGetDriverEntryPoint`
/// answers with what the shim's `cuGetProcAddress` gave the runtime). Thread-safe, lock-free,
/// allocates nothing (it runs inside `dlsym`).
pub(crate) fn wrap(name: &[u8], real: *mut c_void) -> *mut c_void {
    if real.is_null() {
        return real;
    }
    let Some(which) = index(name) else { return real };
    wrap_at(which, real)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
fn wrap_at(which: usize, real: *mut c_void) -> *mut c_void {
    if trampolines::ALL.iter().any(|&t| t as *mut c_void == real) {
        return real;
    }
    for (slot, r) in REAL.iter().enumerate() {
        let found = match r.compare_exchange(std::ptr::null_mut(), real, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                NAME[slot].store(which, Ordering::Release);
                true
            }
            Err(other) => other == real,
        };
        if found {
            return trampolines::ALL[slot] as *mut c_void;
        }
    }
    UNCOUNTED.fetch_add(1, Ordering::Relaxed);
    real
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")))]
fn wrap_at(_: usize, real: *mut c_void) -> *mut c_void {
    real
}

/// The exit report's lines, one a function, in [`NAMES`]' order, summed by base name, only
/// those called: `passed through 812 calls to cuMemCreate (not served)`; one saying so when
/// none was called; and one with the lookups left uncounted, if any. Reads counters only.
pub(crate) fn report() -> Vec<String> {
    let mut sums = [0u64; NAMES.len()];
    for slot in 0..SLOTS {
        let which = NAME[slot].load(Ordering::Acquire);
        if let Some(sum) = sums.get_mut(which) {
            *sum += CALLS[slot].load(Ordering::Relaxed);
        }
    }
    let mut lines: Vec<String> = NAMES
        .iter()
        .zip(sums)
        .filter(|&(_, n)| n > 0)
        .map(|(name, n)| format!("passed through {n} calls to {name} (not served)"))
        .collect();
    if lines.is_empty() {
        lines.push("passed through 0 calls to memory functions it does not serve".to_owned());
    }
    let uncounted = UNCOUNTED.load(Ordering::Relaxed);
    if uncounted > 0 {
        lines.push(format!("{uncounted} lookups of memory functions not counted (no slot left)"));
    }
    lines
}

/// The trampolines: slot `I`'s counts a call in `CALLS[I]` and jumps to `REAL[I]`, touching
/// no register but the flags (which no call preserves) and not the stack, so the driver's
/// function runs with the program's arguments and returns straight to the program.
#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
mod trampolines {
    use super::{CALLS, REAL, SLOTS};

    /// A trampoline, typed as a function of no arguments: only its address is ever used.
    pub(super) type Trampoline = unsafe extern "C" fn();

    /// Slot `I`'s trampoline. The CFI lines describe its (empty) frame for unwinders and
    /// profilers (rustc writes none for a naked function).
    #[unsafe(naked)]
    unsafe extern "C" fn trampoline<const I: usize>() {
        core::arch::naked_asm!(
            ".cfi_startproc",
            "lock inc qword ptr [rip + {calls} + {at}]",
            "jmp qword ptr [rip + {real} + {at}]",
            ".cfi_endproc",
            calls = sym CALLS,
            real = sym REAL,
            at = const I * 8,
        )
    }

    macro_rules! all {
        ($($i:literal)*) => { [$(trampoline::<$i> as Trampoline),*] };
    }

    /// Every slot's trampoline, by slot.
    pub(super) static ALL: [Trampoline; SLOTS] = all!(
        0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
        32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
        64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95
        96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_matched_by_base_name_only() {
        assert_eq!(base_name(b"cuMemAllocPitch_v2"), b"cuMemAllocPitch");
        assert_eq!(base_name(b"cudaMallocFromPoolAsync_ptsz"), b"cudaMallocFromPoolAsync");
        assert_eq!(base_name(b"_v2"), b"");
        assert!(index(b"cuMemCreate").is_some());
        assert_eq!(index(b"cuMemAllocPitch_v2"), index(b"cuMemAllocPitch"));
        // Served by the shim, or not memory functions: never counted.
        for name in [&b"cuMemAlloc_v2"[..], b"cudaMalloc", b"cuMemcpy", b"cuMemCreateX", b"", b"cuInit"] {
            assert!(index(name).is_none(), "{}", String::from_utf8_lossy(name));
        }
    }

    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_wrapped_function_is_called_with_its_arguments_and_counted() {
        unsafe extern "C" fn add(a: u64, b: u64, c: u64, d: u64, e: u64, f: u64, g: u64, h: u64) -> u64 {
            a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f + 7 * g + 8 * h
        }
        type AddFn = unsafe extern "C" fn(u64, u64, u64, u64, u64, u64, u64, u64) -> u64;
        let real = add as AddFn as *mut c_void;
        assert_eq!(wrap(b"cuMemAlloc_v2", real), real);
        assert!(wrap(b"cuMemMap", std::ptr::null_mut()).is_null());
        let t = wrap(b"cuMemMap", real);
        assert_ne!(t, real);
        // The same function again, and a trampoline given back: the same trampoline.
        assert_eq!(wrap(b"cuMemMap", real), t);
        assert_eq!(wrap(b"cuMemUnmap", t), t);
        let slot = trampolines::ALL.iter().position(|&f| f as *mut c_void == t).unwrap();
        let before = CALLS[slot].load(Ordering::Relaxed);
        // SAFETY: t jumps to add, whose signature this is.
        let f = unsafe { std::mem::transmute::<*mut c_void, AddFn>(t) };
        let threads: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(move || (0..100).map(|_| unsafe { f(1, 2, 3, 4, 5, 6, 7, 8) }).sum::<u64>()))
            .collect();
        let expected = 1 + 4 + 9 + 16 + 25 + 36 + 49 + 64;
        for t in threads {
            assert_eq!(t.join().unwrap(), 100 * expected);
        }
        assert_eq!(CALLS[slot].load(Ordering::Relaxed), before + 400);
        assert!(report().contains(&format!("passed through {} calls to cuMemMap (not served)", before + 400)));
        // Threads racing to wrap one new function all get the one trampoline (address never
        // called).
        let fresh = 0x800 as *mut c_void as usize;
        let got: Vec<usize> = (0..8)
            .map(|_| std::thread::spawn(move || wrap(b"cuMemRelease", fresh as *mut c_void) as usize))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(got.iter().all(|&g| g == got[0] && g != fresh), "{got:x?}");
        // Every slot taken (addresses never called): the function itself comes back, counted as
        // a lookup not counted.
        for i in 0..SLOTS {
            wrap(b"cuMemCreate", (0x1000 + 16 * i) as *mut c_void);
        }
        let late = (0x1000 + 16 * SLOTS) as *mut c_void;
        assert_eq!(wrap(b"cuMemCreate", late), late);
        assert!(report().iter().any(|l| l.ends_with("lookups of memory functions not counted (no slot left)")));
        assert!(report().iter().all(|l| l.len() <= 80), "{:?}", report());
    }
}
