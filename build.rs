// Gives libgpupool.so a SONAME, so programs linked against it record "libgpupool.so" rather
// than the path they were linked with; and compiles src/callout.c (see src/callout.rs), which
// stops a thread's end (glibc's forced unwind) on its way out of a callback.
fn main() {
    // Without a rerun-if-changed line, cargo runs this script again, and so compiles the library
    // again, whenever any file of the package changes: a test, a page of docs/. The script reads
    // nothing but itself and the C file it compiles.
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/callout.c");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpupool.so");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        // -fexceptions: a foreign exception passing the callout's frame runs its cleanup.
        cc::Build::new().file("src/callout.c").flag("-fexceptions").warnings(true).compile("gpupool_callout");
    }
}
