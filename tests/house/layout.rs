//! The folders' shape (issue 38): every folder's overview names each of its modules, the lower
//! folders (`os`, `stats`, `driver`, the sleep copy engine) import nothing from the core, and no
//! file name repeats across the core's layers (`allocator/`, `device/`, `shard/`).
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use super::{SOURCE_ROOTS, module_path, named_paths, root, rust_files};

fn shown(path: &Path) -> String {
    path.strip_prefix(root()).unwrap_or(path).display().to_string()
}

/// The `//!` lines a file opens with, as one text.
fn overview(text: &str) -> String {
    let lines = text.lines().map(str::trim_start).take_while(|l| l.starts_with("//!") || l.is_empty());
    lines.filter_map(|l| l.strip_prefix("//!")).collect::<Vec<_>>().join("\n")
}

/// Whether an overview names a module: `NAME`, `NAME.rs` or `NAME/`, in backticks.
fn names_module(overview: &str, name: &str) -> bool {
    ["`", ".rs`", "/`"].iter().any(|end| overview.contains(&format!("`{name}{end}")))
}

/// Every folder of a crate's source, the crate's root first.
fn folders(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    let mut subs: Vec<PathBuf> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    subs.sort();
    for sub in subs {
        folders(&sub, out);
    }
}

/// A folder's top file and its child modules: each `NAME.rs` but the top files, each
/// sub-folder. The top file is `mod.rs`, or the folder's `NAME.rs` sibling where it has none,
/// or `lib.rs` (else `main.rs`) at the crate's root.
fn folder_modules(crate_root: &Path, dir: &Path) -> (PathBuf, BTreeSet<String>) {
    let top = if dir == crate_root {
        let lib = dir.join("lib.rs");
        if lib.exists() { lib } else { dir.join("main.rs") }
    } else if dir.join("mod.rs").exists() {
        dir.join("mod.rs")
    } else {
        dir.with_extension("rs")
    };
    let mut children = BTreeSet::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            children.insert(name);
        } else if let Some(stem) = name.strip_suffix(".rs")
            && !matches!(stem, "mod" | "lib" | "main")
        {
            children.insert(stem.to_string());
        }
    }
    (top, children)
}

#[test]
fn every_folders_overview_lists_every_module() {
    let mut misses = Vec::new();
    let mut checked = 0;
    for dir in SOURCE_ROOTS {
        let crate_root = root().join(dir);
        let mut dirs = Vec::new();
        folders(&crate_root, &mut dirs);
        for folder in dirs {
            let (top, children) = folder_modules(&crate_root, &folder);
            let Ok(text) = fs::read_to_string(&top) else {
                misses.push(format!("{}: no mod.rs, nor a {} beside it", shown(&folder), shown(&top)));
                continue;
            };
            let overview = overview(&text);
            if overview.trim().is_empty() {
                misses.push(format!("{}: no //! overview", shown(&top)));
                continue;
            }
            checked += children.len();
            let missing: Vec<&str> =
                children.iter().map(String::as_str).filter(|c| !names_module(&overview, c)).collect();
            if !missing.is_empty() {
                misses.push(format!("{}: overview does not name {}", shown(&top), missing.join(", ")));
            }
        }
    }
    assert!(checked > 50, "only {checked} modules found: is the folder reader broken?");
    assert!(misses.is_empty(), "folder overviews missing modules:\n{}", misses.join("\n"));
}

#[test]
fn the_overview_reader_takes_the_opening_doc_and_names_in_backticks() {
    let text = "//! Holds `alpha`, `beta.rs`,\n//! [`gamma`] and `delta/`.\n\nmod x;\n//! `late`\n";
    let o = overview(text);
    for name in ["alpha", "beta", "gamma", "delta"] {
        assert!(names_module(&o, name), "{name} not found in {o:?}");
    }
    assert!(!names_module(&o, "late") && !names_module(&o, "alph") && !names_module(&o, "x"), "{o:?}");
}

/// A file's code cut where its inline modules (`mod tests { ... }`) open and close, each piece
/// with the path of the inline module it is in, below the file's own; comments left out.
/// `None` where the braces do not balance.
fn inline_pieces(text: &str) -> Option<Vec<(Vec<String>, String)>> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join("\n");
    let bytes = code.as_bytes();
    let mut pieces = Vec::new();
    let mut stack: Vec<(String, usize)> = Vec::new();
    let names = |stack: &[(String, usize)]| stack.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    let (mut depth, mut start, mut i) = (0usize, 0, 0);
    while i < bytes.len() {
        match bytes[i] {
            // A brace as a character ('{'), not a block.
            b'\'' if bytes.get(i + 2) == Some(&b'\'') => i += 2,
            b'{' => {
                depth += 1;
                let before = code[..i].trim_end();
                let at = before.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |j| j + 1);
                let head = before[..at].trim_end();
                let is_mod = head
                    .strip_suffix("mod")
                    .is_some_and(|h| h.chars().last().is_none_or(|c| !(c.is_alphanumeric() || c == '_')));
                if is_mod && at < before.len() {
                    pieces.push((names(&stack), code[start..i].to_string()));
                    stack.push((before[at..].to_string(), depth));
                    start = i + 1;
                }
            }
            b'}' => {
                if stack.last().is_some_and(|(_, d)| *d == depth) {
                    pieces.push((names(&stack), code[start..i].to_string()));
                    stack.pop();
                    start = i + 1;
                }
                depth = depth.checked_sub(1)?;
            }
            _ => {}
        }
        i += 1;
    }
    pieces.push((names(&stack), code[start..].to_string()));
    (depth == 0 && stack.is_empty()).then_some(pieces)
}

