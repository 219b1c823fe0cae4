//! `gpupool-replay`: see `gpupool-replay --help` and the crate's documentation.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let status = gpupool_replay::cli::main_with(&args, &mut std::io::stdout().lock(), &mut std::io::stderr().lock());
    std::process::exit(status);
}
