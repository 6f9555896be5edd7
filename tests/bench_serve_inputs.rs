//! `wgpar bench serve`'s inputs (issue 29, items 6, 7, 14, 15 and 19): each bad input is
//! refused with exit 1 and a message that names the numbers, before a device opens (no model
//! banner), never with a panic, an abort or a run whose results are thrown away.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

/// Runs `wgpar bench serve ARGS` on tiny-gpt2: (exit code, stdout, stderr, seconds).
fn bench_serve(args: &[&str]) -> (Option<i32>, String, String, Duration) {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["bench", "serve", "--model", "tiny-gpt2"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        t0.elapsed(),
    )
}

/// Asserts a refusal: exit 1, or 2 for what the option parser refuses (no panic, no
/// signal), nothing run, `needles` in the message.
fn assert_refused(args: &[&str], needles: &[&str]) {
    let (code, out, err, took) = bench_serve(args);
    assert!(
        matches!(code, Some(1 | 2)),
        "{args:?}: exit {code:?}\n{out}\n{err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(
        !out.contains("model tiny-gpt2"),
        "{args:?}: refused only after the model was built:\n{out}"
    );
    for n in needles {
        assert!(err.contains(n), "{args:?}: '{n}' not in: {err}");
    }
    assert!(took < Duration::from_secs(20), "{args:?}: took {took:?}");
}

/// Item 6: a rate so slow that its arrivals overflow a clock.
#[test]
fn too_slow_a_rate_is_refused() {
    for rate in ["1e-20", "1e-300"] {
        assert_refused(&["--rate", rate], &["slowest rate", "1e-6"]);
    }
}

/// Item 7: request counts past what one run makes are refused with the bound, before the
/// workload is allocated.
#[test]
fn huge_request_counts_are_refused_before_allocating() {
    for n in ["1000000000000", "18446744073709551615", "100000000"] {
        assert_refused(&["--requests", n], &[n, "1000000"]);
    }
    // Within the request bound, the prompt tokens are bounded too.
    assert_refused(
        &[
            "--requests",
            "1000000",
            "--prompt-len",
            "100",
            "--max-seq",
            "200",
        ],
        &["100000000 prompt tokens", "67108864"],
    );
}

/// Item 14: an output that cannot be written is refused before the run.
#[test]
fn unwritable_trace_is_refused_before_the_run() {
    let dir = common::scratch("bench-serve-trace");
    let as_dir = format!("{}/", dir.display());
    let (code, out, err, _) = bench_serve(&["--requests", "2", "--trace", &as_dir]);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        !out.contains("Serving Benchmark Result"),
        "ran first:\n{out}"
    );
    assert!(err.contains(&as_dir), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Item 15: micro-batch lanes beyond the KV slots would never run.
#[test]
fn more_lanes_than_slots_is_refused() {
    assert_refused(
        &[
            "--strategy",
            "pp",
            "--virtual",
            "2",
            "--micro-batches",
            "9",
            "--max-batch",
            "2",
        ],
        &["--micro-batches 9", "--max-batch 2", "only 2"],
    );
}

/// Item 19: the message says which prompts fit instead of "every such request".
#[test]
fn too_long_lengths_say_what_fits() {
    let (code, _, err, _) = bench_serve(&["--prompt-len", "2:8", "--max-seq", "6"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("every such request"), "{err}");
    // Output 16 by default: no prompt fits in 6.
    assert!(err.contains("no prompt fits"), "{err}");
    let (code, _, err, _) =
        bench_serve(&["--prompt-len", "2:8", "--output-len", "2", "--max-seq", "6"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("prompts of at most 5 tokens fit"), "{err}");
}

/// The server refuses the same lane/slot mismatch, before a device opens.
#[test]
fn server_refuses_more_lanes_than_slots() {
    let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args([
            "serve",
            "--model",
            "tiny-gpt2",
            "--strategy",
            "pp",
            "--virtual",
            "2",
            "--micro-batches",
            "9",
            "--max-batch",
            "2",
            "--port",
            "0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a usage error: {err}");
    assert!(
        err.contains("--micro-batches 9") && !err.contains("listening"),
        "{err}"
    );
}
