//! The shape of the repository, held by tests: every relative link of README.md and docs/
//! resolves (file and heading), the README stays short and links every page of the manual, no
//! file of code written by hand (any language) passes 450 lines, and no two source files import each
//! other, directly or through others; every Rust test is a module of its folder's test binary.
//! `layout.rs`: every folder's `//!` overview names each of its modules, the lower folders (`os`,
//! `stats`, `driver`, the sleep copy engine) import nothing from the core, and no file name
//! repeats across the core's `allocator/`, `device/` and `shard/`. `header.rs`: the C header
//! reads as a manual.
//! Reads files only; needs no device.
mod header;
mod layout;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const README_MAX_LINES: usize = 300;
const SOURCE_MAX_LINES: usize = 450;
const SOURCE_ROOTS: [&str; 3] = ["src", "preload/src", "replay/src"];

fn root() -> &'static Path {
    Path::new(ROOT)
}

fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The text of a markdown file with fenced code blocks and inline code blanked out, so that
/// code that looks like a link (`a[i](x)`) is not taken for one.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
            continue;
        }
        if fenced || line.starts_with("    ") {
            out.push('\n');
            continue;
        }
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            }
            out.push(if in_code || c == '`' { ' ' } else { c });
        }
        out.push('\n');
    }
    out
}

/// Every `[text](target)` target of a markdown text.
fn links(text: &str) -> Vec<String> {
    let text = prose(text);
    let mut found = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        if let Some(end) = after.find(')') {
            found.push(after[..end].trim().to_string());
        }
        rest = after;
    }
    found
}

/// GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped,
/// spaces as '-'; a repeated heading gets "-1", "-2", ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 { slug.clone() } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = fs::read_to_string(&file).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") || link.is_empty() {
                continue;
            }
            checked += 1;
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() { file.clone() } else { file.parent().unwrap().join(path) };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", file.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && !anchors(&fs::read_to_string(&target).unwrap_or_default()).contains(anchor)
            {
                broken.push(format!("{}: {link}: no heading #{anchor} in {}", file.display(), target.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 20, "only {checked} relative links found: is the link reader broken?");
}

#[test]
fn link_reader_finds_links_and_anchors_and_skips_code() {
    let text = "# Top `x`\nsee [a](b.md#top-x) and `[no](code.md)`\n```\n[no](fence.md)\n```\n## Top x\n";
    assert_eq!(links(text), vec!["b.md#top-x".to_string()]);
    let a = anchors(text);
    assert!(a.contains("top-x") && a.contains("top-x-1"), "{a:?}");
    assert!(anchors("## Under PyTorch and under LD_PRELOAD\n").contains("under-pytorch-and-under-ld_preload"));
}

#[test]
fn the_readme_is_short_and_links_every_page_of_the_manual() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines <= README_MAX_LINES, "README.md has {lines} lines, at most {README_MAX_LINES}");
    let linked: BTreeSet<String> =
        links(&readme).into_iter().map(|l| l.split('#').next().unwrap().to_string()).collect();
    for page in markdown_files().into_iter().skip(1) {
        let name = format!("docs/{}", page.file_name().unwrap().to_string_lossy());
        assert!(linked.contains(&name), "README.md does not link {name}");
        let text = fs::read_to_string(&page).unwrap();
        let first = text.lines().next().unwrap_or("");
        assert!(first.starts_with("# "), "{name} starts with a title, not {first:?}");
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The folders of hand-written code, in every language, for the 450-line rule: the sources,
/// the tests (C, CUDA, Python and shell included), the examples, the benches, the scripts, the
/// Python package and the C and C++ headers written by hand.
const SHORT_FILE_ROOTS: [&str; 10] = [
    "src",
    "preload",
    "replay/src",
    "replay/tests",
    "replay/examples",
    "tests",
    "examples",
    "benches",
    "scripts",
    "python",
];
/// What counts as code: by extension, and CMake's files by name.
const CODE_EXTENSIONS: [&str; 11] = ["rs", "c", "h", "cpp", "hpp", "cu", "cuh", "py", "sh", "cmake", "toml"];
/// cbindgen writes these from src/ffi (.ci/run): generated, read as the manual, not split.
const GENERATED: [&str; 5] = [
    "include/gpupool.h",
    "include/gpupool_testing.h",
    "include/gpupool_torch.h",
    "include/gpupool_plugins.h",
    "include/gpupool_ipc.h",
];

fn code_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            // Build output and Python's caches are not written by hand.
            if !matches!(&*name, "target" | "__pycache__") && !name.starts_with("build") {
                code_files(&path, out);
            }
        } else if name == "CMakeLists.txt" || path.extension().is_some_and(|e| CODE_EXTENSIONS.iter().any(|c| e == *c))
        {
            out.push(path);
        }
    }
}

