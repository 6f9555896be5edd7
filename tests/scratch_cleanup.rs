//! Issue 39: a test's scratch folder (`common::scratch_dir`) goes away when the test ends,
//! whether it passed or failed, with everything written into it.

mod common;

use std::path::PathBuf;

/// Makes a scratch folder with a file and a sub-folder in it; returns where it was.
fn fill(dir: &common::ScratchDir) -> PathBuf {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("sub").join("f.json"), b"{}").unwrap();
    assert!(dir.join("sub/f.json").is_file());
    dir.to_path_buf()
}

#[test]
fn a_passing_test_leaves_no_scratch_folder() {
    let path = {
        let dir = common::scratch_dir("cleanup-pass");
        fill(&dir)
    };
    assert!(!path.exists(), "{} was left", path.display());
}

#[test]
fn a_failing_test_leaves_no_scratch_folder() {
    let mut made = None;
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let dir = common::scratch_dir("cleanup-fail");
        made = Some(fill(&dir));
        panic!("the test fails with its folder in use");
    }));
    assert!(failed.is_err());
    let path = made.expect("the folder was made before the failure");
    assert!(!path.exists(), "{} was left", path.display());
}

#[test]
fn folders_of_one_name_are_apart_and_named_for_the_process() {
    let (a, b) = (
        common::scratch_dir("cleanup-twice"),
        common::scratch_dir("cleanup-twice"),
    );
    assert_ne!(a.path(), b.path());
    let pid = format!("-{}-", std::process::id());
    for d in [&a, &b] {
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with("wgpar-cleanup-twice") && name.contains(&pid),
            "{name}"
        );
        assert!(d.is_dir() && std::fs::read_dir(d.path()).unwrap().next().is_none());
    }
    drop(a);
    assert!(b.is_dir(), "dropping one folder removed the other");
}
