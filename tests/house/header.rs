//! The C headers read as a manual (issue 38), held by tests, as rustls-ffi's `docgen` holds
//! its header: every item of every `include/*.h` has a comment; `gpupool.h` reads in sections,
//! each opened by a banner and a paragraph, in the order of [`SECTIONS`]; and its opening
//! overview names every header and every section, and lists every `GPUPOOL_*` variable as
//! `gpupool::config::options_c_comment` writes it from the options table.
//!
//! The list lives in cbindgen.toml's `header`, from which cbindgen copies it; when the table
//! changes, `GPUPOOL_BLESS=1 cargo test --test house header` writes the new list into cbindgen.toml
//! and include/gpupool.h (what `.ci/run headers` would write). Reads files only; needs no device.
use std::fs;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The sections of include/gpupool.h in reading order, each with its functions in order. The
/// constants and types come first, as C needs them declared before use; then device memory,
/// the features, and pinned host memory last.
const SECTIONS: &[(&str, &[&str])] = &[
    ("Constants and types", &[]),
    (
        "Device memory",
        &[
            "gpupool_malloc",
            "gpupool_free",
            "gpupool_record_stream",
            "gpupool_stream_retire",
            "gpupool_empty_cache",
            "gpupool_device_count",
            "gpupool_set_memory_fraction",
        ],
    ),
    (
        "Statistics and the memory summary",
        &["gpupool_stats", "gpupool_peak_settles", "gpupool_reset_peak_stats", "gpupool_memory_summary"],
    ),
    ("Errors", &["gpupool_last_error_message", "gpupool_status_string", "gpupool_version"]),
    ("Configuration", &["gpupool_set_config", "gpupool_config_string"]),
    (
        "Private pools and CUDA graphs",
        &[
            "gpupool_pool_create",
            "gpupool_pool_create_ex",
            "gpupool_begin_allocate_to_pool",
            "gpupool_begin_allocate_to_pool_thread",
            "gpupool_begin_allocate_to_pool_filter",
            "gpupool_end_allocate_to_pool",
            "gpupool_release_pool",
            "gpupool_pool_stats",
            "gpupool_pool_set_limit",
            "gpupool_pool_get_limit",
            "gpupool_pool_create_with_allocator",
            "gpupool_pool_create_with_allocator_aligned",
        ],
    ),
    (
        "Expandable segments and the largest allocatable request",
        &["gpupool_largest_allocatable", "gpupool_enable_peer_access"],
    ),
    (
        "Sleep and wake",
        &[
            "gpupool_pool_create_sleepable",
            "gpupool_sleep",
            "gpupool_sleep_prepare",
            "gpupool_wake",
            "gpupool_sleep_host_bytes",
            "gpupool_sleep_release_kept",
        ],
    ),
    (
        "Observers",
        &[
            "gpupool_attach_oom_observer",
            "gpupool_detach_oom_observer",
            "gpupool_oom_retry",
            "gpupool_attach_segment_observer",
            "gpupool_detach_segment_observer",
            "gpupool_segment_mapped_range",
        ],
    ),
    (
        "History and tags",
        &[
            "gpupool_record_history",
            "gpupool_dump_snapshot",
            "gpupool_dump_snapshot_with",
            "gpupool_set_memory_metadata",
            "gpupool_get_memory_metadata",
            "gpupool_annotate_memory",
            "gpupool_push_tag",
            "gpupool_pop_tag",
            "gpupool_tag_stats",
            "gpupool_for_each_tag",
            "gpupool_live_report",
        ],
    ),
    (
        "Pinned host memory",
        &[
            "gpupool_host_malloc",
            "gpupool_host_free",
            "gpupool_host_record_event",
            "gpupool_host_empty_cache",
            "gpupool_host_stats",
            "gpupool_host_reset_peak_stats",
            // The trailer's helpers, after the include guard.
            "gpupool_stats_init",
            "gpupool_host_stats_init",
        ],
    ),
];

/// A banner's rule: a line of dashes, as the doc comments hold it after cbindgen's ` * `.
fn rule() -> String {
    format!(" * {}", "-".repeat(92))
}