/// Small files with one purpose: no file of code written by hand, in any language (the Rust
/// sources and tests, the C, C++ and CUDA tests and examples, the scripts, the Python package,
/// the hand-written headers of include/), is over 450 lines; a longer one is split by what it
/// is about. The headers cbindgen generates are the exception.
#[test]
fn no_source_file_is_over_450_lines() {
    let mut files = Vec::new();
    for dir in SHORT_FILE_ROOTS {
        code_files(&root().join(dir), &mut files);
    }
    code_files(&root().join("include"), &mut files);
    let mut long = Vec::new();
    let mut rust = 0;
    for f in &files {
        let rel = f.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        if GENERATED.contains(&rel.as_str()) {
            continue;
        }
        rust += usize::from(f.extension().is_some_and(|e| e == "rs"));
        let n = fs::read_to_string(f).unwrap().lines().count();
        if n > SOURCE_MAX_LINES {
            long.push(format!("{rel}: {n} lines"));
        }
    }
    assert!(rust > 100 && files.len() > rust, "the walk found {} files, {rust} of Rust", files.len());
    assert!(
        long.is_empty(),
        "over {SOURCE_MAX_LINES} lines (split each into files of one purpose):\n{}",
        long.join("\n")
    );
}

/// Each Rust test binary is a folder of tests/, `tests/NAME/main.rs` with a module per file, so
/// that the workspace links a handful of them (issue 38): a file put in tests/ itself would be a
/// binary of its own, linked on its own, and a file in a folder whose `main.rs` does not declare
/// it would never be compiled, its tests gone without a word.
#[test]
fn every_rust_test_is_a_module_of_a_folders_binary() {
    let mut wrong = Vec::new();
    let mut modules = 0;
    for entry in fs::read_dir(root().join("tests")).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        if dir.extension().is_some_and(|e| e == "rs") {
            wrong.push(format!("tests/{name}: a test binary of its own; move it into its feature's folder"));
        }
        let Ok(main) = fs::read_to_string(dir.join("main.rs")) else {
            continue;
        };
        let declared: BTreeSet<&str> =
            main.lines().filter_map(|l| l.trim().strip_prefix("mod ")?.strip_suffix(';')).collect();
        for file in fs::read_dir(&dir).unwrap() {
            let file = file.unwrap().path();
            let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
            if file.extension().is_none_or(|e| e != "rs") || stem == "main" {
                continue;
            }
            modules += 1;
            if !declared.contains(stem.as_str()) {
                wrong.push(format!("tests/{name}/{stem}.rs: not declared in tests/{name}/main.rs (mod {stem};)"));
            }
        }
    }
    assert!(modules > 0, "no test modules found under tests/");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A module's path within its crate, from its file: `src/caching/peaks.rs` is
