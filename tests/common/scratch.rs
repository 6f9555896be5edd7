//! Scratch folders that go away with the test that made them (issue 39).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh, empty folder under the system's temporary folder, removed with everything in it
/// when dropped: when the test returns, and while a failing test's panic unwinds, so neither a
/// pass nor a failure leaves it behind. Read it as a [`Path`].
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// `wgpar-NAME-PID-N`: the process id keeps test binaries that run at the same time
    /// apart, the count two folders of one name in one process.
    pub fn new(name: &str) -> Self {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "wgpar-{name}-{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        ));
        // A folder of this name left by an earlier process with the same id is stale.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("scratch folder {}: {e}", dir.display()));
        Self(dir)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Nothing to report from a drop (it may run during a panic); a folder that could not
        // be removed shows up in the temporary folder.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
