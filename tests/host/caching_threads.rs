//! Pinned host memory on the simulated device with threads: events polled by background
//! threads off the hit path, and threads on their own streams sharing nothing.

use gpupool::config::Config;

use crate::support::{COPY, host, host_with};

#[test]
fn with_background_threads_events_are_polled_off_the_hit_path() {
    let config = Config { pinned_use_background_threads: true, ..Config::default() };
    let (h, sim) = host_with(config);
    let warm = h.malloc(4096).unwrap(); // the first miss starts the thread
    sim.hold_stream(COPY);
    let p = h.malloc(8192).unwrap();
    h.record_event(p, COPY).unwrap();
    h.free(p).unwrap();
    h.free(warm).unwrap();
    let queries = sim.counts().event_query;
    for _ in 0..100 {
        h.free(h.malloc(4096).unwrap()).unwrap();
    }
    sim.release_stream(COPY);
    // The background thread returns p to its free list without any allocation polling.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while h.stats().active_requests.current != 0 {
        assert!(std::time::Instant::now() < deadline, "the background thread never polled the event");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(sim.counts().event_query > queries);
    assert_eq!(h.malloc(8192).unwrap(), p);
    h.free(p).unwrap();
    h.check_invariants();
}
#[test]
fn threads_on_their_own_streams_share_nothing_and_stay_consistent() {
    let (h, sim) = host();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (h, sim) = (h.clone(), sim.clone());
            std::thread::spawn(move || {
                let stream = 0x1000 * (t + 1);
                let mut live: Vec<(usize, usize)> = Vec::new();
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                for i in 0..4000 {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    if live.len() < 8 || rng % 2 == 0 {
                        let size = (64 << (rng % 12)) as usize;
                        let p = h.malloc(size).unwrap();
                        // Each live block carries its owner's cookie: a block handed out twice
                        // would have it overwritten.
                        let cookie = (t << 32 | i) as u64;
                        unsafe { (p as *mut u64).write(cookie) };
                        live.push((p, cookie as usize));
                        if i % 3 == 0 {
                            h.record_event(p, stream).unwrap();
                        }
                        if i % 500 == 0 {
                            sim.hold_stream(stream);
                        } else if i % 500 == 250 {
                            sim.release_stream(stream);
                        }
                    } else {
                        let (p, cookie) = live.swap_remove((rng as usize / 2) % live.len());
                        assert_eq!(unsafe { (p as *const u64).read() }, cookie as u64, "block reused while live");
                        h.free(p).unwrap();
                    }
                }
                sim.release_stream(stream);
                live
            })
        })
        .collect();
    // Another thread empties the cache and reads the statistics meanwhile.
    for _ in 0..20 {
        h.empty_cache().unwrap();
        let st = h.stats();
        assert!(st.active_requests.current <= st.allocations.current);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let leftovers: Vec<_> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    h.check_invariants();
    // Freed from this thread: blocks go back to the stripes that handed them out.
    for (p, _) in leftovers {
        h.free(p).unwrap();
    }
    h.empty_cache().unwrap();
    h.check_invariants();
    let st = h.stats();
    assert_eq!((st.active_requests.current, st.active_bytes.current), (0, 0));
    assert_eq!(st.allocations.current, 0);
    assert_eq!(sim.live_host(), (0, 0));
    assert_eq!(st.num_host_alloc, st.num_host_free);
}