/// `caching::peaks`, `src/caching/shard/mod.rs` is `caching::shard`, `src/lib.rs` is the root.
fn module_path(crate_root: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(crate_root).unwrap();
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// The paths a file names through `crate::`, `super::` and `self::`, in `use` lists (braces
/// expanded) and in code, comments left out; each as the module path it starts from plus the
/// names after it.
fn named_paths(text: &str) -> Vec<(String, Vec<String>)> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join("\n");
    let mut out = Vec::new();
    // Expands `a::{b, c::{d}}` into `a::b`, `a::c::d`.
    fn expand(prefix: &str, s: &str, out: &mut Vec<String>) {
        let s = s.trim();
        if let Some(open) = s.find('{') {
            let head = format!("{prefix}{}", &s[..open]);
            let inner = &s[open + 1..s.rfind('}').unwrap_or(s.len())];
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&head, &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            expand(&head, &inner[start..], out);
        } else if !s.is_empty() {
            out.push(format!("{prefix}{s}"));
        }
    }
    let mut flat = Vec::new();
    for stmt in code.split(';') {
        let t = stmt.trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        if let Some(u) = t.strip_prefix("use ") {
            expand("", u, &mut flat);
        }
    }
    // Paths written in code: `super::peaks::settle(...)`, `crate::stats::Stat`.
    let bytes = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let end = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| at + e);
            flat.push(code[at..end].to_string());
        }
    }
    for p in flat {
        let p = p.split(" as ").next().unwrap().trim().to_string();
        let mut parts = p.split("::").map(str::trim).filter(|s| !s.is_empty()).map(str::to_string);
        if let Some(first) = parts.next()
            && matches!(first.as_str(), "crate" | "super" | "self")
        {
            out.push((first, parts.collect()));
        }
    }
    out
}

#[test]
fn no_two_source_files_import_each_other() {
    let mut circles = Vec::new();
    for dir in SOURCE_ROOTS {
        let crate_root = root().join(dir);
        let mut files = Vec::new();
        rust_files(&crate_root, &mut files);
        let modules: BTreeMap<Vec<String>, PathBuf> =
            files.iter().map(|f| (module_path(&crate_root, f), f.clone())).collect();
        // Edges between leaf files (not mod.rs, lib.rs, main.rs): a parent module and its
        // children naming each other is how Rust modules are built, not a circle.
        let is_leaf = |f: &Path| !matches!(f.file_name().unwrap().to_str().unwrap(), "mod.rs" | "lib.rs" | "main.rs");
        let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
        for f in files.iter().filter(|f| is_leaf(f)) {
            let here = module_path(&crate_root, f);
            for (start, rest) in named_paths(&fs::read_to_string(f).unwrap()) {
                let mut path = match start.as_str() {
                    "crate" => Vec::new(),
                    "self" => here.clone(),
                    _ => here[..here.len().saturating_sub(1)].to_vec(),
                };
                let mut rest = rest.into_iter().peekable();
                while rest.peek().is_some_and(|s| s == "super") {
                    rest.next();
                    path.pop();
                }
                path.extend(rest);
                // The longest prefix that is a module file.
                let target = (0..=path.len()).rev().find_map(|n| modules.get(&path[..n]));
                if let Some(t) = target
                    && t != f
                    && is_leaf(t)
                {
                    edges.entry(f.clone()).or_default().insert(t.clone());
                }
            }
        }
        // A file that reaches itself through the edges is on a circle.
        for start in edges.keys() {
            let mut stack = vec![(start.clone(), vec![start.clone()])];
            let mut seen = BTreeSet::new();
            while let Some((node, trail)) = stack.pop() {
                for next in edges.get(&node).into_iter().flatten() {
                    if next == start {
                        let names: Vec<String> = trail
                            .iter()
                            .chain([start])
                            .map(|p| p.strip_prefix(root()).unwrap().display().to_string())
                            .collect();
                        circles.push(names.join(" -> "));
                    } else if seen.insert(next.clone()) {
                        let mut t = trail.clone();
                        t.push(next.clone());
                        stack.push((next.clone(), t));
                    }
                }
            }
        }
    }
    circles.sort();
    circles.dedup();
    assert!(circles.is_empty(), "import circles:\n{}", circles.join("\n"));
}

#[test]
fn the_circle_finder_reads_use_lists_and_paths_in_code() {
    let text = "use super::{peaks::Totals, rules::{PoolKind, X}};\n// use super::ignored::Y;\nfn f() { crate::stats::Stat::new(); }\n";
    let got: Vec<String> = named_paths(text).into_iter().map(|(s, r)| format!("{s}::{}", r.join("::"))).collect();
    for want in ["super::peaks::Totals", "super::rules::PoolKind", "super::rules::X", "crate::stats::Stat::new"] {
        assert!(got.contains(&want.to_string()), "{want} not in {got:?}");
    }
    assert!(!got.iter().any(|g| g.contains("ignored")), "{got:?}");
}
