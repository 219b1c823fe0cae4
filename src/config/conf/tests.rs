//! Unit tests of the configuration string: every key, the syntax, what PyTorch lets through
//! and gpupool refuses, and the string written back.
//!
//! The expected figures are those PyTorch 2.11.0 itself gives: each string was passed to
//! `c10::CachingAllocator::setAllocatorSettings` of the 2.11.0 wheel's `libc10.so` and
//! `libc10_cuda.so` (in a fresh process), and the settings read back.

use super::roundup::show_roundup;
use super::*;

fn conf(s: &str) -> Result<Config, Error> {
    Config::default().with_conf(s)
}

fn ok(s: &str) -> Config {
    conf(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

/// `s` is refused with a message naming each of `words`.
fn refused(s: &str, words: &[&str]) {
    let e = conf(s).expect_err(s);
    assert!(matches!(e, Error::InvalidValue(_)), "{s:?}: {e:?}");
    for w in words {
        assert!(e.message().contains(w), "{s:?}: the message should name {w:?}: {e}");
    }
    assert!(e.message().starts_with("GPUPOOL_CONF: "), "{e}");
}

fn divisions(s: &str) -> [usize; ROUNDUP_INTERVALS] {
    ok(&format!("roundup_power2_divisions:{s}")).roundup_power2_divisions
}

#[test]
fn an_empty_string_sets_every_default() {
    for s in ["", "   "] {
        assert_eq!(ok(s), Config::default());
    }
    let d = Config::default();
    assert_eq!((d.max_split_size, d.max_non_split_rounding, d.large_segment_size), (usize::MAX, 20 * MIB, 20 * MIB));
    assert_eq!(d.roundup_power2_divisions, [0; ROUNDUP_INTERVALS]);
    assert_eq!((d.garbage_collection_threshold, d.per_process_memory_fraction), (0.0, 1.0));
    assert_eq!((d.pinned_num_register_threads, d.pinned_reserve_segment_size), (1, 0));
}

#[test]
fn every_key_sets_its_field() {
    type Check = fn(&Config) -> bool;
    let cases: [(&str, Check); 14] = [
        ("backend:native", |c| *c == Config::default()),
        ("large_segment_size_mb:64", |c| c.large_segment_size == 64 * MIB && c.max_non_split_rounding == 64 * MIB),
        ("max_split_size_mb:64", |c| c.max_split_size == 64 * MIB),
        ("max_non_split_rounding_mb:30", |c| c.max_non_split_rounding == 30 * MIB),
        ("roundup_power2_divisions:4", |c| c.roundup_power2_divisions == [4; ROUNDUP_INTERVALS]),
        ("garbage_collection_threshold:0.5", |c| c.garbage_collection_threshold == 0.5),
        ("expandable_segments:True", |c| c.expandable_segments),
        ("release_lock_on_cudamalloc:True", |c| c.release_lock_on_cudamalloc),
        ("per_process_memory_fraction:0.5", |c| c.per_process_memory_fraction == 0.5),
        ("graph_capture_record_stream_reuse:True", |c| c.graph_capture_record_stream_reuse),
        ("pinned_use_cuda_host_register:True", |c| c.pinned_use_cuda_host_register),
        ("pinned_num_register_threads:8", |c| c.pinned_num_register_threads == 8),
        ("pinned_use_background_threads:True", |c| c.pinned_use_background_threads),
        ("pinned_reserve_segment_size_mb:64", |c| c.pinned_reserve_segment_size == 64 * MIB),
    ];
    for (s, check) in cases {
        assert!(check(&ok(s)), "{s}");
    }
    let named: Vec<&str> = cases.iter().map(|(s, _)| s.split(':').next().unwrap()).collect();
    let keys: Vec<&str> = CONF_KEYS.iter().map(|k| k.key).collect();
    assert_eq!(named, keys, "one case per key, in the table's order");
    // PyTorch's ROCm spellings of two keys, which its CUDA build accepts too.
    assert!(ok("release_lock_on_hipmalloc:True").release_lock_on_cudamalloc);
    assert!(ok("pinned_use_hip_host_register:True").pinned_use_cuda_host_register);
    // False is read too, not only the absence of True.
    assert!(!ok("expandable_segments:True,expandable_segments:False").expandable_segments);
}

#[test]
fn several_keys_with_spaces_anywhere() {
    let c = ok(" max_split_size_mb : 64 , expandable_segments : True ");
    assert_eq!((c.max_split_size, c.expandable_segments), (64 * MIB, true));
    let c = ok("max_split _size_mb:6 4,  garbage_collection_threshold:0.25");
    assert_eq!((c.max_split_size, c.garbage_collection_threshold), (64 * MIB, 0.25));
    // A comma after the last entry is allowed (PyTorch's loop ends there).
    assert_eq!(ok("max_split_size_mb:64,").max_split_size, 64 * MIB);
    assert_eq!(ok("max_split_size_mb:064").max_split_size, 64 * MIB);
}

#[test]
fn a_key_given_twice_takes_the_last_value() {
    assert_eq!(ok("max_split_size_mb:64,max_split_size_mb:128").max_split_size, 128 * MIB);
    assert_eq!(ok("large_segment_size_mb:30,large_segment_size_mb:40").max_non_split_rounding, 40 * MIB);
    // roundup_power2_divisions writes into one table: a later list changes only what it names.
    assert_eq!(divisions("4,roundup_power2_divisions:[256:2]"), [2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4]);
}

#[test]
fn large_segment_size_is_read_first_and_floors_both_limits() {
    // Order does not matter: PyTorch reads large_segment_size_mb in a pass of its own.
    for s in ["large_segment_size_mb:64,max_split_size_mb:30", "max_split_size_mb:30,large_segment_size_mb:64"] {
        refused(s, &["max_split_size_mb:30", "at least large_segment_size_mb (64)"]);
    }
    refused(
        "large_segment_size_mb:30,max_non_split_rounding_mb:25",
        &["max_non_split_rounding_mb:25", "at least large_segment_size_mb (30)"],
    );
    let c = ok("large_segment_size_mb:11,max_split_size_mb:11,max_non_split_rounding_mb:11");
    assert_eq!((c.large_segment_size, c.max_split_size, c.max_non_split_rounding), (11 * MIB, 11 * MIB, 11 * MIB));
    // An explicit max_non_split_rounding_mb wins over the default large_segment_size_mb gives it.
    let c = ok("max_non_split_rounding_mb:64,large_segment_size_mb:30");
    assert_eq!((c.large_segment_size, c.max_non_split_rounding), (30 * MIB, 64 * MIB));
    refused("large_segment_size_mb:10", &["large_segment_size_mb:10", "more than 10"]);
    assert_eq!(ok("max_split_size_mb:20").max_split_size, 20 * MIB);
    refused("max_split_size_mb:19", &["max_split_size_mb:19", "at least large_segment_size_mb (20)"]);
    refused("max_split_size_mb:0", &["max_split_size_mb:0"]);
    assert_eq!(ok("max_non_split_rounding_mb:20").max_non_split_rounding, 20 * MIB);
    refused("max_non_split_rounding_mb:19", &["max_non_split_rounding_mb:19"]);
}

/// Every size key, one rule: a whole number of MiB up to the largest that fits in bytes,
/// 17592186044415 (`MAX_MB`); past it an error naming the largest. PyTorch clamps the three
/// device keys there (and overflows `pinned_reserve_segment_size_mb`'s bytes); gpupool refuses
/// all four, as it refuses the environment's sizes past the largest.
#[test]
fn every_size_past_the_largest_is_refused() {
    assert_eq!(ok(&format!("max_split_size_mb:{MAX_MB}")).max_split_size, usize::MAX);
    assert_eq!(ok(&format!("max_split_size_mb:{}", MAX_MB - 1)).max_split_size, (MAX_MB - 1) * MIB);
    let c = ok(&format!("large_segment_size_mb:{MAX_MB}"));
    assert_eq!((c.large_segment_size, c.max_non_split_rounding), (MAX_MB * MIB, MAX_MB * MIB));
    assert_eq!(ok(&format!("max_non_split_rounding_mb:{MAX_MB}")).max_non_split_rounding, MAX_MB * MIB);
    assert_eq!(ok(&format!("pinned_reserve_segment_size_mb:{MAX_MB}")).pinned_reserve_segment_size, MAX_MB * MIB);
    let keys =
        ["large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "pinned_reserve_segment_size_mb"];
    for key in keys {
        // Past the largest, past u64 (where PyTorch's stoull fails too), past any count.
        for n in [(MAX_MB + 1).to_string(), "99999999999999999".into(), "99999999999999999999999".into()] {
            refused(&format!("{key}:{n}"), &[&format!("{key}:{n}"), &format!("at most {MAX_MB}")]);
        }
    }
}

/// Only the ASCII space is dropped, wherever it stands (as PyTorch drops it); every other white
/// space and control character is an error naming it and its byte offset. PyTorch drops tab,
/// newline, carriage return, vertical tab and form feed too, and keeps a no-break space in
/// the word (where `std::stoull` then ignores it: `max_split_size_mb:64\u{a0}` reads 64).
#[test]
fn only_the_ascii_space_is_ignored() {
    assert_eq!(ok(" max_split_size_mb : 64 ").max_split_size, 64 * MIB);
    for (s, named, at) in [
        ("max_split_size_mb:64\u{a0}", "U+00A0 (no-break space)", 20),
        ("max_split_size_mb:\t64", "U+0009 (tab)", 18),
        ("max_split_size_mb:64,\nexpandable_segments:True", "U+000A (line feed)", 21),
        ("expandable_segments:True\r\n", "U+000D (carriage return)", 24),
        ("\u{b}expandable_segments:True", "U+000B", 0),
        ("expandable_segments:True,\u{2028}", "U+2028 (line separator)", 25),
        ("max_split_size_mb:6\u{200b}4", "U+200B (zero width space)", 19),
        ("\u{feff}max_split_size_mb:64", "U+FEFF", 0),
        ("max_split_size_mb:64\u{3000}", "U+3000", 20),
        ("\t\n", "U+0009 (tab)", 0),
    ] {
        refused(s, &[named, &format!("at byte {at}"), "only the ASCII space"]);
    }
}

#[test]
fn roundup_power2_divisions_in_both_forms() {
    assert_eq!(divisions("4"), [4; ROUNDUP_INTERVALS]);
    assert_eq!(divisions("1"), [1; ROUNDUP_INTERVALS]);
    assert_eq!(divisions("[256:1,512:2,1024:4,>:8]"), [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]);
    assert_eq!(divisions(" [ 256 : 1 , 512 : 2 , 1024 : 4 , > : 8 ] "), divisions("[256:1,512:2,1024:4,>:8]"));
    assert_eq!(divisions("[1:2,>:4]"), [2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]);
    // PyTorch's own example (AllocatorConfig.h): 128 is never named, so its interval stays 0.
    assert_eq!(divisions("[64:8,256:4,1024:4,>:1]"), [8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1]);
    // `>` first fills after the first interval; a boundary past 32 GiB is the last interval.
    assert_eq!(divisions("[>:4]"), [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]);
    assert_eq!(divisions("[2:4]"), [4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(divisions("[256:0,>:2]"), [0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2]);
    assert_eq!(divisions("[65536:4]"), [4; ROUNDUP_INTERVALS]);
    assert_eq!(divisions("[131072:4,>:2]"), [4; ROUNDUP_INTERVALS]);
    // Items in any order; each writes its own interval, `>` after the last one named.
    assert_eq!(divisions("[1024:4,256:2]"), [4, 4, 4, 4, 4, 4, 4, 4, 2, 4, 4, 0, 0, 0, 0, 0]);
    assert_eq!(divisions("[512:2,>:8,2048:1]"), [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 8, 1, 8, 8, 8, 8]);
    assert_eq!(divisions("[]"), [0; ROUNDUP_INTERVALS]);
    assert_eq!(divisions("[256:1,]"), [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]);
    for (bad, named) in [
        ("3", "roundup_power2_divisions:3"),
        ("0", "roundup_power2_divisions:0"),
        ("[3:4]", "\"3\""),
        ("[0:2]", "\"0\""),
        ("[256:3]", "256:3"),
        ("[256:1", "roundup_power2_divisions"),
        ("[256]", "roundup_power2_divisions"),
        ("[256:1;512:2]", "roundup_power2_divisions"),
        ("[x:1]", "\"x\""),
    ] {
        refused(&format!("roundup_power2_divisions:{bad}"), &[named]);
    }
    refused("roundup_power2_divisions:3", &["a power of two"]);
}

#[test]
fn booleans_are_true_or_false_exactly() {
    for bad in ["true", "1", "TRUE", "yes"] {
        refused(&format!("expandable_segments:{bad}"), &[&format!("expandable_segments:{bad}"), "True or False"]);
    }
}

#[test]
fn numbers_keep_pytorchs_ranges() {
    for (s, v) in [("0.5", 0.5), ("1e-3", 0.001), (".5", 0.5), ("0.999", 0.999)] {
        assert_eq!(ok(&format!("garbage_collection_threshold:{s}")).garbage_collection_threshold, v, "{s}");
    }
    for bad in ["0", "1", "nan", "-0.5", "inf"] {
        refused(
            &format!("garbage_collection_threshold:{bad}"),
            &[&format!("garbage_collection_threshold:{bad}"), "over 0 and under 1"],
        );
    }
    for (s, v) in [("0", 0.0), ("1", 1.0), ("0.25", 0.25)] {
        assert_eq!(ok(&format!("per_process_memory_fraction:{s}")).per_process_memory_fraction, v, "{s}");
    }
    for bad in ["1.5", "-0.1", "nan"] {
        refused(
            &format!("per_process_memory_fraction:{bad}"),
            &[&format!("per_process_memory_fraction:{bad}"), "from 0 to 1"],
        );
    }
    assert_eq!(ok("pinned_num_register_threads:128").pinned_num_register_threads, 128);
    for bad in ["3", "256", "0"] {
        refused(
            &format!("pinned_num_register_threads:{bad}"),
            &[&format!("pinned_num_register_threads:{bad}"), "a power of two, at most 128"],
        );
    }
    refused("pinned_reserve_segment_size_mb:0", &["pinned_reserve_segment_size_mb:0", "at least 1"]);
}

#[test]
fn backend_is_native_and_cuda_malloc_async_is_refused() {
    assert_eq!(ok("backend:native"), Config::default());
    refused("backend:cudaMallocAsync", &["backend:cudaMallocAsync", "native caching allocator"]);
    refused("backend:cudaMallocAsync,max_split_size_mb:64", &["backend:cudaMallocAsync"]);
    refused("backend:foo", &["backend:foo", "native"]);
}

#[test]
fn unknown_keys_are_named() {
    for (s, key) in [("foo:1", "\"foo\""), ("Max_split_size_mb:64", "\"Max_split_size_mb\""), ("foo:[1:2]", "\"foo\"")]
    {
        refused(s, &[key, "unknown key", "max_split_size_mb"]);
    }
    // Even after good entries, and a cudaMallocAsync-only name is just as unknown.
    refused("max_split_size_mb:64,bogus_key:True", &["\"bogus_key\""]);
}

#[test]
fn what_pytorch_lets_through_unchecked_is_refused() {
    // std::stoull/std::stod stop at the first character that does not fit; PyTorch never
    // checks that its separators are the ones it expects.
    for (s, named) in [
        ("max_split_size_mb:64MB", "max_split_size_mb:64MB"),
        ("max_split_size_mb:-1", "max_split_size_mb:-1"),
        ("max_split_size_mb:+30", "max_split_size_mb:+30"),
        ("max_split_size_mb:30.5", "max_split_size_mb:30.5"),
        ("garbage_collection_threshold:0.5x", "garbage_collection_threshold:0.5x"),
        ("max_split_size_mb,64", "max_split_size_mb"),
        ("max_split_size_mb:64:65", "max_split_size_mb:64"),
        ("max_split_size_mb:64;expandable_segments:True", "max_split_size_mb"),
    ] {
        refused(s, &[named]);
    }
}

#[test]
fn the_string_must_have_its_shape() {
    for (s, named) in [
        ("max_split_size_mb", "max_split_size_mb"),
        ("max_split_size_mb:", "max_split_size_mb"),
        (",max_split_size_mb:64", "expected a key, found \",\""),
        ("max_split_size_mb:64,,expandable_segments:True", "expected a key, found \",\""),
        ("expandable_segments:[True]", "expandable_segments"),
        ("max_split_size_mb:[64]", "max_split_size_mb: expected ':' after 64"),
        (":64", "expected a key, found \":\""),
        ("max_split_size_mb:64 expandable_segments:True", "max_split_size_mb:64expandable_segments"),
    ] {
        refused(s, &[named]);
    }
}

#[test]
fn a_refused_string_changes_nothing() {
    let before = ok("max_split_size_mb:64,expandable_segments:True");
    let copy = before.clone();
    assert!(before.with_conf("max_split_size_mb:128,expandable_segments:maybe").is_err());
    assert!(before.with_conf("roundup_power2_divisions:[256:2,512:3]").is_err());
    assert_eq!(before, copy);
}

#[test]
fn with_conf_replaces_every_key_and_keeps_the_other_options() {
    let start = Config { sim_devices: 3, ..ok("max_split_size_mb:64,roundup_power2_divisions:4") };
    let c = start.with_conf("expandable_segments:True").unwrap();
    assert_eq!(c.sim_devices, 3);
    assert!(c.expandable_segments);
    assert_eq!((c.max_split_size, c.roundup_power2_divisions), (usize::MAX, [0; ROUNDUP_INTERVALS]));
}

#[test]
fn the_string_reads_back_to_the_same_config() {
    let d = Config::default().conf_string();
    assert!(d.starts_with("backend:native,large_segment_size_mb:20,max_split_size_mb:17592186044415,"), "{d}");
    for s in [
        "",
        "max_split_size_mb:64,max_non_split_rounding_mb:40,large_segment_size_mb:32",
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],garbage_collection_threshold:0.6",
        "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
        "roundup_power2_divisions:[1024:4,256:2]",
        "roundup_power2_divisions:[>:4],expandable_segments:True,release_lock_on_cudamalloc:True",
        "per_process_memory_fraction:0.123456789,pinned_reserve_segment_size_mb:7",
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:16,pinned_use_background_threads:True",
        "graph_capture_record_stream_reuse:True,garbage_collection_threshold:1e-9",
        "large_segment_size_mb:11,max_split_size_mb:11,max_non_split_rounding_mb:11",
    ] {
        let c = ok(s);
        let shown = c.conf_string();
        assert_eq!(ok(&shown), c, "{s:?} shows as {shown:?}");
        assert_eq!(ok(&shown).conf_string(), shown);
        let optional = ["pinned_reserve_segment_size_mb", "garbage_collection_threshold"];
        for k in CONF_KEYS.iter().filter(|k| !optional.contains(&k.key)) {
            assert!(shown.contains(&format!("{}:", k.key)), "{shown} lacks {}", k.key);
        }
    }
    assert_eq!(
        ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").conf_string().split(',').nth(4).unwrap(),
        "roundup_power2_divisions:[256:1"
    );
    assert!(ok("roundup_power2_divisions:8").conf_string().contains(",roundup_power2_divisions:8,"));
}

#[test]
fn every_divisions_table_reads_back() {
    // A table of 16 entries from {0, 1, 2, 8}, from a small generator: runs, isolated
    // values and tables equal but for one end.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for n in 0..20_000 {
        let mut t = [0; ROUNDUP_INTERVALS];
        for d in t.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly repeats of the previous entry, so that runs of every length occur.
            *d = [0, 1, 2, 8][(x % 4) as usize];
        }
        if n % 2 == 0 {
            let fill = t[(x % 16) as usize];
            let from = (x >> 8) as usize % ROUNDUP_INTERVALS;
            t[from..].fill(fill);
        }
        let shown = show_roundup(&t);
        let back = ok(&format!("roundup_power2_divisions:{shown}")).roundup_power2_divisions;
        assert_eq!(back, t, "{shown}");
    }
}

#[test]
fn pytorch_conf_applies_the_keys_to_pytorchs_defaults() {
    // No key: PyTorch's defaults, ordinary segments (gpupool's default is expandable).
    assert_eq!(Config::pytorch_conf("").unwrap(), Config::pytorch());
    assert_eq!(Config::pytorch_conf(" ").unwrap(), Config::pytorch());
    let c = Config::pytorch_conf("max_split_size_mb:64").unwrap();
    assert_eq!((c.max_split_size, c.expandable_segments), (64 * MIB, false));
    assert!(Config::pytorch_conf("expandable_segments:True").unwrap().expandable_segments);
    // gpupool's own options stay at their defaults.
    assert_eq!(c.expandable_large_pages, Config::default().expandable_large_pages);
    let e = Config::pytorch_conf("max_split_size_mb:19").unwrap_err();
    assert!(e.message().contains("max_split_size_mb:19"), "{e}");
}