fn headers() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(Path::new(ROOT).join("include"))
        .expect("include/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        .collect();
    found.sort();
    assert!(found.len() >= 5, "include/ holds the headers: {found:?}");
    found
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What a declaration of a header declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Constant,
    Enum,
    Variant,
    Struct,
    Field,
    Type,
    Function,
}

/// One declaration of a header, and whether a comment ends on the line above it.
#[derive(Debug)]
struct Item {
    kind: Kind,
    name: String,
    line: usize,
    documented: bool,
}

/// The identifier that ends `s` (trailing punctuation and array bounds dropped).
fn last_ident(s: &str) -> String {
    let s = s.split('[').next().unwrap();
    let end = s.trim_end_matches(|c: char| !(c.is_alphanumeric() || c == '_'));
    let start = end.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
    end[start..].to_string()
}

/// Every declaration of a header as cbindgen writes it (with the hand-written trailer of
/// gpupool.h). Every line must be understood: one that is not panics, so that no item can pass
/// unchecked by being unrecognised.
fn items(text: &str) -> Vec<Item> {
    #[derive(PartialEq)]
    enum State {
        Top,
        EnumHead,
        Enum,
        Struct,
        Continued,
        InlineBody,
    }
    let mut state = State::Top;
    let (mut in_comment, mut after_comment) = (false, false);
    let mut ifndef = String::new();
    let mut enums: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let documented = std::mem::replace(&mut after_comment, false);
        if in_comment {
            in_comment = !line.ends_with("*/");
            after_comment = !in_comment;
            continue;
        }
        if line.starts_with("/*") {
            in_comment = !(line.len() > 3 && line.ends_with("*/"));
            after_comment = !in_comment;
            continue;
        }
        if line.starts_with("//") {
            after_comment = true;
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let mut push = |kind, name: String| out.push(Item { kind, name, line: i + 1, documented });
        if let Some(directive) = line.strip_prefix('#') {
            let words: Vec<&str> = directive.split_whitespace().collect();
            match words[0] {
                "ifndef" => ifndef = words[1].to_string(),
                // An include guard, or a constant.
                "define" if words.len() == 2 && words[1] == ifndef => {}
                "define" => push(Kind::Constant, words[1].to_string()),
                "include" | "if" | "ifdef" | "else" | "endif" => {}
                _ => panic!("line {}: unknown directive: {raw}", i + 1),
            }
            continue;
        }
        match state {
            State::Top if line.starts_with("enum ") => {
                let name = last_ident(line);
                enums.push(name.clone());
                push(Kind::Enum, name);
                state = State::EnumHead;
            }
            State::Top if line.starts_with("typedef struct ") && line.ends_with('{') => {
                push(Kind::Struct, line.split_whitespace().nth(2).unwrap().to_string());
                state = State::Struct;
            }
            State::Top if line.starts_with("typedef ") => {
                let name = match line.find("(*") {
                    Some(at) => last_ident(&line[at + 2..at + 2 + line[at + 2..].find(')').unwrap()]),
                    None => last_ident(line),
                };
                // The C spelling of an enum above (cbindgen's `style = "both"`): the enum's.
                if !(line.ends_with(';') && enums.contains(&name)) {
                    push(Kind::Type, name);
                }
                if !line.ends_with(';') {
                    state = State::Continued;
                }
            }
            State::Top if line == "extern \"C\" {" || line.starts_with('}') => {}
            State::Top if line.contains('(') => {
                push(Kind::Function, last_ident(&line[..line.find('(').unwrap()]));
                if line.starts_with("static inline ") && line.ends_with('{') {
                    state = State::InlineBody;
                } else if !line.ends_with(';') {
                    state = State::Continued;
                }
            }
            State::EnumHead if line == "{" => state = State::Enum,
            State::EnumHead if line.starts_with(':') => {}
            State::Enum if line == "};" => state = State::Top,
            State::Enum if line.ends_with(',') => {
                push(Kind::Variant, line.split([' ', ',']).next().unwrap().to_string());
            }
            State::Struct if line.starts_with('}') => state = State::Top,
            State::Struct if line.ends_with(';') => push(Kind::Field, last_ident(line)),
            State::Continued => {
                if line.ends_with(';') {
                    state = State::Top;
                }
            }
            State::InlineBody => {
                if raw == "}" {
                    state = State::Top;
                }
            }
            _ => panic!("line {}: not understood: {raw}", i + 1),
        }
    }
    assert!(state == State::Top && !in_comment, "the header ends inside a declaration or a comment");
    out
}

