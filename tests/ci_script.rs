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
