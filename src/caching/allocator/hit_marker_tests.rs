//! The thread cache's [`MARKER`] (`hit_marker.rs`): a malloc that missed puts it first among its
//! allocator's entries, so that frees do not guess another stream's shard; the first free its
//! guess would have served takes it out; a free it would have got wrong leaves it; frees and
//! the invariants are the same either way. On the simulated device, each case on a thread of
//! its own (a fresh cache).

use std::sync::Arc;

use super::super::{SHARD_CACHE_SLOTS, ShardCache};
use super::MARKER;
use crate::caching::allocator::Allocator;
use crate::config::Config;
use crate::driver::sim::SimDriver;

/// (allocator, device, stream) of the calling thread's entries, first to last.
fn entries() -> Vec<(u64, i32, usize)> {
    // SAFETY: read on the cache's own thread while no call of the hit path is under way.
    let slots = unsafe { &*ShardCache::get().slots.get() };
    slots.iter().map(|c| (c.allocator, c.device, c.stream)).collect()
}

fn marked(id: u64) -> bool {
    entries().iter().find(|e| e.0 == id).is_some_and(|e| e.1 == MARKER)
}

/// The stream of the entry a free would guess: the allocator's first after its marker.
fn guessed(id: u64) -> usize {
    entries().iter().filter(|e| e.0 == id && e.1 != MARKER).map(|e| e.2).next().unwrap()
}

#[test]
fn a_miss_stops_the_guess_until_a_free_it_would_have_served() {
    std::thread::spawn(|| {
        let a = Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
        let p = a.malloc(4096, 0, 0x10).unwrap();
        assert!(marked(a.id), "a miss puts the marker first: {:?}", entries());
        assert!(entries().contains(&(a.id, 0, 0x10)));
        a.free(p).unwrap();
        assert!(!marked(a.id), "the guess would have named 0x10's shard: {:?}", entries());
        let q = a.malloc(4096, 0, 0x10).unwrap();
        assert!(!marked(a.id), "a hit stores nothing");
        let r = a.malloc(4096, 0, 0x20).unwrap();
        assert!(marked(a.id), "another stream's miss puts it back: {:?}", entries());
        let (right, wrong) = if guessed(a.id) == 0x10 { (q, r) } else { (r, q) };
        a.free(wrong).unwrap();
        assert!(marked(a.id), "a free the guess would have got wrong leaves it: {:?}", entries());
        a.free(right).unwrap();
        assert!(!marked(a.id), "{:?}", entries());
        assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
        a.check_invariants().unwrap();
    })
    .join()
    .unwrap();
}

#[test]
fn two_allocators_keep_one_marker_each_first_of_their_entries() {
    std::thread::spawn(|| {
        let a = Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
        let b = Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
        let mut live = Vec::new();
        for s in 1..=6usize {
            live.push((&a, a.malloc(512, 0, s << 4).unwrap()));
            live.push((&b, b.malloc(512, 0, s << 4).unwrap()));
            let e = entries();
            assert_eq!(e.len(), SHARD_CACHE_SLOTS);
            for id in [a.id, b.id] {
                // At most one, first of its allocator's entries (another allocator's store may
                // have made room of it: its frees then guess again, which is all a marker stops).
                let own: Vec<_> = e.iter().filter(|x| x.0 == id).collect();
                assert!(own.iter().skip(1).all(|x| x.1 != MARKER), "a marker behind an entry: {e:?}");
            }
            assert!(marked(b.id), "the last store's allocator is marked: {e:?}");
        }
        for (x, p) in live {
            x.free(p).unwrap();
        }
        for x in [&a, &b] {
            assert_eq!(x.stats(0).unwrap().allocation.all.current, 0);
            x.check_invariants().unwrap();
        }
    })
    .join()
    .unwrap();
}

