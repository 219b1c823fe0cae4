//! The C API fuzz's model of the live blocks and the run of one call against it: the status
//! each call must return for its arguments, what it may write, the cookies that show an
//! overlap, and the drain that empties the allocator after a case.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_int, c_void};

use gpupool::ffi::gpupool_stream_t;
use gpupool::ffi::memory::{
    gpupool_device_count, gpupool_empty_cache, gpupool_free, gpupool_largest_allocatable, gpupool_malloc,
    gpupool_record_stream, gpupool_set_memory_fraction, gpupool_stream_retire,
};
use gpupool::ffi::sim::{gpupool_sim_hold_stream, gpupool_sim_release_stream, gpupool_sim_set_device};
use gpupool::ffi::stats::{
    gpupool_memory_summary, gpupool_peak_settles, gpupool_reset_peak_stats, gpupool_stats, gpupool_stats_t,
};
use gpupool::ffi::status::{gpupool_status, gpupool_status_string, gpupool_version};

use crate::common::last_error;

use gpupool_status::*;

use crate::fuzz_calls::{Addr, Call, DEVICES, MIB};

/// A live block as the model sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Block {
    size: usize,
    device: c_int,
    cookie: u64,
}

pub(crate) struct Model {
    /// Live blocks by address.
    pub(crate) live: BTreeMap<u64, Block>,
    /// Addresses freed, in order (a few hundred at most per case).
    pub(crate) freed: Vec<u64>,
    /// The calling thread's current device (`gpupool_sim_set_device`).
    pub(crate) current: c_int,
    pub(crate) held: Vec<usize>,
    pub(crate) cookie: u64,
}

pub(crate) fn valid_device(d: c_int) -> bool {
    (-1..DEVICES).contains(&d)
}

impl Model {
    fn device(&self, d: c_int) -> c_int {
        if d == -1 { self.current } else { d }
    }

    fn pick_live(&self, i: usize) -> Option<(u64, Block)> {
        if self.live.is_empty() {
            return None;
        }
        self.live.iter().nth(i % self.live.len()).map(|(&p, &b)| (p, b))
    }

    fn resolve(&self, a: &Addr, stack: &u64) -> u64 {
        match *a {
            Addr::Null => 0,
            Addr::Live(i) => self.pick_live(i).map_or(0, |(p, _)| p),
            // 1 to size - 1 bytes in (a block of 1 byte is 512 bytes long: 1 byte in).
            Addr::Interior(i, o) => {
                self.pick_live(i).map_or(0x2000, |(p, b)| p + 1 + (o as u64 % (b.size.max(2) - 1) as u64))
            }
            Addr::Freed(i) => {
                if self.freed.is_empty() {
                    0x3000
                } else {
                    self.freed[i % self.freed.len()]
                }
            }
            Addr::PastEnd(i) => self.pick_live(i).map_or(0x4000, |(p, b)| p + b.size as u64),
            Addr::Stack => stack as *const u64 as u64,
            Addr::Garbage(g) => g,
        }
    }
}

/// Writes the block's cookie into its first bytes, and into its last 8 when it has 16 or more
/// (so that the two never overlap).
pub(crate) fn stamp(p: u64, b: &Block) {
    let bytes = b.cookie.to_le_bytes();
    let n = b.size.min(8);
    // SAFETY: a live block of at least `b.size` bytes of host memory (the simulated device).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p as *mut u8, n);
        if b.size >= 16 {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), (p as *mut u8).add(b.size - 8), 8);
        }
    }
}

pub(crate) fn stamped(p: u64, b: &Block) -> bool {
    let bytes = b.cookie.to_le_bytes();
    let n = b.size.min(8);
    let (mut head, mut tail) = ([0u8; 8], bytes);
    // SAFETY: as in `stamp`.
    unsafe {
        std::ptr::copy_nonoverlapping(p as *const u8, head.as_mut_ptr(), n);
        if b.size >= 16 {
            std::ptr::copy_nonoverlapping((p as *const u8).add(b.size - 8), tail.as_mut_ptr(), 8);
        }
    }
    head[..n] == bytes[..n] && tail == bytes
}

