//! Bad input through the command line (issue 29, items 8-16 and 19): every case ends with a
//! clean refusal (exit 1 or 2, a message naming the option and its numbers, no panic, no
//! signal), quickly, and where the issue says so before a device opens.

mod common;

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How a bounded run of `wgpar` ended.
struct Outcome {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Where the child's stdout goes.
enum Out {
    /// Captured.
    Piped,
    /// A pipe whose reading end is closed before the child writes (`wgpar ... | true`).
    ClosedPipe,
    /// `/dev/full`: every write fails with "no space left".
    Full,
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = r.read_to_string(&mut text);
        text
    })
}

/// Waits for `child` at most `limit`; kills it (by its PID, through the handle) past that.
fn wait_bounded(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_with(args: &[&str], env: &[(&str, &str)], out: Out, limit: Duration) -> Outcome {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(args).stderr(Stdio::piped()).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    match out {
        Out::Piped | Out::ClosedPipe => cmd.stdout(Stdio::piped()),
        Out::Full => cmd.stdout(std::fs::File::create("/dev/full").unwrap()),
    };
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take();
    let stdout = match out {
        Out::ClosedPipe => {
            drop(stdout);
            None
        }
        _ => stdout.map(drain),
    };
    let stderr = drain(child.stderr.take().unwrap());
    let status = wait_bounded(&mut child, limit);
    Outcome {
        code: status.code(),
        signal: status.signal(),
        stdout: stdout.map(|h| h.join().unwrap()).unwrap_or_default(),
        stderr: stderr.join().unwrap(),
        took: start.elapsed(),
    }
}

/// A refusal: exit 1 or 2, no signal, no panic, each of `parts` in the message, within
/// `limit`.
fn refused_within(args: &[&str], parts: &[&str], limit: Duration) -> Outcome {
    let o = run_with(args, &[], Out::Piped, limit * 4);
    assert_clean_refusal(args, &o, parts);
    assert!(o.took < limit, "{args:?} took {:?}", o.took);
    o
}

/// A refusal before any device opens: quick, and nothing printed on stdout (the banners come
/// after the devices).
fn refused_early(args: &[&str], parts: &[&str]) -> Outcome {
    let o = refused_within(args, parts, Duration::from_secs(3));
    assert!(o.stdout.is_empty(), "{args:?} printed {}", o.stdout);
    o
}

fn assert_clean_refusal(args: &[&str], o: &Outcome, parts: &[&str]) {
    assert_eq!(o.signal, None, "{args:?} killed by a signal: {}", o.stderr);
    assert!(
        matches!(o.code, Some(1 | 2)),
        "{args:?}: exit {:?}: {}{}",
        o.code,
        o.stdout,
        o.stderr
    );
    assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
    for p in parts {
        assert!(o.stderr.contains(p), "{args:?}: '{p}' not in: {}", o.stderr);
    }
}

/// Item 8: a closed pipe or a full disk on stdout is an error exit, not a panic.
#[test]
fn stdout_errors_end_cleanly() {
    let plan = [
        "plan",
        "--model",
        "tiny-gpt2",
        "--batches",
        "1",
        "--seqs",
        "8",
    ];
    for args in [&["devices"][..], &["devices", "--json"], &plan] {
        for (out, why) in [
            (Out::ClosedPipe, "Broken pipe"),
            (Out::Full, "No space left"),
        ] {
            let o = run_with(args, &[], out, Duration::from_secs(60));
            assert_clean_refusal(args, &o, &["standard output", why]);
        }
    }
}
