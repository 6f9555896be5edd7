//! Standard output for every command (through the `out!` and `outln!` macros).

use wgpar::{Result, WgparError};

/// Writes `text` to stdout and flushes it, so that a failed write is seen here, by the command
/// that printed, and not lost in the flush at exit.
pub(crate) fn write_stdout(text: std::fmt::Arguments) -> Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(text)
        .and_then(|()| stdout.flush())
        .map_err(|source| WgparError::Stdout { source })
}