/// The crate paths a file names (through `crate::`, `super::`, `self::`, inline modules
/// followed) that start with none of `allowed`, each as "file: names PATH"; `here` is the
/// file's module path.
fn foreign_names(file: &str, here: &[String], text: &str, allowed: &[Vec<String>]) -> Vec<String> {
    let Some(pieces) = inline_pieces(text) else {
        return vec![format!("{file}: its braces do not balance; the checker cannot follow its modules")];
    };
    let mut found = Vec::new();
    for (inner, code) in pieces {
        let module: Vec<String> = here.iter().cloned().chain(inner).collect();
        for (start, rest) in named_paths(&code) {
            // `super::{a, b}` read as code names nothing by itself: its use list names `a`, `b`.
            if rest.is_empty() {
                continue;
            }
            let mut path = match start.as_str() {
                "crate" => Vec::new(),
                "self" => module.clone(),
                _ => module[..module.len().saturating_sub(1)].to_vec(),
            };
            for part in rest {
                match part.as_str() {
                    "super" => drop(path.pop()),
                    "self" => {}
                    _ => path.push(part),
                }
            }
            let line = format!("{file}: names crate::{}", path.join("::"));
            if !allowed.iter().any(|a| path.starts_with(a)) && !found.contains(&line) {
                found.push(line);
            }
        }
    }
    found
}

fn module(path: &str) -> Vec<String> {
    path.split("::").map(str::to_string).collect()
}

/// The lower folders and what each may name: the OS calls, the statistics' types and the
/// drivers are what the core is built on, and the sleep copy engine moves bytes for it, so none
/// of them reaches up into the allocator.
fn lower_folders() -> Vec<(Vec<PathBuf>, Vec<Vec<String>>)> {
    let src = root().join("src");
    let tree = |dir: &str| {
        let mut files = Vec::new();
        rust_files(&src.join(dir), &mut files);
        files
    };
    let engine = ["copy", "copy_direct", "staging", "copy_threads", "pinned_copies"];
    let mut engine_allowed = vec![module("driver"), module("config")];
    engine_allowed.extend(engine.iter().map(|m| module(&format!("caching::sleep::{m}"))));
    vec![
        (tree("os"), vec![module("os")]),
        (tree("stats"), vec![module("stats")]),
        (tree("driver"), ["driver", "os", "config", "error"].map(module).to_vec()),
        (engine.iter().map(|m| src.join(format!("caching/sleep/{m}.rs"))).collect(), engine_allowed),
    ]
}

#[test]
fn lower_folders_import_nothing_from_the_core() {
    let src = root().join("src");
    let mut found = Vec::new();
    let mut files = 0;
    for (paths, allowed) in lower_folders() {
        for f in paths {
            files += 1;
            let text = fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", shown(&f)));
            found.extend(foreign_names(&shown(&f), &module_path(&src, &f), &text, &allowed));
        }
    }
    assert!(files > 20, "only {files} files checked: is the folder list stale?");
    assert!(found.is_empty(), "lower folders naming what they may not:\n{}", found.join("\n"));
}

#[test]
fn the_import_checker_follows_inline_modules_and_catches_the_core() {
    let here = module("caching::sleep::copy_threads");
    let allowed = vec![module("driver"), module("caching::sleep::copy_threads")];
    let clean = "use crate::driver::{Driver, HostPtr};\nfn f() { let c = '{'; }\n#[cfg(test)]\nmod tests {\n    use super::*;\n    fn g() { self::h(); }\n}\n";
    assert_eq!(foreign_names("x.rs", &here, clean, &allowed), Vec::<String>::new());
    let bad = "use super::{staging::Ring, sleepers::Sleepers};\nmod tests {\n    use super::super::device::X;\n}\nfn f() { crate::Allocator::new(); }\n";
    let got = foreign_names("x.rs", &here, bad, &allowed);
    let want = [
        "x.rs: names crate::caching::sleep::staging::Ring",
        "x.rs: names crate::caching::sleep::sleepers::Sleepers",
        "x.rs: names crate::caching::sleep::device::X",
        "x.rs: names crate::Allocator::new",
    ];
    assert_eq!(got, want.map(str::to_string).to_vec());
    assert!(foreign_names("x.rs", &here, "mod t { }\n}", &allowed)[0].contains("do not balance"));
}

#[test]
fn no_file_name_repeats_across_the_cores_layers() {
    let mut homes: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for layer in ["allocator", "device", "shard"] {
        let mut files = Vec::new();
        rust_files(&root().join("src/caching").join(layer), &mut files);
        for f in files {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            if name != "mod.rs" {
                homes.entry(name).or_default().insert(layer);
            }
        }
    }
    assert!(homes.len() > 10, "only {} file names found under the core's layers", homes.len());
    let repeats: Vec<String> = homes
        .iter()
        .filter(|(_, layers)| layers.len() > 1)
        .map(|(name, layers)| format!("{name} in {}", layers.iter().copied().collect::<Vec<_>>().join(", ")))
        .collect();
    assert!(
        repeats.is_empty(),
        "file names repeated across src/caching/{{allocator,device,shard}}:\n{}",
        repeats.join("\n")
    );
}