/// The checks after every call: the status is no panic and is the one expected (or, where
/// the device may run out of memory, that), and the invariants hold.
pub(crate) fn after(call: &Call, got: gpupool_status, want: &[gpupool_status]) {
    assert_ne!(got, GPUPOOL_ERROR_INTERNAL, "{call:?}: a panic reached the boundary: {}", last_error());
    assert!(want.contains(&got), "{call:?}: status {got:?}, expected one of {want:?} ({})", last_error());
    if got != GPUPOOL_SUCCESS {
        assert!(!last_error().is_empty(), "{call:?}: failed with no message");
    }
    let a = gpupool::ffi::process_allocator().expect("the process allocator on the simulated device");
    if let Err(e) = a.check_invariants() {
        panic!("{call:?}: invariant broken: {e}");
    }
}

pub(crate) fn stream_t(s: usize) -> gpupool_stream_t {
    s as gpupool_stream_t
}

/// Whether PyTorch's rounding of `size` overflows: up to 512 bytes, then (for a large request)
/// its segment up to 2 MiB.
pub(crate) fn rounding_overflows(size: usize) -> bool {
    let round = |s: usize, m: usize| s.checked_add(m - 1).map(|s| s / m * m);
    round(size, 512).and_then(|r| round(r, 2 << 20)).is_none()
}

