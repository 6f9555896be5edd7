//! The `wgpar` command line.

mod cli;

fn main() {
    if let Err(e) = cli::main() {
        // Not `eprintln!`, which panics where stderr is closed too.
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "error: {e}");
        std::process::exit(e.exit_code());
    }
}
