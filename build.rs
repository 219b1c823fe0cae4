// Gives libgpupool.so a SONAME, so programs linked against it record "libgpupool.so" rather
// than the path they were linked with; and compiles src/callout.c (see src/callout.rs), where
// glibc ends threads with a forced unwind that it must stop.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpupool.so");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/callout.c");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        // -fexceptions: a foreign exception passing the callout's frame runs its cleanup.
        cc::Build::new().file("src/callout.c").flag("-fexceptions").warnings(true).compile("gpupool_callout");
    }
}
