//! Unit tests of the options: the syntax of every kind, the defaults, the messages of bad
//! values, the printed options, and the tables of the module docs and the documentation.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use super::unknown::READ_ELSEWHERE;
use super::*;
use crate::error::Error;
use crate::history::{HistoryContext, HistorySettings, HistoryStacks};

fn table(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let owned: Vec<(String, String)> = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

fn one(name: &str, value: &str) -> Result<Config, Error> {
    Config::from_lookup(table(&[(name, value)]))
}

fn opt(name: &str) -> &'static Opt {
    OPTIONS.iter().find(|o| o.name == name).unwrap()
}

#[test]
fn sizes_parse() {
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("64MiB"), Some(64 << 20));
    assert_eq!(parse_size("16 GiB"), Some(16 << 30));
    assert_eq!(parse_size("2g"), Some(2 << 30));
    assert_eq!(parse_size("lots"), None);
    assert_eq!(parse_size("99999999999T"), None);
}

#[test]
fn options_parse_and_bad_values_are_named() {
    let c = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "sim"), ("GPUPOOL_SIM_DEVICES", "2")])).unwrap();
    assert_eq!((c.driver, c.sim_devices), (DriverKind::Sim, 2));
    let c = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "64")])).unwrap();
    assert_eq!(c.max_split_size, 64 << 20);
    let e = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "opencl")])).unwrap_err();
    assert!(e.message().contains("GPUPOOL_DRIVER"), "{e}");
    let e = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "19")])).unwrap_err();
    assert!(e.message().contains("at least 20MiB"), "{e}");
}

#[test]
fn the_defaults_are_the_tables() {
    let c = Config::default();
    for o in &OPTIONS {
        assert_eq!(o.get(&c), o.default, "{}", o.name);
    }
    assert_eq!(Config::from_lookup(|_| None::<String>).unwrap(), c);
}

#[test]
fn every_size_option_takes_every_suffix() {
    let sizes: Vec<&Opt> = OPTIONS.iter().filter(|o| matches!(o.kind, Kind::Size { .. })).collect();
    assert_eq!(sizes.len(), 5);
    let cases = [
        ("64M", 64 << 20),
        ("64MiB", 64 << 20),
        ("64mb", 64 << 20),
        ("65536K", 64 << 20),
        ("65536 KiB", 64 << 20),
        ("1G", 1 << 30),
        ("1gib", 1 << 30),
        ("1T", 1 << 40),
        ("1TiB", 1 << 40),
        (" 2 GiB ", 2 << 30),
        ("67108864B", 64 << 20),
    ];
    for o in sizes {
        for (text, bytes) in cases {
            let c = one(o.name, text).unwrap_or_else(|e| panic!("{}={text:?}: {e}", o.name));
            assert_eq!(o.get(&c), Value::Size(bytes), "{}={text:?}", o.name);
        }
        for bad in ["12X", "1.5G", "-1", "G", "1 G B", "99999999999T"] {
            let e = one(o.name, bad).unwrap_err();
            assert!(e.message().contains(o.name) && e.message().contains("a size"), "{e}");
        }
    }
    // The case that used to be refused: the shim's size in the size syntax.
    assert_eq!(one("GPUPOOL_PRELOAD_SYNC_BYTES", "256MiB").unwrap().preload_sync_bytes, 256 << 20);
    // A bare number counts bytes, except in the option PyTorch counts in MiB.
    assert_eq!(one("GPUPOOL_SIM_CAPACITY", "4096").unwrap().sim_capacity, 4096);
    assert_eq!(one("GPUPOOL_PRELOAD_SYNC_BYTES", "0").unwrap().preload_sync_bytes, 0);
    assert_eq!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "20").unwrap().max_split_size, 20 << 20);
    assert!(one("GPUPOOL_SIM_CAPACITY", "0").is_err());
    assert!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "19MiB").is_err());
    assert!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "99999999999999999").is_err());
}

#[test]
fn empty_means_unset_for_every_option() {
    for name in OPTIONS.iter().map(|o| o.name).chain([CONF_VAR]) {
        for empty in ["", "  "] {
            assert_eq!(one(name, empty), Ok(Config::default()), "{name}={empty:?}");
        }
    }
}

