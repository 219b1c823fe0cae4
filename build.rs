// Gives libgpupool.so a SONAME, so programs linked against it record "libgpupool.so" rather
// than the path they were linked with.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpupool.so");
}
