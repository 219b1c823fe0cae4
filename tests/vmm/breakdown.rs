//! `Allocator::breakdown` on the simulated device: every reserved byte is put to one cause
//! (live, rounding, free pages of a page size between live blocks or at a range's edge, bytes
//! sharing a page with a live block), and reading it changes nothing.
use crate::common;

use common::{MIB, sim_with};
use gpupool::config::Config;

#[test]
fn every_reserved_byte_has_a_cause() {
    let config = Config { expandable_segments: true, expandable_large_pages: true, ..Config::default() };
    let (a, _drv) = sim_with(1, 8 << 30, config);
    let s = 0x10;
    // Three blocks of 6 MiB in 2 MiB pages, the middle one freed: three whole free pages
    // between live blocks.
    let x = a.malloc(6 * MIB, 0, s).unwrap();
    let y = a.malloc(6 * MIB, 0, s).unwrap();
    let z = a.malloc(6 * MIB, 0, s).unwrap();
    a.free(y).unwrap();
    // 1,000 bytes of the small pool: rounded to 1,024, the rest of its 2 MiB page free at the
    // range's mapped edge.
    let small = a.malloc(1000, 0, s).unwrap();
    // 130 MiB in 20 MiB pages (in 2 MiB pages it would map 65, past the 64 a growth maps
    // where they round less): seven pages, 10 MiB of the last free at the edge.
    let big = a.malloc(130 * MIB, 0, s).unwrap();
    let b = a.breakdown(0).unwrap();
    assert_eq!(b.reserved, a.stats(0).unwrap().reserved_bytes.all.current as usize);
    assert_eq!(b.reserved, 18 * MIB + 2 * MIB + 140 * MIB);
    assert_eq!((b.requested, b.rounding, b.pending, b.ordinary_free), (12 * MIB + 1000 + 130 * MIB, 24, 0, 0));
    assert_eq!(b.accounted(), b.reserved);
    let row = |large: bool, page: usize| {
        let r = b.ranges.iter().find(|r| (r.stream, r.large, r.page) == (s, large, page)).expect("a row");
        (r.mapped, r.whole_between, r.whole_edge, r.partial_between, r.partial_edge)
    };
    assert_eq!(row(true, 2 * MIB), (18 * MIB, 6 * MIB, 0, 0, 0));
    assert_eq!(row(false, 2 * MIB), (2 * MIB, 0, 0, 0, 2 * MIB - 1024));
    assert_eq!(row(true, 20 * MIB), (140 * MIB, 0, 0, 0, 10 * MIB));
    // Reading it merged nothing: the freed block is still served from the front cache, at
    // its address, with no driver call.
    let again = a.breakdown(0).unwrap();
    assert_eq!(again, b);
    assert_eq!(a.malloc(6 * MIB, 0, s).unwrap(), y);
    for p in [x, y, z, small, big] {
        a.free(p).unwrap();
    }
    a.empty_cache(0).unwrap();
    let b = a.breakdown(0).unwrap();
    assert_eq!((b.reserved, b.accounted()), (0, 0));
}