pub(crate) fn run_call(m: &mut Model, call: &Call) {
    let stack = 0u64;
    match *call {
        Call::Malloc { out_null, size, device, stream } => {
            const SENTINEL: *mut c_void = 0x5eed as *mut c_void;
            let mut out = SENTINEL;
            let ptr = if out_null { std::ptr::null_mut() } else { &raw mut out };
            // SAFETY: `ptr` is NULL or a writable `void *`.
            let st = unsafe { gpupool_malloc(ptr, size, device, stream_t(stream)) };
            let overflows = rounding_overflows(size);
            let want: &[_] = if out_null || !valid_device(device) || overflows {
                &[GPUPOOL_ERROR_INVALID_VALUE]
            } else if size == 0 {
                &[GPUPOOL_SUCCESS]
            } else {
                &[GPUPOOL_SUCCESS, GPUPOOL_ERROR_OUT_OF_MEMORY]
            };
            after(call, st, want);
            if st != GPUPOOL_SUCCESS {
                assert_eq!(out, SENTINEL, "{call:?}: the out-pointer was written on failure");
                return;
            }
            if size == 0 {
                assert!(out.is_null(), "{call:?}: size 0 gives NULL");
                return;
            }
            let p = out as u64;
            assert!(!out.is_null() && p % 512 == 0, "{call:?}: pointer {out:?}");
            if let Some((&q, b)) = m.live.range(..p + size as u64).next_back() {
                assert!(q + b.size as u64 <= p, "{call:?}: block {p:#x} overlaps live block {q:#x} ({} bytes)", b.size);
            }
            m.cookie += 1;
            let b = Block { size, device: m.device(device), cookie: m.cookie };
            stamp(p, &b);
            m.live.insert(p, b);
        }
        Call::Free(ref a) => {
            let p = m.resolve(a, &stack);
            let live = m.live.get(&p).copied();
            if let Some(b) = live {
                assert!(stamped(p, &b), "block {p:#x} was overwritten while live");
            }
            // SAFETY: gpupool_free never dereferences its argument.
            let st = unsafe { gpupool_free(p as *mut c_void) };
            let want = if p == 0 || live.is_some() { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_POINTER };
            after(call, st, &[want]);
            if live.is_some() {
                m.live.remove(&p);
                m.freed.push(p);
            }
        }
        Call::RecordStream(ref a, s) => {
            let p = m.resolve(a, &stack);
            // SAFETY: gpupool_record_stream never dereferences its pointer.
            let st = unsafe { gpupool_record_stream(p as *mut c_void, stream_t(s)) };
            let want = if p == 0 || m.live.contains_key(&p) { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_POINTER };
            after(call, st, &[want]);
        }
        Call::RetireStream { device, stream, null } => {
            let mut waited: c_int = -7;
            let ptr = if null { std::ptr::null_mut() } else { &raw mut waited };
            // SAFETY: NULL or a writable int.
            let st = unsafe { gpupool_stream_retire(device, stream_t(stream), ptr) };
            let ok = valid_device(device) && stream > 2;
            after(call, st, &[if ok { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
            assert!(if ok && !null { waited == 0 || waited == 1 } else { waited == -7 }, "{call:?}: waited {waited}");
        }
        Call::EmptyCache(d) => {
            let st = gpupool_empty_cache(d);
            after(call, st, &[if valid_device(d) { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
        }
        Call::SetMemoryFraction(f, d) => {
            let st = gpupool_set_memory_fraction(f, d);
            let ok = valid_device(d) && (0.0..=1.0).contains(&f);
            after(call, st, &[if ok { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
        }
        Call::DeviceCount { null } => {
            let mut n: c_int = -7;
            let ptr = if null { std::ptr::null_mut() } else { &raw mut n };
            // SAFETY: NULL or a writable int.
            let st = unsafe { gpupool_device_count(ptr) };
            after(call, st, &[if null { GPUPOOL_ERROR_INVALID_VALUE } else { GPUPOOL_SUCCESS }]);
            assert_eq!(n, if null { -7 } else { DEVICES });
        }
        Call::Stats { device, null, size } => {
            // Room for any `size` the caller may claim up to 400 bytes, and a canary after it.
            const ROOM: usize = 512;
            let mut buf = [0xa5u8; ROOM];
            let claimed = size.min(400);
            if !null {
                buf[..4].copy_from_slice(&claimed.to_ne_bytes());
            }
            let out = if null { std::ptr::null_mut() } else { buf.as_mut_ptr().cast::<gpupool_stats_t>() };
            // SAFETY: NULL, or a buffer of at least `claimed` bytes.
            let st = unsafe { gpupool_stats(device, out) };
            let ok = !null && claimed >= 8 && valid_device(device);
            after(call, st, &[if ok { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
            let full = size_of::<gpupool_stats_t>();
            let written = if st == GPUPOOL_SUCCESS { (claimed as usize).min(full) } else { 0 };
            if !null {
                assert!(buf[written.max(4)..].iter().all(|&b| b == 0xa5), "{call:?}: bytes written past {written}");
            }
            if st == GPUPOOL_SUCCESS {
                assert_eq!(u32::from_ne_bytes(buf[..4].try_into().unwrap()) as usize, written);
            }
            if st == GPUPOOL_SUCCESS && written == full {
                // SAFETY: a whole gpupool_stats_t was written (the buffer may be unaligned).
                let s: gpupool_stats_t = unsafe { buf.as_ptr().cast::<gpupool_stats_t>().read_unaligned() };
                let dev = m.device(device);
                let live = m.live.values().filter(|b| b.device == dev).count() as i64;
                assert_eq!(s.allocation.all.current, live, "{call:?}: allocations counted vs live blocks");
                for st in [s.allocation, s.segment, s.active, s.allocated_bytes, s.reserved_bytes, s.requested_bytes] {
                    for x in [st.all, st.small_pool, st.large_pool] {
                        assert!(x.current <= x.peak && x.allocated - x.freed == x.current, "{call:?}: {x:?}");
                    }
                    assert_eq!(st.all.current, st.small_pool.current + st.large_pool.current);
                    assert!(st.all.peak <= st.small_pool.peak + st.large_pool.peak, "{call:?}: {st:?}");
                }
            }
        }
        Call::LargestAllocatable { device, stream, null } => {
            let mut bytes = usize::MAX;
            let ptr = if null { std::ptr::null_mut() } else { &raw mut bytes };
            let read = |d: c_int| {
                let mut s = gpupool_stats_t { size: size_of::<gpupool_stats_t>() as u32, ..Default::default() };
                // SAFETY: a whole gpupool_stats_t.
                (valid_device(d) && unsafe { gpupool_stats(d, &raw mut s) } == GPUPOOL_SUCCESS).then_some(s)
            };
            let before = read(device);
            // SAFETY: NULL or a writable size_t.
            let st = unsafe { gpupool_largest_allocatable(device, stream_t(stream), ptr) };
            let ok = !null && valid_device(device);
            after(call, st, &[if ok { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
            assert_eq!(read(device), before, "{call:?}: asking changed the statistics");
            if st == GPUPOOL_SUCCESS {
                assert!(bytes <= 64 * MIB && bytes % 512 == 0, "{call:?}: {bytes}");
            } else {
                assert_eq!(bytes, usize::MAX, "{call:?}: the out-pointer was written on failure");
            }
        }
        Call::MappedRange { ref addr, null, fd } => mapped_range(m, call, addr, null, fd, &stack),
        Call::PeakSettles { device, null } => {
            let mut n = -7i64;
            let ptr = if null { std::ptr::null_mut() } else { &raw mut n };
            // SAFETY: NULL or a writable int64_t.
            let st = unsafe { gpupool_peak_settles(device, ptr) };
            let ok = !null && valid_device(device);
            after(call, st, &[if ok { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
            assert!(if ok { n >= 0 } else { n == -7 }, "{call:?}: {n}");
        }
        Call::ResetPeakStats(d) => {
            let st = gpupool_reset_peak_stats(d);
            after(call, st, &[if valid_device(d) { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
        }
        Call::MemorySummary { device, buf, per_mille, needed } => {
            // The size needed, asked first when the call under test may use it.
            let mut need = 0usize;
            if valid_device(device) {
                // SAFETY: buf NULL, needed writable.
                let st = unsafe { gpupool_memory_summary(device, std::ptr::null_mut(), 0, &mut need) };
                assert_eq!(st, GPUPOOL_SUCCESS, "{}", last_error());
                assert!(need > 1);
            }
            let len = need * per_mille / 1000;
            let mut text = vec![0x7fu8; len + 64];
            let mut got_need = 0usize;
            let buf_ptr = if buf { text.as_mut_ptr().cast::<c_char>() } else { std::ptr::null_mut() };
            let need_ptr = if needed { &raw mut got_need } else { std::ptr::null_mut() };
            // SAFETY: the buffer holds at least `len` bytes; `needed` NULL or writable.
            let st = unsafe { gpupool_memory_summary(device, buf_ptr, len, need_ptr) };
            let want = if (!buf && !needed) || !valid_device(device) || (buf && len < need) {
                GPUPOOL_ERROR_INVALID_VALUE
            } else {
                GPUPOOL_SUCCESS
            };
            after(call, st, &[want]);
            if st == GPUPOOL_SUCCESS && buf {
                assert_eq!(text[need - 1], 0, "{call:?}: the summary is NUL-terminated at its length");
                assert!(text[..need - 1].iter().all(|&b| b != 0));
                assert!(text[need..].iter().all(|&b| b == 0x7f), "{call:?}: written past the summary");
            } else {
                assert!(text.iter().all(|&b| b == 0x7f), "{call:?}: the buffer was written on failure");
            }
            if needed {
                // Written on success, and when the only fault is a buffer too small (the
                // two-call idiom); on any other failure, untouched.
                let small = valid_device(device) && buf && len < need;
                assert_eq!(got_need, if st == GPUPOOL_SUCCESS || small { need } else { 0 }, "{call:?}");
            }
        }
        Call::StatusString(v) => {
            // SAFETY: a static NUL-terminated string for any value.
            let s = unsafe { CStr::from_ptr(gpupool_status_string(v)) }.to_str().unwrap();
            assert!(!s.is_empty());
            assert_eq!(v > 6, s == "unknown gpupool_status", "{v}: {s}");
        }
        Call::Version => {
            // SAFETY: a static NUL-terminated string.
            let v = unsafe { CStr::from_ptr(gpupool_version()) }.to_str().unwrap();
            assert_eq!(v, env!("CARGO_PKG_VERSION"));
        }
        Call::LastError => {
            let _ = last_error();
        }
        Call::Hold(s) => {
            after(call, gpupool_sim_hold_stream(stream_t(s)), &[GPUPOOL_SUCCESS]);
            m.held.push(s);
        }
        Call::Release(s) => {
            after(call, gpupool_sim_release_stream(stream_t(s)), &[GPUPOOL_SUCCESS]);
            m.held.retain(|&h| h != s);
        }
        Call::SetDevice(d) => {
            let ok = (0..DEVICES).contains(&d);
            after(call, gpupool_sim_set_device(d), &[if ok { GPUPOOL_SUCCESS } else { GPUPOOL_ERROR_INVALID_VALUE }]);
            if ok {
                m.current = d;
            }
        }
    }
}

/// Gives everything back after a case, so the next starts from an empty allocator: the
/// streams released, every block freed, the fraction lifted, the cache emptied.
pub(crate) fn drain(m: &mut Model) {
    for s in std::mem::take(&mut m.held) {
        assert_eq!(gpupool_sim_release_stream(stream_t(s)), GPUPOOL_SUCCESS);
    }
    while let Some((p, b)) = m.live.pop_first() {
        assert!(stamped(p, &b), "block {p:#x} was overwritten while live");
        // SAFETY: a live block.
        assert_eq!(unsafe { gpupool_free(p as *mut c_void) }, GPUPOOL_SUCCESS, "{}", last_error());
    }
    for d in 0..DEVICES {
        assert_eq!(gpupool_set_memory_fraction(1.0, d), GPUPOOL_SUCCESS);
    }
    assert_eq!(gpupool_sim_set_device(0), GPUPOOL_SUCCESS);
    assert_eq!(gpupool_empty_cache(-1), GPUPOOL_SUCCESS, "{}", last_error());
    let a = gpupool::ffi::process_allocator().unwrap();
    a.check_invariants().unwrap();
    for d in 0..DEVICES {
        let s = a.stats(d).unwrap();
        assert_eq!(
            (s.allocation.all.current, s.active.all.current, s.reserved_bytes.all.current),
            (0, 0, 0),
            "device {d} after everything was freed and the cache emptied"
        );
    }
    m.freed.clear();
}

/// `gpupool_segment_mapped_range` on the address `a` names: a pointer inside a live block's
/// requested bytes gets its range (holding it, whole host pages, of the block's device) and a
/// descriptor of its size; NULL and the stack are refused, other addresses may be either (past
/// a block's requested bytes, gpupool's rounding decides); nothing is written on failure.
fn mapped_range(m: &Model, call: &Call, a: &Addr, null: bool, fd: bool, stack: &u64) {
    use gpupool::ffi::registration::{gpupool_mapped_range_t, gpupool_segment_mapped_range};
    let p = m.resolve(a, stack);
    let mut r = gpupool_mapped_range_t {
        address: std::ptr::null_mut(),
        bytes: 7,
        segment_address: std::ptr::null_mut(),
        segment_bytes: 7,
        device: -7,
        expandable: -7,
        stream: std::ptr::null_mut(),
        pool: 7,
    };
    let mut out_fd: c_int = -7;
    let range = if null { std::ptr::null_mut() } else { &raw mut r };
    let fd_ptr = if fd { &raw mut out_fd } else { std::ptr::null_mut() };
    // SAFETY: NULL or writable outputs; the pointer is only compared with gpupool's.
    let st = unsafe { gpupool_segment_mapped_range(p as *const c_void, range, fd_ptr) };
    let inside = m.live.iter().find(|&(&q, b)| q <= p && p < q + b.size as u64).map(|(_, b)| b.device);
    let want: &[gpupool_status] = if null {
        &[GPUPOOL_ERROR_INVALID_VALUE]
    } else if inside.is_some() {
        &[GPUPOOL_SUCCESS]
    } else if p == 0 || matches!(a, Addr::Stack) {
        &[GPUPOOL_ERROR_INVALID_POINTER]
    } else {
        &[GPUPOOL_SUCCESS, GPUPOOL_ERROR_INVALID_POINTER]
    };
    after(call, st, want);
    if st != GPUPOOL_SUCCESS {
        assert_eq!((r.bytes, r.device, out_fd), (7, -7, -7), "{call:?}: written on failure");
        return;
    }
    let (base, bytes) = (r.address as u64, r.bytes);
    assert!(base <= p && p < base + bytes as u64 && base % 4096 == 0 && bytes % 4096 == 0, "{call:?}: {r:?}");
    if let Some(d) = inside {
        assert_eq!(r.device, d, "{call:?}");
    }
    if fd {
        assert!(out_fd >= 0, "{call:?}");
        // SAFETY: the descriptor gpupool handed over; ours to close.
        let end = unsafe { libc::lseek(out_fd, 0, libc::SEEK_END) };
        // SAFETY: as above, closed once.
        unsafe { libc::close(out_fd) };
        assert_eq!(end as usize, bytes, "{call:?}: the descriptor's size is the range's");
    } else {
        assert_eq!(out_fd, -7, "{call:?}");
    }
}