#[test]
fn three_allocators_keep_their_marker_first_after_each_miss() {
    // With a third allocator a marker is pushed deeper than the first entry by the others'
    // misses; the allocator's next miss found it first of its own entries, kept it where it
    // was, and its store could land in front of it: its frees guessed the stream just missed,
    // and the marker stayed behind that entry, an entry lost.
    std::thread::spawn(|| {
        let xs: Vec<Allocator> =
            (0..3).map(|_| Allocator::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default())).collect();
        let mut live = Vec::new();
        for s in 1..=8usize {
            for x in &xs {
                live.push((x, x.malloc(512, 0, s << 4).unwrap()));
                let e = entries();
                assert!(marked(x.id), "a miss puts the marker first of its allocator's entries: {e:?}");
                for y in &xs {
                    let own: Vec<_> = e.iter().filter(|c| c.0 == y.id).collect();
                    assert!(own.iter().skip(1).all(|c| c.1 != MARKER), "a marker behind an entry: {e:?}");
                }
            }
        }
        for (x, p) in live {
            x.free(p).unwrap();
        }
        for x in &xs {
            assert_eq!(x.stats(0).unwrap().allocation.all.current, 0);
            x.check_invariants().unwrap();
        }
    })
    .join()
    .unwrap();
}

/// No allocator has a marker behind one of its entries (nor two markers).
fn markers_first(ids: &[u64]) -> Result<(), String> {
    let e = entries();
    for &id in ids {
        if e.iter().filter(|c| c.0 == id).skip(1).any(|c| c.1 == MARKER) {
            return Err(format!("a marker of {id} behind its entry: {e:?}"));
        }
    }
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Mallocs, frees and releases of three allocators on two devices and six streams, an
    /// allocator dropped and made again now and then, on one thread: after each call no
    /// marker is behind its allocator's entry, and a miss leaves its allocator's marker first
    /// of the whole cache; the blocks are freed once and every count comes back.
    #[test]
    fn random_calls_of_three_allocators_keep_each_marker_first(
        calls in proptest::collection::vec((0u8..8, 0usize..3, 0usize..6, 0i32..2, 0usize..64), 1..80),
    ) {
        let r = std::thread::spawn(move || -> Result<(), String> {
            let driver = Arc::new(SimDriver::new(2, 1 << 30));
            let make = || Allocator::new(driver.clone(), Config::default());
            let mut xs = [make(), make(), make()];
            let mut live: Vec<(usize, u64)> = Vec::new();
            for (what, x, s, device, pick) in calls {
                let stream = (s + 1) << 4;
                match what {
                    0..=4 => {
                        let cached = entries().contains(&(xs[x].id, device, stream));
                        live.push((x, xs[x].malloc(4096 << s, device, stream).map_err(|e| e.to_string())?));
                        if !cached && entries()[0] != (xs[x].id, MARKER, 0) {
                            return Err(format!("a miss left no marker first: {:?}", entries()));
                        }
                    }
                    5 | 6 if !live.is_empty() => {
                        let (x, p) = live.swap_remove(pick % live.len());
                        xs[x].free(p).map_err(|e| e.to_string())?;
                    }
                    7 => {
                        for (_, p) in live.iter().filter(|b| b.0 == x) {
                            xs[x].free(*p).map_err(|e| e.to_string())?;
                        }
                        live.retain(|b| b.0 != x);
                        if pick % 2 == 0 {
                            xs[x] = make();
                        } else {
                            xs[x].empty_cache(-1).map_err(|e| e.to_string())?;
                        }
                    }
                    _ => {}
                }
                markers_first(&xs.iter().map(|a| a.id).collect::<Vec<_>>())?;
            }
            for (x, p) in live {
                xs[x].free(p).map_err(|e| e.to_string())?;
            }
            for a in &xs {
                a.check_invariants().map_err(|e| e.to_string())?;
                for d in 0..2 {
                    if let Ok(s) = a.stats(d) && s.allocation.all.current != 0 {
                        return Err(format!("device {d}: {s:?}"));
                    }
                }
            }
            Ok(())
        })
        .join()
        .unwrap();
        proptest::prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}
