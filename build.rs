// Gives libgpupool.so a SONAME, so programs linked against it record "libgpupool.so" rather
// than the path they were linked with.
fn main() {
    // Without a rerun-if-changed line, cargo runs this script again, and so compiles the library
    // again, whenever any file of the package changes: a test, a page of docs/. The script reads
    // nothing but itself.
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpupool.so");
}