#[test]
fn the_item_reader_finds_every_kind_and_every_missing_comment() {
    let text = "/*\n * opening\n */\n#ifndef X_H\n#define X_H\n#include <stdint.h>\n\n/**\n * c\n */\n\
                #define X_ONE 1\n#define X_TWO 2\n\n/** e */\nenum x_e\n#if defined(__cplusplus)\n  : uint32_t\n\
                #endif\n {\n  /** a */\n  X_A = 0,\n  X_B = 1,\n};\n#ifndef __cplusplus\n\
                typedef uint32_t x_e;\n#endif\n\n/** s */\ntypedef struct x_s {\n  /** f */\n  int64_t f;\n\
                  uint8_t g[X_ONE];\n} x_s;\n\ntypedef int (*x_fn)(void *user,\n                   int n);\n\n\
                #ifdef __cplusplus\nextern \"C\" {\n#endif\n\n/** f */\nint x_f(int a,\n        int b);\n\n\
                const char *x_g(void);\n\n#ifdef __cplusplus\n}  // extern \"C\"\n#endif\n\n#endif  /* X_H */\n\n\
                /** i */\nstatic inline x_s x_init(void) {\n  x_s s;\n  return s;\n}\n#define X_INIT x_init()\n";
    let found = items(text);
    let found: Vec<(Kind, &str, bool)> = found.iter().map(|i| (i.kind, i.name.as_str(), i.documented)).collect();
    let want = [
        (Kind::Constant, "X_ONE", true),
        (Kind::Constant, "X_TWO", false),
        (Kind::Enum, "x_e", true),
        (Kind::Variant, "X_A", true),
        (Kind::Variant, "X_B", false),
        (Kind::Struct, "x_s", true),
        (Kind::Field, "f", true),
        (Kind::Field, "g", false),
        (Kind::Type, "x_fn", false),
        (Kind::Function, "x_f", true),
        (Kind::Function, "x_g", false),
        (Kind::Function, "x_init", true),
        (Kind::Constant, "X_INIT", false),
    ];
    assert_eq!(found, want);
}

#[test]
#[should_panic(expected = "not understood")]
fn the_item_reader_refuses_a_line_it_does_not_know() {
    items("union x_u {\n  int a;\n};\n");
}

#[test]
fn every_item_of_every_header_has_a_comment() {
    let mut missing = Vec::new();
    for path in headers() {
        let found = items(&read(&path));
        assert!(found.iter().any(|i| i.kind == Kind::Function), "{}: no function found", path.display());
        for item in found.iter().filter(|i| !i.documented) {
            missing.push(format!("{}:{}: {:?} {}", path.display(), item.line, item.kind, item.name));
        }
    }
    assert!(
        missing.is_empty(),
        "undocumented items (write a doc comment on the Rust item, then `.ci/run headers`):\n{}",
        missing.join("\n")
    );
}

/// The banners of a header, `(title, line)`, each checked to have a paragraph.
fn banners(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let rule = rule();
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < lines.len() {
        if lines[i] == rule && lines[i + 2] == rule {
            let title = lines[i + 1].trim_start_matches(" * ").to_string();
            let end = (i + 3..lines.len()).find(|&k| lines[k] == rule || lines[k] == " */");
            let paragraph = end.map_or(0, |end| lines[i + 3..end].iter().filter(|l| l.len() > 3).count());
            assert!(paragraph > 0, "line {}: the banner {title:?} has no paragraph under it", i + 1);
            found.push((title, i + 1));
            i = end.unwrap_or(i + 3);
        }
        i += 1;
    }
    found
}

