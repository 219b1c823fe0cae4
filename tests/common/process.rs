//! Tests that need a process of their own, in a test binary that holds many (one binary a
//! folder of tests/): a test whose figures are the process's (the heap that glibc or a counting
//! global allocator measures), or that sets up the process-wide allocator (which reads
//! `GPUPOOL_*` once), or that forks, would be moved or shared by the other tests of the binary,
//! which run at once in its threads. Such a test runs its body in a child process of the binary,
//! alone there.

use std::process::Command;

/// Set in the child process that [`alone`] starts, to the one test it runs there. Not a
/// `GPUPOOL_*` name: the library warns about unknown ones.
const ALONE: &str = "TEST_ALONE";

/// Runs the calling test again in a child process of this test binary, alone there. True in
/// that child, where the caller goes on with its body; false in the caller's own process, once
/// the child has passed (the caller returns then): the test fails, with the child's output, if
/// the child failed or did not run exactly this test. The child's output is printed, so that
/// the test shows what it printed as before (`--nocapture`, or when it fails).
///
/// libtest names each test's thread after the test's path in the binary (`module::name`),
/// which is what `--exact` selects.
pub fn alone() -> bool {
    let thread = std::thread::current();
    let name = thread.name().filter(|n| *n != "main").expect("libtest runs each test on a thread named after it");
    if std::env::var_os(ALONE).is_some_and(|v| v == name) {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env(ALONE, name)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed;"),
        "{name} failed in its own process ({}): its output is above",
        out.status
    );
    false
}

/// The path by which `--exact` selects the test `name` of the module `module` (its
/// `module_path!()`, which starts with the binary's name where libtest's paths do not), for a
/// test that runs another test of its binary in a child process.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_binary, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    }
}

/// [`alone`], the child's process-wide allocator then pointed at the simulated device of
/// `capacity` (a `GPUPOOL_SIM_CAPACITY` value) before it starts: true in that child, false in
/// the caller's process (which returns). The set-up the C API tests of several folders share.
pub fn alone_on_sim(capacity: &str) -> bool {
    if !alone() {
        return false;
    }
    // SAFETY: the child runs this one test, which sets the environment before the process
    // allocator starts and before any other thread reads it.
    unsafe {
        std::env::set_var("GPUPOOL_DRIVER", "sim");
        std::env::set_var("GPUPOOL_SIM_CAPACITY", capacity);
    }
    true
}
