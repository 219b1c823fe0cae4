//! Unknown `GPUPOOL_*` environment variables: a misspelled one (`GPUPOOL_CNF=...`) would
//! otherwise be ignored without a word, and the program would run on the defaults. When the
//! configuration is read from the environment ([`Config::from_env`](super::Config::from_env)),
//! every variable whose name starts with `GPUPOOL_` and that is neither a row of
//! [`OPTIONS`], nor `GPUPOOL_CONF`, nor one of [`READ_ELSEWHERE`] gets one line on stderr,
//! naming it and the known name it probably meant when one is close. Once per process, however
//! often the environment is read. Only a warning: nothing else changes, and the variable stays
//! ignored.

use std::ffi::OsStr;
use std::io::Write;
use std::sync::Once;

use super::CONF_VAR;
use super::options::OPTIONS;

/// `GPUPOOL_*` environment variables that other parts of the project read, not the library:
/// a user may have set them, so they get no warning. Each with who reads it.
/// docs/configuration.md lists them too (a unit test checks). CMake's `GPUPOOL_*` variables
/// (`-DGPUPOOL_BUILD_TESTS=OFF`, `-DGPUPOOL_TEST_DRIVER=cuda`...) are not environment
/// variables and are not listed.
pub(super) const READ_ELSEWHERE: [(&str, &str); 15] = [
    ("GPUPOOL_LIB", "the Python glue (`examples/python/gpupool_torch.py`): the libgpupool.so to load"),
    ("GPUPOOL_FUZZ_CASES", "the C API fuzz test (`tests/capi/fuzz.rs`): cases per property"),
    ("GPUPOOL_SOAK_OPS", "the C soak test (`tests/c/test_soak.c`): operations, all threads together"),
    ("GPUPOOL_SOAK_THREADS", "the C soak test: worker threads"),
    ("GPUPOOL_SOAK_SEED", "the C soak test: the seed of its random operations"),
    ("GPUPOOL_SLEEP_BENCH_GIB", "the GPU sleep test (`tests/gpu/test_sleep.cu`): the sizes of its benchmark"),
    ("GPUPOOL_FIRST_SLEEP_GIB", "the GPU first-sleep test (`tests/gpu/test_first_sleep.cu`): the pool sizes"),
    ("GPUPOOL_PEERS_GIB", "the GPU peer test (`tests/gpu/test_peers.cu`): the pool size whose mapping is timed"),
    ("GPUPOOL_SLEEP_ALL_GIB", "the GPU all-devices sleep test (`tests/gpu/test_sleep_all.cu`): each pool's size"),
    ("GPUPOOL_SLEEP_ALL_DEVICES", "the GPU all-devices sleep test: how many devices at most"),
    ("GPUPOOL_IPC_CYCLES", "the C IPC test (`tests/c/test_ipc.c`): export, import and close cycles"),
    ("GPUPOOL_DEVICE_PAIR_BUDGET", "the hit-path budget (`tests/c/hit_budget.sh`): instructions per device pair"),
    ("GPUPOOL_HOST_PAIR_BUDGET", "the hit-path budget: instructions per pinned-host pair"),
    ("GPUPOOL_TEST_INSTALLED", "the Python package's tests (`tests/python/package`): test the installed package"),
    ("GPUPOOL_TORCH_MEMORY_VIZ", "the Python metadata test (`test_snapshot_metadata.py`): PyTorch's _memory_viz.py"),
];

/// The prefix of the variables checked.
const PREFIX: &str = "GPUPOOL_";

/// Every `GPUPOOL_*` name known: the library's options, then those read elsewhere.
fn known() -> impl Iterator<Item = &'static str> {
    OPTIONS.iter().map(|o| o.name).chain([CONF_VAR]).chain(READ_ELSEWHERE.iter().map(|(name, _)| *name))
}

/// The warnings for the environment variables `names` (the names only; values are never
/// looked at), one line each, without its newline, in the order given: each name that starts
/// with `GPUPOOL_` and is not known, once, with the known name it probably meant when one is
/// close. Empty when there is nothing to say. A name that is not valid UTF-8 is shown lossily.
pub(super) fn unknown_variable_warnings<I>(names: I) -> Vec<String>
where
    I: IntoIterator,
    I::Item: AsRef<OsStr>,
{
    let mut out: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for name in names {
        let name = name.as_ref().to_string_lossy();
        if !name.starts_with(PREFIX) || known().any(|k| k == name) || seen.iter().any(|s| *s == name) {
            continue;
        }
        let hint = closest(&name).map_or(String::new(), |k| format!(" (did you mean {k}?)"));
        out.push(format!("gpupool: warning: unknown environment variable {name} is ignored{hint}"));
        seen.push(name.into_owned());
    }
    out
}

/// The known name closest to `name` (which starts with `GPUPOOL_`), case aside: the fewest
/// edits (a character inserted, deleted, replaced, or two swapped) after the prefix, at most a
/// third of the known name's length after the prefix (at least one); the first in [`known`]
/// order on a tie.
fn closest(name: &str) -> Option<&'static str> {
    let rest: Vec<char> = name[PREFIX.len()..].to_ascii_uppercase().chars().collect();
    known()
        .map(|k| {
            let tail: Vec<char> = k[PREFIX.len()..].chars().collect();
            (edits(&rest, &tail), tail.len(), k)
        })
        .filter(|&(d, len, _)| d <= (len / 3).max(1))
        .min_by_key(|&(d, _, _)| d)
        .map(|(_, _, k)| k)
}

/// The optimal string alignment distance between `a` and `b`: Levenshtein's edits, plus the
/// swap of two neighbours as one edit (the commonest typing slip).
fn edits(a: &[char], b: &[char]) -> usize {
    // Three rows of the usual table: two back (for swaps), one back, this one.
    let mut back2: Vec<usize> = vec![0; b.len() + 1];
    let mut back1: Vec<usize> = (0..=b.len()).collect();
    let mut row: Vec<usize> = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        row[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            row[j] = (back1[j] + 1).min(row[j - 1] + 1).min(back1[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                row[j] = row[j].min(back2[j - 2] + 1);
            }
        }
        std::mem::swap(&mut back2, &mut back1);
        std::mem::swap(&mut back1, &mut row);
    }
    back1[b.len()]
}

/// Writes the warnings for the process's environment to stderr, the first time only: the
/// environment is read once per process in practice, and a warning repeated at each read
/// would be noise.
pub(super) fn warn_unknown_variables_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let lines = unknown_variable_warnings(std::env::vars_os().map(|(name, _)| name));
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        if !text.is_empty() {
            // Not eprintln!, which panics when stderr is closed.
            let _ = std::io::stderr().lock().write_all(text.as_bytes());
        }
    });
}
