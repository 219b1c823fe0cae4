//! A small trace whose figures follow from PyTorch's rules by hand, replayed on the simulated
//! device.

use gpupool::config::Config;
use gpupool_replay::run::replay_sim;
use gpupool_replay::text::parse_text;

const MIB: usize = 1 << 20;

/// Three segments (PyTorch `get_allocation_size`): 12 MiB takes a segment of its own size
/// (10 MiB or more: rounded up to 2 MiB), 500,000 bytes a 2 MiB small-pool segment (1 MiB or
/// less), 3 MiB a 20 MiB large segment (`large_segment_size_mb`). When the 12 MiB block is
/// freed, 11.5 MiB takes it whole: the best fit, and the 0.5 MiB left is not more than 1 MiB,
/// so the block is not split (`should_split`).
const TRACE: &str = "\
# hand-made
a 10 12582912 0
a 11 500000 0
a 12 3145728 0
f 10
a 13 12058624 0
f 11
f 12
f 13
";

#[test]
fn peaks_follow_pytorchs_rules() {
    let t = parse_text("hand", TRACE).unwrap();
    // Live: 12 MiB + 500,000 + 3 MiB at once, more than 500,000 + 3 MiB + 11.5 MiB later.
    assert_eq!(t.peak_live(), 15 * MIB + 500_000);
    let o = replay_sim(&t, &Config::pytorch(), 1 << 30).unwrap();
    assert_eq!(o.peak_reserved, (12 + 2 + 20) * MIB);
    assert_eq!(o.peak_segments, 3);
    assert_eq!(o.device_allocs, 3);
    // Rounded to 512 bytes, 500,000 is 500,224; the 11.5 MiB request holds the 12 MiB block.
    assert_eq!(o.peak_allocated, 15 * MIB + 500_224);
    // The warm pass finds every segment cached.
    assert_eq!((o.device_allocs_warm, o.peak_reserved_warm), (0, 34 * MIB));
    assert_eq!((o.ooms, o.ooms_warm, o.alloc_retries), (0, 0, 0));
}

#[test]
fn out_of_memory_is_counted_and_the_replay_goes_on() {
    let t = parse_text("hand", TRACE).unwrap();
    // 32 MiB: the 3 MiB request's 20 MiB segment does not fit beside 12 + 2 MiB, and nothing
    // cached can be released; the 11.5 MiB request still gets the 12 MiB block afterwards.
    let o = replay_sim(&t, &Config::pytorch(), 32 * MIB).unwrap();
    assert_eq!((o.ooms, o.ooms_warm), (1, 1));
    assert_eq!(o.peak_reserved, 14 * MIB);
    assert_eq!(o.device_allocs, 2);
    assert_eq!(o.alloc_retries, 2);
}
