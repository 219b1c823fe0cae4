//! Threads on several streams at once (two threads a stream, so shards see real contention),
//! with record_stream across streams, held streams and empty_cache calls; every block carries a
//! cookie checked before it is freed, and the invariant checker runs at the end.

mod common;

use std::sync::Arc;
use std::thread;

use common::{MIB, check, sim};

const THREADS: usize = 8;
const OPS: usize = 20_000;

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn threads_on_several_streams_keep_every_invariant() {
    let (a, drv) = sim(1, 2048 * MIB);
    let a = Arc::new(a);
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let a = a.clone();
            let drv = drv.clone();
            thread::spawn(move || {
                let stream = 0x100 * (t % 4 + 1);
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                let mut live: Vec<(u64, usize, u64)> = Vec::new();
                for i in 0..OPS {
                    let r = xorshift(&mut rng);
                    if live.len() < 32 && (!r.is_multiple_of(3) || live.is_empty()) {
                        let size = match r % 10 {
                            0 => (r >> 8) as usize % (24 * MIB),
                            1..=3 => (r >> 8) as usize % (2 * MIB),
                            _ => (r >> 8) as usize % 16384 + 1,
                        }
                        .max(8);
                        let p = a.malloc(size, 0, stream).expect("malloc");
                        let cookie = ((t as u64) << 48) | i as u64;
                        // SAFETY: a live block of at least 8 bytes of host memory.
                        unsafe { (p as *mut u64).write_unaligned(cookie) };
                        if r.is_multiple_of(17) {
                            a.record_stream(p, 0x100 * ((t + 1) % 4 + 1)).unwrap();
                        }
                        live.push((p, size, cookie));
                    } else {
                        let (p, _, cookie) = live.swap_remove((r >> 4) as usize % live.len());
                        // SAFETY: as above.
                        assert_eq!(
                            unsafe { (p as *const u64).read_unaligned() },
                            cookie,
                            "a live block was handed out twice"
                        );
                        a.free(p).unwrap();
                    }
                    if t == 0 && i.is_multiple_of(997) {
                        drv.hold_stream(0x200);
                    }
                    if t == 1 && i.is_multiple_of(1499) {
                        drv.release_stream(0x200);
                    }
                    if t == 2 && i.is_multiple_of(4001) {
                        a.empty_cache(0).unwrap();
                    }
                }
                for (p, _, _) in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    drv.release_stream(0x200);
    check(&a);
    a.empty_cache(-1).unwrap();
    check(&a);
    let s = a.stats(0).unwrap();
    assert_eq!((s.allocation.all.current, s.active.all.current, s.reserved_bytes.all.current), (0, 0, 0));
    assert_eq!(s.allocation.all.allocated, s.allocation.all.freed);
    assert!(s.allocation.all.peak >= 32, "peak {} below one thread's live set", s.allocation.all.peak);
    assert_eq!(drv.used(0), 0);
}
