//! The `wgpar` command line.

mod cli;

fn main() {
    if let Err(e) = cli::main() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