/// GPUPOOL_CONF's rule for every variable: only the ASCII space is ignored (around a value, and
/// before a size's unit); any other white space or control character is an error naming the
/// variable, the character and its byte offset.
#[test]
fn only_the_ascii_space_surrounds_a_value() {
    for name in OPTIONS.iter().map(|o| o.name).chain([CONF_VAR]) {
        for (text, named, at) in [("\t", "U+0009 (tab)", 0), (" \n", "U+000A (line feed)", 1)] {
            let e = one(name, text).unwrap_err();
            for w in [name, named, &format!("at byte {at}"), "only the ASCII space"] {
                assert!(e.message().contains(w), "{name}={text:?}: the message should name {w:?}: {e}");
            }
        }
    }
    for (name, text, named, at) in [
        ("GPUPOOL_SIM_CAPACITY", "16\u{a0}GiB", "U+00A0", 2),
        ("GPUPOOL_DRIVER", "sim\r", "U+000D", 3),
        ("GPUPOOL_RECORD_HISTORY", "1000:\tall", "U+0009", 5),
        ("GPUPOOL_PRELOAD_STATS", "\u{2029}on", "U+2029", 0),
    ] {
        let e = one(name, text).unwrap_err();
        assert!(e.message().contains(named) && e.message().contains(&format!("at byte {at}")), "{e}");
    }
    assert_eq!(one("GPUPOOL_SIM_CAPACITY", " 16 GiB ").unwrap().sim_capacity, 16 << 30);
}

