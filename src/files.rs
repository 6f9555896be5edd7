//! Reading files a user names (a checkpoint's config.json, a trace, a host profile): bounded,
//! so that a symlink to `/dev/zero`, a FIFO or a multi-gigabyte file is refused in
//! milliseconds instead of being read until memory runs out.
//!
//! Refusals are [`std::io::Error`]s, so every caller keeps its own `Io` variant and its file
//! name; the kind says which (`FileTooLarge`, `InvalidInput` for a file that is not a regular
//! file) and the inner error is a [`Refused`] with the numbers.

use std::io::Read;
use std::path::Path;

use crate::error::human_bytes;

/// Largest JSON config (config.json, modules.json, a safetensors index) read.
pub const CONFIG_LIMIT: u64 = 64 << 20;
/// Largest tokenizer.json read (the largest published ones are tens of MB).
pub const TOKENIZER_LIMIT: u64 = 512 << 20;
/// Largest trace read (`project --trace`): a long run's timeline is tens of MB.
pub const TRACE_LIMIT: u64 = 1 << 30;
/// Largest host profile or engine description (TOML) read.
pub const PROFILE_LIMIT: u64 = 16 << 20;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Larger than the limit for its kind.
    #[error("{} ({size} B), more than the {} this kind of file may be", human_bytes(*size), human_bytes(*limit))]
    TooLarge {
        /// Its size (or the bytes read before the limit was passed).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A device, FIFO, socket or folder: nothing wgpar reads.
    #[error("not a regular file (a device, FIFO, socket or folder)")]
    NotAFile,
}

impl From<Refused> for std::io::Error {
    fn from(r: Refused) -> Self {
        let kind = match r {
            Refused::TooLarge { .. } => std::io::ErrorKind::FileTooLarge,
            Refused::NotAFile => std::io::ErrorKind::InvalidInput,
        };
        std::io::Error::new(kind, r)
    }
}

/// The text of `path` (symlinks followed), refused if it is not a regular file or is larger
/// than `limit` bytes. A missing file is the usual `NotFound`.
pub fn read_text(path: &Path, limit: u64) -> std::io::Result<String> {
    // Checked before opening: opening a FIFO blocks until a writer comes.
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Refused::NotAFile.into());
    }
    if meta.len() > limit {
        return Err(Refused::TooLarge {
            size: meta.len(),
            limit,
        }
        .into());
    }
    let mut text = String::new();
    // A file that grows while being read stops at the limit.
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(Refused::TooLarge {
            size: text.len() as u64,
            limit,
        }
        .into());
    }
    Ok(text)
}

/// Checks, before the work whose results go there, that files can be written in folder `dir`
/// (created if missing): a probe file is made and removed.
pub fn check_writable_dir(dir: &Path, shown: &Path) -> crate::error::Result<()> {
    let io = |source| crate::error::WgparError::Io {
        path: shown.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let probe = dir.join(format!(".wgpar-write-check-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(io)?;
    std::fs::remove_file(&probe).map_err(io)
}

/// Creates (or truncates) the trace file `path` names, if any, so that a path that cannot be
/// written fails before the work rather than after it.
pub fn create_trace_file(path: Option<&String>) -> crate::error::Result<()> {
    if let Some(path) = path {
        std::fs::File::create(path).map_err(|source| crate::error::WgparError::Io {
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Checks, before the work, that file `path` can be written: its folder takes a file, and an
/// existing `path` opens for writing. Nothing is truncated or left behind.
pub fn check_writable_file(path: &Path) -> crate::error::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    check_writable_dir(dir, path)?;
    if path.exists() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|source| crate::error::WgparError::Io {
                path: path.display().to_string(),
                source,
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_folders_and_large_files() {
        let e = read_text(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        let e = read_text(Path::new("."), 1 << 20).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        let dir = std::env::temp_dir().join(format!("wgpar-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("big.json");
        std::fs::write(&file, "x".repeat(100)).unwrap();
        let e = read_text(&file, 99).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge);
        assert!(e.to_string().contains("100 B"), "{e}");
        assert_eq!(read_text(&file, 100).unwrap().len(), 100);
        let e = read_text(&dir.join("missing"), 100).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
