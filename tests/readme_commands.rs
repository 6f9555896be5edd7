//! The README cannot drift (issue 39 item 2): every command in its `sh` blocks runs here.
//!
//! The quick start's two commands are the suite itself and the main job: the test checks
//! that `.ci/run` runs both, word for word. Every other block runs, in order, as one bash
//! script (`set -euo pipefail`, so any failing command fails the test) in a scratch
//! directory, with three substitutions a reader would not make: `cargo run --release --` is
//! the binary this test was built with, `.ci/` is the repository's, and port 8080 is a free
//! one. The script is bounded in time, and every process it leaves is killed by its group.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const QUICK_START: [&str; 2] = [
    "cargo run --release",
    "cargo test --release -- --test-threads=1",
];

/// The README's ```sh blocks, in order.
fn sh_blocks(readme: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in readme.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(b), l) => {
                b.push_str(l);
                b.push('\n');
            }
            _ => {}
        }
    }
    assert!(current.is_none(), "an unclosed code block");
    blocks
}

/// A command line without its trailing comment.
fn command(line: &str) -> &str {
    line.split("  #").next().unwrap().trim()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn the_quick_start_is_what_ci_runs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(Path::new(root).join("README.md")).unwrap();
    let blocks = sh_blocks(&readme);
    let quick: Vec<&str> = blocks[0].lines().map(command).collect();
    assert_eq!(quick, QUICK_START, "the README's first block");
    let ci = std::fs::read_to_string(Path::new(root).join(".ci/run")).unwrap();
    for c in QUICK_START {
        let runs = ci
            .lines()
            .map(|l| l.trim())
            .any(|l| !l.starts_with('#') && command(l) == c);
        assert!(runs, ".ci/run does not run `{c}`");
    }
}

#[test]
fn every_other_readme_command_runs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(Path::new(root).join("README.md")).unwrap();
    let blocks = sh_blocks(&readme);
    assert!(blocks.len() >= 5, "{} sh blocks", blocks.len());
    let port = free_port().to_string();
    let script = blocks[1..]
        .concat()
        .replace("cargo run --release --", env!("CARGO_BIN_EXE_wgpar"))
        .replace("bash .ci/", &format!("bash {root}/.ci/"))
        .replace("8080", &port);
    let commands = script.lines().filter(|l| !l.trim().is_empty()).count();
    // Removed when the test ends, passed or failed, after `run_bounded` killed what the
    // script left running.
    let dir = common::scratch_dir("readme");
    let out = run_bounded(&format!("set -euxo pipefail\n{script}"), &dir);
    assert!(out.ok, "README commands failed:\n{}", out.text);
    let text = &out.text;
    // What each block shows, checked in its output.
    for want in [
        "Paris",                // run --prompt and chat, greedy on SmolLM2
        "tokens/s",             // every run's figures
        "\"choices\"",          // the server's answer to curl
        "Successful requests:", // bench serve
        "projected",            // project
    ] {
        assert!(text.contains(want), "no '{want}' in the output:\n{text}");
    }
    assert!(dir.join("run.json").is_file(), "run --trace wrote nothing");
    eprintln!("{commands} README lines ran in {:.0} s", out.seconds);
}

struct Output {
    ok: bool,
    text: String,
    seconds: f64,
}

/// Runs `script` with bash in `dir` (stdout and stderr together) for at most 15 minutes, then
/// kills whatever it started (its process group).
fn run_bounded(script: &str, dir: &Path) -> Output {
    use std::os::unix::process::CommandExt;
    let log = dir.join("out.txt");
    let file = std::fs::File::create(&log).unwrap();
    let start = Instant::now();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .process_group(0)
        .spawn()
        .unwrap();
    let limit = Duration::from_secs(900);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let group = child.id() as i32;
    // The script's processes share its group: one kill stops whatever is left of them.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .stderr(Stdio::null())
        .status();
    let _ = child.wait();
    let mut text = String::new();
    std::fs::File::open(&log)
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    if status.is_none() {
        text.push_str("\n(killed after 15 minutes)");
    }
    Output {
        ok: status.is_some_and(|s| s.success()),
        text,
        seconds: start.elapsed().as_secs_f64(),
    }
}
