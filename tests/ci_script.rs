//! The CI script (issue 16 items 14 and 15): it names no package-mirror host of its own (it
//! uses only what apt is configured with, deb822 sources included) and checks formatting and
//! lints as well as running the tests.

fn script() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/run")).unwrap()
}

#[test]
fn ci_names_no_mirror_url() {
    let text = script();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        // A host after the scheme is a literal URL; a pattern such as `https?://.*` is not.
        let literal = line
            .match_indices("://")
            .any(|(i, _)| line[i + 3..].starts_with(|c: char| c.is_ascii_alphanumeric()));
        assert!(!literal, "a URL literal in .ci/run: {line}");
    }
    assert!(text.contains("URIs:"), "deb822 sources are not read");
}

#[test]
fn ci_checks_format_and_lints() {
    let text = script();
    for needed in [
        "cargo fmt --check",
        "cargo clippy --all-targets -- -D warnings",
        "rustup component add",
        "cargo test --release -- --test-threads=1",
    ] {
        assert!(text.contains(needed), "{needed} missing from .ci/run");
    }
}

/// Debian package names in `apt-get install` commands of `text` (options and `...` dropped),
/// and in bash arrays named `packages=(...)`.
fn apt_packages(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for line in text.lines() {
        let tail = if let Some(i) = line.find("apt-get install") {
            &line[i + "apt-get install".len()..]
        } else if let Some(i) = line.find("packages=(") {
            &line[i + "packages=(".len()..]
        } else {
            continue;
        };
        // An inline command in markdown ends at its closing backtick.
        let tail = tail.split('`').next().unwrap_or("");
        let mut words = tail
            .split(|c: char| c.is_whitespace() || "()".contains(c))
            .filter(|w| !w.is_empty());
        while let Some(w) = words.next() {
            match w {
                // The suite's name after -t, options, and the end of the command.
                "-t" => {
                    words.next();
                }
                _ if w.starts_with('-') => {}
                _ if w.starts_with(['"', '#', '>', '&', ';']) || w == "..." => break,
                _ => {
                    names.insert(w.to_string());
                }
            }
        }
    }
    names
}

/// Issue 39: the README's prerequisites and `.ci/run` install the same packages (the MPI feature's
/// are listed in docs/MULTINODE.md), so the suite passes on what a newcomer installs.
#[test]
fn readme_and_ci_install_the_same_packages() {
    let root = env!("CARGO_MANIFEST_DIR");
    let read = |p: &str| std::fs::read_to_string(format!("{root}/{p}")).unwrap();
    let mut documented = apt_packages(&read("README.md"));
    documented.extend(apt_packages(&read("docs/MULTINODE.md")));
    let installed = apt_packages(&script());
    assert!(installed.contains("mesa-vulkan-drivers"), "{installed:?}");
    assert!(installed.contains("python3-venv"), "{installed:?}");
    assert_eq!(documented, installed, "README/MULTINODE against .ci/run");
}