/// A size past the largest is refused naming the largest; `GPUPOOL_MAX_SPLIT_SIZE_MB` at the
/// largest, 17592186044415 MiB, means unlimited, as `max_split_size_mb` at it does.
#[test]
fn sizes_past_the_largest_are_refused_naming_it() {
    let e = one("GPUPOOL_SIM_CAPACITY", "99999999999T").unwrap_err();
    assert!(e.message().contains(&format!("at most {} bytes", usize::MAX)), "{e}");
    let largest = usize::MAX / MIB;
    let e = one("GPUPOOL_MAX_SPLIT_SIZE_MB", &(largest + 1).to_string()).unwrap_err();
    assert!(e.message().contains(&format!("at most {largest} MiB")), "{e}");
    assert_eq!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", &largest.to_string()).unwrap().max_split_size, usize::MAX);
    let both = [("GPUPOOL_MAX_SPLIT_SIZE_MB", largest.to_string()), (CONF_VAR, format!("max_split_size_mb:{largest}"))];
    let c = Config::from_lookup(|k| both.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
    assert_eq!(c.max_split_size, usize::MAX, "the two spellings agree");
}

#[test]
fn words_and_booleans_ignore_case() {
    assert_eq!(one("GPUPOOL_DRIVER", "SIM").unwrap().driver, DriverKind::Sim);
    assert_eq!(one("GPUPOOL_DRIVER", " Cuda ").unwrap().driver, DriverKind::Cuda);
    assert_eq!(one("GPUPOOL_PRELOAD_MODE", "Stream").unwrap().preload_mode, PreloadMode::Stream);
    assert_eq!(one("GPUPOOL_PRELOAD_MODE", "SAFE").unwrap().preload_mode, PreloadMode::Safe);
    for yes in ["1", "true", "TRUE", "yes", "Yes", "on", "ON"] {
        assert!(one("GPUPOOL_PRELOAD_STATS", yes).unwrap().preload_stats, "{yes}");
    }
    for no in ["0", "false", "False", "no", "NO", "off", "Off"] {
        assert!(!one("GPUPOOL_PRELOAD_STATS", no).unwrap().preload_stats, "{no}");
    }
    for bad in ["2", "y", "enabled"] {
        let e = one("GPUPOOL_PRELOAD_STATS", bad).unwrap_err();
        assert!(e.message().contains("GPUPOOL_PRELOAD_STATS") && e.message().contains("on/off"), "{e}");
    }
}

#[test]
fn counts_keep_their_range() {
    assert_eq!(one("GPUPOOL_SIM_DEVICES", "64").unwrap().sim_devices, 64);
    for bad in ["0", "65", "-1", "two", "1K"] {
        let e = one("GPUPOOL_SIM_DEVICES", bad).unwrap_err();
        assert!(e.message().contains("from 1 to 64"), "{e}");
    }
}

#[test]
fn a_value_that_is_not_utf8_is_an_error_naming_the_variable() {
    let rows = OPTIONS.iter().map(|o| {
        let default = o.kind.show(o.default);
        (o.name, if default == "unlimited" { "64".to_string() } else { default })
    });
    for (name, valid) in rows.chain([(CONF_VAR, "max_split_size_mb:64".to_string())]) {
        let mut bytes = valid.into_bytes();
        bytes.push(0xff);
        let raw = OsString::from_vec(bytes);
        let e = Config::from_lookup(|n| (n == name).then(|| raw.clone())).unwrap_err();
        assert!(matches!(e, Error::InvalidValue(_)));
        assert!(e.message().contains(name) && e.message().contains("not valid UTF-8"), "{e}");
        assert!(e.message().contains("\\xFF"), "the value is shown: {e}");
    }
}

#[test]
fn bad_values_name_the_variable_the_value_and_what_is_expected() {
    let cases = [
        ("GPUPOOL_DRIVER", "opencl", "cuda or sim"),
        ("GPUPOOL_SIM_CAPACITY", "16Q", "a size"),
        ("GPUPOOL_SIM_DEVICES", "0", "from 1 to 64"),
        ("GPUPOOL_SIM_START_DELAY_MS", "60001", "from 0 to 60000"),
        ("GPUPOOL_MAX_SPLIT_SIZE_MB", "4", "at least 20MiB"),
        ("GPUPOOL_PRELOAD_MODE", "fast", "safe or stream"),
        ("GPUPOOL_PRELOAD_SYNC_BYTES", "lots", "a size"),
        ("GPUPOOL_PRELOAD_STATS", "maybe", "a boolean"),
        ("GPUPOOL_EXPANDABLE_RECLAIM", "sometimes", "a boolean"),
        ("GPUPOOL_EXPANDABLE_LARGE_PAGES", "20MB", "a boolean"),
        ("GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST", "-3", "from 0 to 1048576"),
        ("GPUPOOL_RELEASE_UNUSED_STREAMS", "often", "a boolean"),
        ("GPUPOOL_SLEEP_CHUNK", "big", "a size"),
        ("GPUPOOL_SLEEP_BUFFERS", "1", "from 2 to 64"),
        ("GPUPOOL_SLEEP_THREADS", "-1", "from 0 to 256"),
        ("GPUPOOL_SLEEP_PAGE", "1M", "at least 2MiB"),
        ("GPUPOOL_SLEEP_HUGE_PAGES", "2M", "a boolean"),
        ("GPUPOOL_RECORD_HISTORY", "100000:stacks", "100000:alloc"),
        ("GPUPOOL_LIVE_REPORT_AT_EXIT", "later", "a boolean"),
        ("GPUPOOL_SNAPSHOT_AT_EXIT", "/tmp/snapshots/", "not a folder's"),
    ];
    assert_eq!(cases.len(), OPTIONS.len());
    for (name, value, want) in cases {
        let e = one(name, value).unwrap_err();
        let m = e.message();
        assert!(matches!(e, Error::InvalidValue(_)));
        assert!(m.contains(name) && m.contains(&format!("{value:?}")) && m.contains(want), "{m}");
    }
}

#[test]
fn history_settings_parse() {
    let h = |t: &str| one("GPUPOOL_RECORD_HISTORY", t).map(|c| c.record_history);
    let on = |max_entries, context| Ok(Some(HistorySettings { max_entries, context, stacks: Default::default() }));
    assert_eq!(h(""), Ok(None));
    assert_eq!(h("off"), Ok(None));
    assert_eq!(h("100000"), on(100000, HistoryContext::All));
    assert_eq!(h(" 5000 : State "), on(5000, HistoryContext::State));
    assert_eq!(h("0:none"), on(0, HistoryContext::None));
    assert_eq!(h("7:alloc"), on(7, HistoryContext::Alloc));
    let stacks = |t: &str| h(t).unwrap().unwrap().stacks;
    assert_eq!(stacks("7:alloc"), HistoryStacks::All);
    assert_eq!(stacks("7:all:Python"), HistoryStacks::Python);
    assert_eq!(stacks("7:state: native "), HistoryStacks::Native);
    for bad in ["on", "-1", "10:", "10:stacks", ":all", "1e5", "10:all:x", "10:all:", "10:all:python:native"] {
        assert!(h(bad).is_err(), "{bad}");
    }
    let row = opt("GPUPOOL_RECORD_HISTORY");
    let v = Value::History(Some(HistorySettings {
        max_entries: 12,
        context: HistoryContext::Alloc,
        stacks: Default::default(),
    }));
    assert_eq!(row.kind.show(v), "12:alloc");
    let v = Value::History(Some(HistorySettings {
        max_entries: 12,
        context: HistoryContext::All,
        stacks: HistoryStacks::Native,
    }));
    assert_eq!(row.kind.show(v), "12:all:native");
}

#[test]
fn the_snapshot_path_is_kept_as_written_and_a_folder_is_refused() {
    let p = |t: &str| one("GPUPOOL_SNAPSHOT_AT_EXIT", t).map(|c| c.snapshot_at_exit);
    assert_eq!(p(""), Ok(None));
    assert_eq!(p("   "), Ok(None));
    assert_eq!(p(" out/run 1.pickle "), Ok(Some("out/run 1.pickle")), "inner spaces kept, outer ones trimmed");
    assert_eq!(p("snapshot"), Ok(Some("snapshot")));
    for bad in ["/", "out/", "./"] {
        let e = p(bad).unwrap_err();
        let m = e.message();
        assert!(m.contains("GPUPOOL_SNAPSHOT_AT_EXIT") && m.contains("not a folder's"), "{bad}: {m}");
    }
    assert!(p("a\tb").is_err(), "a tab is refused, as in every value");
    let c = one("GPUPOOL_SNAPSHOT_AT_EXIT", "x.pickle").unwrap();
    assert!(c.options_text().contains("\nGPUPOOL_SNAPSHOT_AT_EXIT=x.pickle\n"), "{}", c.options_text());
}

#[test]
fn options_text_shows_every_option_with_its_value() {
    let c = Config::from_lookup(table(&[
        ("GPUPOOL_DRIVER", "sim"),
        ("GPUPOOL_SIM_CAPACITY", "64M"),
        ("GPUPOOL_PRELOAD_STATS", "yes"),
    ]))
    .unwrap();
    let text = c.options_text();
    assert_eq!(
        text,
        "GPUPOOL_DRIVER=sim\n\
         GPUPOOL_SIM_CAPACITY=64MiB\n\
         GPUPOOL_SIM_DEVICES=1 (default)\n\
         GPUPOOL_SIM_START_DELAY_MS=0 (default)\n\
         GPUPOOL_MAX_SPLIT_SIZE_MB=unlimited (default)\n\
         GPUPOOL_PRELOAD_MODE=safe (default)\n\
         GPUPOOL_PRELOAD_SYNC_BYTES=256MiB (default)\n\
         GPUPOOL_PRELOAD_STATS=on\n\
         GPUPOOL_EXPANDABLE_RECLAIM=off (default)\n\
         GPUPOOL_EXPANDABLE_LARGE_PAGES=on (default)\n\
         GPUPOOL_EXPANDABLE_PAGES_PER_REQUEST=16 (default)\n\
         GPUPOOL_RELEASE_UNUSED_STREAMS=off (default)\n\
         GPUPOOL_SLEEP_CHUNK=32MiB (default)\n\
         GPUPOOL_SLEEP_BUFFERS=4 (default)\n\
         GPUPOOL_SLEEP_THREADS=0 (default)\n\
         GPUPOOL_SLEEP_PAGE=64MiB (default)\n\
         GPUPOOL_SLEEP_HUGE_PAGES=on (default)\n\
         GPUPOOL_RECORD_HISTORY=off (default)\n\
         GPUPOOL_LIVE_REPORT_AT_EXIT=off (default)\n\
         GPUPOOL_SNAPSHOT_AT_EXIT= (default)\n\
         GPUPOOL_CONF=backend:native,large_segment_size_mb:20,max_split_size_mb:17592186044415,\
         max_non_split_rounding_mb:20,roundup_power2_divisions:[1:0,>:0],expandable_segments:True,\
         release_lock_on_cudamalloc:False,per_process_memory_fraction:1,\
         graph_capture_record_stream_reuse:False,pinned_use_cuda_host_register:False,\
         pinned_num_register_threads:1,pinned_use_background_threads:False (default)\n"
    );
    let c = Config::from_lookup(table(&[("GPUPOOL_CONF", "max_split_size_mb:64, expandable_segments:False")])).unwrap();
    let last = c.options_text().lines().last().unwrap().to_string();
    assert!(last.starts_with("GPUPOOL_CONF=backend:native,"), "{last}");
    assert!(last.contains(",max_split_size_mb:64,") && last.contains(",expandable_segments:False,"), "{last}");
    assert!(!last.ends_with("(default)"), "{last}");
    // Every shown value reads back to itself; an unset path, shown empty, as unset.
    for o in &OPTIONS {
        for v in [o.default, o.get(&c)] {
            if v == Value::Path(None) {
                assert_eq!(o.parse_text(o.name, &o.kind.show(v)), Ok(None), "{}", o.name);
            } else if v != Value::Size(usize::MAX) {
                assert_eq!(o.parse_text(o.name, &o.kind.show(v)), Ok(Some(v)), "{}", o.name);
            }
        }
    }
    assert_eq!(opt("GPUPOOL_SIM_CAPACITY").kind.show(Value::Size(1000)), "1000");
    assert_eq!(opt("GPUPOOL_MAX_SPLIT_SIZE_MB").kind.show(Value::Size(1000)), "1000B");
}

#[test]
fn the_module_docs_and_docs_configuration_md_hold_the_tables() {
    for table in [options_markdown(), conf_keys_markdown()] {
        let docs: String = table.lines().map(|l| format!("//! {l}\n")).collect();
        assert!(include_str!("mod.rs").contains(&docs), "src/config/mod.rs's module docs must hold:\n{docs}");
        let page = include_str!("../../docs/configuration.md");
        assert!(page.contains(&table), "docs/configuration.md must hold:\n{table}");
    }
}

#[test]
fn the_deprecated_max_split_variable_agrees_with_gpupool_conf_or_is_refused() {
    let both = |alias: &str, conf: &str| {
        Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", alias), ("GPUPOOL_CONF", conf)]))
    };
    // Alone, or with a GPUPOOL_CONF that does not name the key, it still works.
    assert_eq!(one("GPUPOOL_MAX_SPLIT_SIZE_MB", "64").unwrap().max_split_size, 64 << 20);
    let c = both("64", "expandable_segments:True").unwrap();
    assert_eq!((c.max_split_size, c.expandable_segments), (64 << 20, true));
    // The same size both ways is no conflict, in any unit.
    assert_eq!(both("64MiB", "max_split_size_mb:64").unwrap().max_split_size, 64 << 20);
    assert_eq!(both("1G", "max_split_size_mb:1024").unwrap().max_split_size, 1 << 30);
    // Different sizes: an error naming both.
    let e = both("64", "max_split_size_mb:128").unwrap_err();
    let m = e.message();
    assert!(matches!(e, Error::InvalidValue(_)));
    assert!(m.contains("GPUPOOL_MAX_SPLIT_SIZE_MB=64MiB") && m.contains("GPUPOOL_CONF"), "{m}");
    assert!(m.contains("max_split_size_mb:128MiB") && m.contains("deprecated"), "{m}");
    // Its floor is GPUPOOL_CONF's large_segment_size_mb, as for the key.
    let e = both("32", "large_segment_size_mb:64").unwrap_err();
    assert!(
        e.message().contains("GPUPOOL_MAX_SPLIT_SIZE_MB=32MiB") && e.message().contains("large_segment_size_mb:64")
    );
    assert_eq!(both("64", "large_segment_size_mb:64").unwrap().max_split_size, 64 << 20);
}

#[test]
fn a_bad_gpupool_conf_is_an_error_naming_the_variable_the_key_and_the_value() {
    let e = one("GPUPOOL_CONF", "expandable_segments:yes").unwrap_err();
    let m = e.message();
    assert!(matches!(e, Error::InvalidValue(_)));
    assert!(m.contains("environment variable GPUPOOL_CONF") && m.contains("expandable_segments:yes"), "{m}");
    assert!(m.contains("True or False"), "{m}");
}

#[test]
fn unknown_gpupool_variables_are_warned_about_once_each_with_the_name_meant() {
    use super::unknown::unknown_variable_warnings;
    let w = |names: &[&str]| unknown_variable_warnings(names.iter().copied());
    // The library's own variables, those read elsewhere and any other prefix: nothing.
    let quiet: Vec<&str> = OPTIONS.iter().map(|o| o.name).chain([CONF_VAR]).collect();
    assert_eq!(w(&quiet), Vec::<String>::new());
    for (name, _) in READ_ELSEWHERE {
        assert_eq!(w(&[name]), Vec::<String>::new(), "{name}");
    }
    assert_eq!(w(&["PATH", "gpupool_cnf", "PYTORCH_CUDA_ALLOC_CONF", "XGPUPOOL_CNF"]), Vec::<String>::new());
    // A misspelling names the variable it probably meant; a name given twice is named once.
    assert_eq!(
        w(&["GPUPOOL_CNF", "GPUPOOL_DRIVER", "GPUPOOL_CNF"]),
        ["gpupool: warning: unknown environment variable GPUPOOL_CNF is ignored (did you mean GPUPOOL_CONF?)"]
    );
    let meant = |name: &str| {
        let lines = w(&[name]);
        assert_eq!(lines.len(), 1, "{name}: {lines:?}");
        assert!(lines[0].contains(&format!("variable {name} is ignored")), "{}", lines[0]);
        lines[0].split_once("did you mean ").map(|(_, k)| k.trim_end_matches("?)").to_string())
    };
    for (typo, known) in [
        ("GPUPOOL_COFN", "GPUPOOL_CONF"),
        ("GPUPOOL_conf", "GPUPOOL_CONF"),
        ("GPUPOOL_SIM_DEVICE", "GPUPOOL_SIM_DEVICES"),
        ("GPUPOOL_SIM_CAPACITY_", "GPUPOOL_SIM_CAPACITY"),
        ("GPUPOOL_MAX_SPLIT_SIZE", "GPUPOOL_MAX_SPLIT_SIZE_MB"),
        ("GPUPOOL_PRELOAD_STAT", "GPUPOOL_PRELOAD_STATS"),
        ("GPUPOOL_RECORD_HISTROY", "GPUPOOL_RECORD_HISTORY"),
        ("GPUPOOL_LIBS", "GPUPOOL_LIB"),
    ] {
        assert_eq!(meant(typo).as_deref(), Some(known), "{typo}");
    }
    // Nothing close: the variable alone.
    for far in ["GPUPOOL_", "GPUPOOL_X", "GPUPOOL_VERBOSE", "GPUPOOL_TEST_DRIVER"] {
        assert_eq!(meant(far), None, "{far}");
    }
    // A name that is not UTF-8 is named, lossily.
    let raw = OsString::from_vec(b"GPUPOOL_\xffX".to_vec());
    let lines = unknown_variable_warnings([raw]);
    assert_eq!(lines.len(), 1);
    assert!(lines[0].contains("GPUPOOL_\u{fffd}X"), "{}", lines[0]);
}

#[test]
fn docs_configuration_md_lists_the_variables_read_elsewhere() {
    let list: String = READ_ELSEWHERE.iter().map(|(name, who)| format!("- `{name}`: {who}\n")).collect();
    assert!(include_str!("../../docs/configuration.md").contains(&list), "docs/configuration.md must hold:\n{list}");
}