#[test]
fn gpupool_h_reads_in_sections_each_with_a_banner_and_a_paragraph() {
    let text = read(&Path::new(ROOT).join("include/gpupool.h"));
    let banners = banners(&text);
    let mut found: Vec<(String, Vec<String>)> = banners.iter().map(|(t, _)| (t.clone(), Vec::new())).collect();
    for f in items(&text).into_iter().filter(|i| i.kind == Kind::Function) {
        let Some(section) = banners.iter().rposition(|&(_, line)| line < f.line) else {
            panic!("line {}: {} comes before every section", f.line, f.name);
        };
        found[section].1.push(f.name);
    }
    let want: Vec<(String, Vec<String>)> =
        SECTIONS.iter().map(|(t, fs)| (t.to_string(), fs.iter().map(|f| f.to_string()).collect())).collect();
    assert_eq!(
        found, want,
        "include/gpupool.h's sections and their functions, in order, must be tests/house/header.rs's SECTIONS \
         (a section opens with a banner in the doc comment of its first function; src/ffi/mod.rs declares \
         the modules in the header's order)"
    );
}

/// The opening comment of gpupool.h: what comes before the include guard.
fn overview(text: &str) -> &str {
    &text[..text.find("#ifndef GPUPOOL_H").expect("gpupool.h has its include guard")]
}

#[test]
fn the_overview_names_every_header_and_every_section() {
    let text = read(&Path::new(ROOT).join("include/gpupool.h"));
    let overview = overview(&text);
    for path in headers() {
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(overview.contains(name), "gpupool.h's opening comment must name {name}");
    }
    let mut at = 0;
    for (title, _) in SECTIONS {
        let found = overview[at..].find(title).map(|i| at + i);
        at = found.unwrap_or_else(|| panic!("gpupool.h's opening comment must name the section {title:?}, in order"));
    }
}

/// `text` with its list of variables (the lines from the first ` * - GPUPOOL_` item through its
/// last continuation line) replaced by `list`.
fn with_list(text: &str, list: &str) -> String {
    let start = text.find(" * - GPUPOOL_").expect("the list of variables is there");
    let mut end = start;
    for line in text[start..].split_inclusive('\n') {
        if !(line.starts_with(" * - ") || line.starts_with(" *   ")) {
            break;
        }
        end += line.len();
    }
    format!("{}{list}{}", &text[..start], &text[end..])
}

#[test]
fn the_overview_lists_every_variable_of_the_options_table() {
    let list = gpupool::config::options_c_comment();
    for opt in &gpupool::config::OPTIONS {
        assert!(list.contains(&format!(" * - {} (", opt.name)), "{} is listed", opt.name);
    }
    // cbindgen.toml's header is a literal string: cbindgen copies the list as it is written.
    assert!(!list.contains("'''"), "the list must not end cbindgen.toml's literal string");
    for file in ["cbindgen.toml", "include/gpupool.h"] {
        let path = Path::new(ROOT).join(file);
        let text = read(&path);
        if std::env::var_os("GPUPOOL_BLESS").is_some() {
            fs::write(&path, with_list(&text, &list)).unwrap();
            continue;
        }
        let held = if file.ends_with(".h") { overview(&text) } else { &text };
        assert!(
            held.contains(&list),
            "{file} must hold the list of variables that gpupool::config::options_c_comment writes from \
             src/config/options.rs; `GPUPOOL_BLESS=1 cargo test --test house header` writes it:\n{list}"
        );
    }
}

#[test]
fn with_list_replaces_the_list_and_nothing_else() {
    let text = "/*\n * Environment:\n * - GPUPOOL_A (x): y\n *   z\n * - GPUPOOL_B (x): y\n */\nrest\n";
    let list = " * - GPUPOOL_C (x): w\n";
    assert_eq!(with_list(text, list), "/*\n * Environment:\n * - GPUPOOL_C (x): w\n */\nrest\n");
}
