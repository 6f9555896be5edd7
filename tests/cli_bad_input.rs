//! Bad input through the command line (issue 29, items 8-16 and 19): every case ends with a
//! clean refusal (exit 1 or 2, a message naming the option and its numbers, no panic, no
//! signal), quickly, and where the issue says so before a device opens.

mod common;
mod hf_support;

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hf_support::{write_checkpoint, write_word_tokenizer, Store};
use wgpar::model::{ModelConfig, ModelWeights};

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
        Out::Piped => cmd.stdout(Stdio::piped()),
        // The reading end is closed before the child starts: closing it after the spawn races
        // with a quick command, whose few lines would fit in the pipe's buffer and succeed.
        Out::ClosedPipe => {
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            cmd.stdout(writer)
        }
        Out::Full => cmd.stdout(std::fs::File::create("/dev/full").unwrap()),
    };
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    // The parent's copy of the writing end goes with `cmd`, so only the child holds it.
    drop(cmd);
    let stdout = child.stdout.take().map(drain);
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

/// Item 9: a device count no run can use is refused as the arguments are parsed, before
/// anything is allocated for it.
#[test]
fn device_counts_are_bounded_before_anything_is_allocated() {
    for n in ["4294967296", "1000000", "18446744073709551615"] {
        refused_early(&["run", "--virtual", n], &["--virtual", n, "4096"]);
        refused_early(
            &[
                "run",
                "--model",
                "tiny-gpt2",
                "--strategy",
                "tp",
                "--virtual",
                n,
            ],
            &["--virtual", n],
        );
        refused_early(&["compare", "--virtual", n], &["--virtual", n]);
    }
    let many = vec!["0"; 5000].join(",");
    refused_early(&["run", "--devices", &many], &["--devices", "5000", "4096"]);
}

/// Item 10 and the `allreduce` size options: counts and sizes are checked before an adapter
/// is looked for, and the iteration counts are bounded.
#[test]
fn allreduce_options_are_checked_before_any_device() {
    let cases: [(&[&str], &[&str]); 6] = [
        (
            &["-b", "8", "-e", "8", "-n", "1000000000", "-w", "0"],
            &["-n", "1000000000", "1000000"],
        ),
        (&["-n", "1", "-w", "18446744073709551615"], &["-w"]),
        (&["-b", "64", "-e", "8"], &["64", "8"]),
        (&["-f", "1"], &["factor", "1"]),
        (&["-b", "lots"], &["'lots'"]),
        (&["--chunk", "3"], &["chunk_bytes", "4096", "3"]),
    ];
    for (options, parts) in cases {
        let args = [&["allreduce", "--virtual", "2"][..], options].concat();
        refused_early(&args, parts);
    }
}

fn rank_trace(rank: usize, meta: &[(&str, &str)]) -> wgpar::trace::Timeline {
    let mut t = wgpar::trace::Timeline::new();
    t.meta.insert("mpi_rank".into(), rank.to_string());
    t.meta.insert("mpi_size".into(), "2".into());
    t.meta.insert("mpi_devices".into(), "1".into());
    for (k, v) in meta {
        t.meta.insert(k.to_string(), v.to_string());
    }
    t
}

fn project(traces: &[wgpar::trace::Timeline], name: &str) -> Outcome {
    let dir = common::scratch_dir(name);
    let mut args = vec!["project".to_string(), "--host".into(), "pcie4-2gpu".into()];
    for (i, t) in traces.iter().enumerate() {
        let path = dir.join(format!("t{i}.json"));
        t.write_chrome_trace(&path).unwrap();
        args.extend(["--trace".into(), path.to_string_lossy().into_owned()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_with(&args, &[], Out::Piped, Duration::from_secs(30))
}

/// Item 11: rank traces merge only as the ranks of one run, in any order; job sizes and
/// device counts from a trace are bounded before anything is allocated for them.
#[test]
fn rank_traces_merge_only_within_one_run() {
    for size in ["1000000000000", "18446744073709551615"] {
        let traces = [
            rank_trace(0, &[("mpi_size", size)]),
            rank_trace(1, &[("mpi_size", size)]),
        ];
        let o = project(&traces, "merge-size");
        assert_clean_refusal(&["project"], &o, &[size]);
        assert!(o.took < Duration::from_secs(5), "{size}: {:?}", o.took);
    }
    // Two ranks of different jobs and runs: refused whichever comes first.
    for (key, a, b) in [
        ("mpi_size", "2", "3"),
        ("model", "tiny-gpt2", "tiny-llama"),
        ("strategy", "pp=2", "tp=2"),
        ("batch", "1", "4"),
        ("mpi_run", "--model tiny-gpt2", "--model tiny-llama"),
    ] {
        for (first, second) in [(a, b), (b, a)] {
            let traces = [
                rank_trace(0, &[(key, first)]),
                rank_trace(1, &[(key, second)]),
            ];
            let o = project(&traces, "merge-runs");
            assert_clean_refusal(&["project", key], &o, &["another run", key, a, b]);
        }
    }
    let traces = [
        rank_trace(0, &[]),
        rank_trace(1, &[("mpi_devices", "4294967296")]),
    ];
    let o = project(&traces, "merge-devices");
    assert_clean_refusal(&["project"], &o, &["4294967296", "4096"]);
}

/// Item 12: sizes from a config, the options and a trace are computed with checked
/// arithmetic: an overflow is refused, never wrapped into a small number.
#[test]
fn sizes_that_would_overflow_are_refused() {
    let dir = common::scratch_dir("overflow-config");
    for layers in ["18446744073709551615", "1000000000000000"] {
        let config = format!(
            r#"{{"model_type":"llama","vocab_size":256,"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":{layers},"num_attention_heads":4,"num_key_value_heads":4,
            "max_position_embeddings":128,"rms_norm_eps":1e-5}}"#
        );
        let path = dir.join("config.json");
        std::fs::write(&path, config).unwrap();
        refused_early(
            &["plan", "--model", path.to_str().unwrap()],
            &["layers", layers],
        );
    }
    let max = "18446744073709551615";
    refused_early(
        &["plan", "--model", "tiny-gpt2", "--seqs", max],
        &[max, "context"],
    );
    refused_early(
        &["plan", "--model", "tiny-gpt2", "--max-seq", max],
        &["--max-seq", max],
    );
    refused_early(
        &["plan", "--model", "tiny-gpt2", "--batches", max],
        &["--batches", max],
    );
    refused_early(
        &[
            "run",
            "--model",
            "tiny-gpt2",
            "--prompt-len",
            max,
            "--gen",
            "2",
        ],
        &["--prompt-len", max],
    );
    // Byte totals of a trace that would wrap.
    let mut t = wgpar::trace::Timeline::new();
    t.devices.insert(0, "test".into());
    use wgpar::trace::SpanAttrs;
    t.push_us(SpanAttrs::compute("a", 0).bytes(10), 0.0, 1.0);
    t.push_us(SpanAttrs::compute("b", 0).bytes(u64::MAX), 1.0, 1.0);
    let path = dir.join("trace.json");
    t.write_chrome_trace(&path).unwrap();
    refused_early(
        &[
            "project",
            "--trace",
            path.to_str().unwrap(),
            "--host",
            "pcie4-2gpu",
        ],
        &["overflows", &u64::MAX.to_string()],
    );
}

/// Item 13 and `--pace` syntax: a paced link keeps a host profile's bounds (latency up to
/// 10 s, bandwidth from 0.1 MB/s), and bad text is refused before any device opens.
#[test]
fn paced_links_keep_the_profiles_bounds() {
    let run = [
        "run",
        "--model",
        "tiny-gpt2",
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--gen",
        "2",
        "--pace",
    ];
    for (pace, parts) in [
        (
            "1000000000000:1",
            &["alpha_us", "1000000000000", "10 s"][..],
        ),
        ("0:1e-12", &["beta_gbps", "0.1 MB/s"]),
        ("5:abc", &["'abc'"]),
        ("no-such-profile", &["no-such-profile"]),
    ] {
        refused_early(&[&run[..], &[pace]].concat(), parts);
    }
    for fault in ["garbage", "stage=1,kind=oops", "rank=x,kind=error"] {
        let args = [&run[..13], &["--inject-fault", fault]].concat();
        refused_early(&args, &["--inject-fault"]);
    }
}

/// Item 14: where the results go is checked before the work, not after it.
#[test]
fn outputs_are_checked_before_the_work() {
    refused_early(
        &[
            "compare",
            "--model",
            "tiny-gpt2",
            "--virtual",
            "2",
            "--out",
            "/proc/x",
        ],
        &["/proc/x"],
    );
    refused_early(
        &[
            "calibrate",
            "--model",
            "tiny-gpt2",
            "--quick",
            "--out",
            "/proc/x.toml",
        ],
        &["/proc/x.toml"],
    );
    let run = [
        "run",
        "--model",
        "tiny-gpt2",
        "--batch",
        "1",
        "--prompt-len",
        "4",
    ];
    refused_early(
        &[&run[..], &["--gen", "2", "--logits-out", "/proc/x.json"]].concat(),
        &["/proc/x.json"],
    );
}

fn tiny_checkpoint(name: &str, preset: &str) -> hf_support::Scratch {
    let weights = ModelWeights::synthetic(&ModelConfig::preset(preset).unwrap(), 12);
    let dir = write_checkpoint(name, &weights, Store::F32);
    write_word_tokenizer(&dir, weights.config.vocab);
    dir
}

/// Item 15: options that a command would ignore are refused, naming the option.
#[test]
fn options_that_would_be_ignored_are_refused() {
    let dir = tiny_checkpoint("ignored-options", "tiny-gpt2");
    let model = dir.to_str().unwrap();
    let text = ["run", "--model", model, "--prompt", "t5 t17 t300"];
    refused_early(
        &[&text[..], &["--logits-out", "x.json"]].concat(),
        &["--logits-out", "--prompt"],
    );
    // 3 prompt tokens + 4 generated do not fit a context of 1.
    refused_early(
        &[&text[..], &["--max-seq", "1", "--gen", "4"]].concat(),
        &["--max-seq 1", "7 tokens"],
    );
    refused_early(
        &["embed", "--model", model, "--virtual", "2", "--text", "t1"],
        &["2 devices", "embed"],
    );
    let bert = tiny_checkpoint("ignored-embed", "tiny-bert");
    refused_early(
        &[
            "embed",
            "--model",
            bert.to_str().unwrap(),
            "--max-seq",
            "2",
            "--text",
            "t1 t2 t3 t4",
        ],
        &["--max-seq 2"],
    );
    refused_early(
        &["calibrate", "--quick", "--max-bytes", "garbage"],
        &["--max-bytes", "'garbage'"],
    );
    refused_early(
        &[
            "plan",
            "--model",
            "tiny-gpt2",
            "--strategies",
            "pp2-m1000000000",
            "--batches",
            "1",
        ],
        &["1000000000 micro-batches", "--batches is 1"],
    );
}

/// Item 15: `--inject-fault at=step:N` counts the jobs of the timed run: each N fails at a
/// different job, and one past the run is refused before any device opens.
#[test]
fn injected_faults_count_the_timed_run_and_must_fire() {
    let run = [
        "run",
        "--model",
        "tiny-gpt2",
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--gen",
        "2",
        "--inject-fault",
    ];
    refused_early(
        &[&run[..], &["stage=1,kind=error,at=step:5"]].concat(),
        &["at=step:5", "3 jobs", "at=step:2"],
    );
    let mut seen = Vec::new();
    for at in 0..3 {
        let spec = format!("stage=1,kind=error,at=step:{at}");
        let args = [&run[..], &[spec.as_str()]].concat();
        let o = run_with(&args, &[], Out::Piped, Duration::from_secs(60));
        assert_clean_refusal(&args, &o, &["injected error fault"]);
        let line = o.stderr.lines().find(|l| l.contains("injected")).unwrap();
        assert!(!seen.contains(&line.to_string()), "at={at}: {line}");
        seen.push(line.to_string());
    }
    assert_eq!(seen.len(), 3);
}

/// Item 16: files a user names are read bounded: a device, a FIFO or an oversized file is
/// refused in milliseconds, with the file named.
#[test]
fn user_named_files_are_read_bounded() {
    let dir = common::scratch_dir("bounded-reads");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::os::unix::fs::symlink("/dev/zero", model.join("config.json")).unwrap();
    let m = model.to_str().unwrap();
    refused_early(
        &["run", "--model", m],
        &["config.json", "not a regular file"],
    );
    refused_early(
        &["plan", "--model", m],
        &["config.json", "not a regular file"],
    );
    refused_early(
        &["project", "--trace", "/dev/zero", "--host", "pcie4-2gpu"],
        &["/dev/zero", "not a regular file"],
    );
    let fifo = dir.join("trace.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    refused_early(
        &[
            "project",
            "--trace",
            fifo.to_str().unwrap(),
            "--host",
            "pcie4-2gpu",
        ],
        &["trace.fifo", "not a regular file"],
    );
    // A profile larger than any profile: refused by size, not parsed.
    let big = dir.join("big.toml");
    let file = std::fs::File::create(&big).unwrap();
    file.set_len(17 << 20).unwrap();
    refused_early(
        &[
            "plan",
            "--model",
            "tiny-gpt2",
            "--host",
            big.to_str().unwrap(),
        ],
        &["big.toml", "17.0 MiB"],
    );
}

/// Item 19: messages say what is wrong.
#[test]
fn messages_say_what_is_wrong() {
    let o = refused_early(
        &["plan", "--weights", "16"],
        &["'16' bytes per element", "0.1..=8"],
    );
    assert!(!o.stderr.contains("not a number format"), "{}", o.stderr);
}

/// Exit codes follow the error's kind (issue 26): 2 for a usage error (an option, or options
/// that do not go together, as clap's own parse errors), 1 for the rest (here a broken model
/// folder).
#[test]
fn usage_errors_exit_2_and_model_errors_1() {
    let usage: [&[&str]; 3] = [
        &["bench", "decode", "--strategies", "tp", "--tp", "1"],
        &["run", "--prompt", "hi", "--model", "tiny-gpt2"],
        &["serve", "--model", "tiny-gpt2", "--max-batch", "0"],
    ];
    for args in usage {
        let o = refused_early(args, &[]);
        assert_eq!(o.code, Some(2), "{args:?}: {}", o.stderr);
    }
    let dir = common::scratch_dir("exit-codes");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    let model = dir.to_str().unwrap();
    let o = refused_early(&["run", "--model", model], &["config.json"]);
    assert_eq!(o.code, Some(1), "{}", o.stderr);
}

/// Issue 39 item 7: a kernel benchmark whose work list would come out empty says why (exit 2),
/// before or, where only the device knows the limit, after it opens; no empty table.
#[test]
fn empty_kernel_benchmarks_say_why() {
    let o = refused_early(
        &["bench", "kernels", "--sizes", "", "--no-others"],
        &["nothing to measure", "--no-others"],
    );
    assert_eq!(o.code, Some(2));
    for shape in ["100000x100000x100000", "18446744073709551615x2x2"] {
        let args = [
            "bench",
            "kernels",
            "--sizes",
            "",
            "--shapes",
            shape,
            "--no-save",
        ];
        let o = refused_within(
            &args,
            &["shape", shape, "allows at most"],
            Duration::from_secs(30),
        );
        assert_eq!(o.code, Some(2), "{}", o.stderr);
        assert!(!o.stdout.contains("GFLOP"), "{}", o.stdout);
    }
}

/// Issue 34 item 2: the roofline's options are checked by name before any device opens: an
/// unknown or dense type in --qtypes, a shape whose inner dimension is not whole blocks, a
/// packed type without a matmul shape, --kernels naming another type's variant or none of a
/// type's, and a copy size out of bounds or without a matmul.
#[test]
fn packed_kernel_benchmark_options_are_refused_by_name() {
    let shape = ["--shapes", "1x64x256"];
    let cases: [(&[&str], &[&str]); 10] = [
        (&["--qtypes", "q9_9"], &["--qtypes q9_9", "q8_0", "q4_k"]),
        (&["--qtypes", "f16"], &["--qtypes f16", "--dtypes"]),
        (
            &["--shapes", "1x64x96", "--qtypes", "q8_0,Q4_K"],
            &["1x64x96", "k = 96", "q4_k blocks of 256"],
        ),
        (
            &[
                "--sizes",
                "",
                "--qtypes",
                "q8_0",
                "--attention-prefill",
                "8",
            ],
            &["--qtypes needs a matmul shape"],
        ),
        (
            &["--qtypes", "q4_0", "--kernels", "qgemv64_q8_0"],
            &["--kernels qgemv64_q8_0", "--qtypes does not name q8_0"],
        ),
        (
            &["--qtypes", "q4_0,q8_0", "--kernels", "qgemv64_q8_0"],
            &["--kernels names no q4_0 variant"],
        ),
        (&["--copy-size", "3"], &["--copy-size 3", "multiple of 16"]),
        (&["--copy-size", "64G"], &["--copy-size 64G", "8G"]),
        (
            &["--copy-size", "lots"],
            &["--copy-size lots", "not a size"],
        ),
        (
            &[
                "--sizes",
                "",
                "--attention-prefill",
                "8",
                "--copy-size",
                "16M",
            ],
            &["--copy-size applies only with a matmul shape"],
        ),
    ];
    for (extra, parts) in cases {
        let mut args = vec!["bench", "kernels", "--no-others", "--no-save"];
        if !extra.contains(&"--sizes") {
            args.extend(["--sizes", ""]);
        }
        if !extra.contains(&"--shapes") && !extra.contains(&"--attention-prefill") {
            args.extend(shape);
        }
        args.extend(extra);
        let o = refused_early(&args, parts);
        assert_eq!(o.code, Some(2), "{args:?}: {}", o.stderr);
    }
}

/// Issue 34 item 2: a copy larger than the adapter binds is refused naming the option and the
/// limit, once the device is open (only it knows the limit), before anything is timed.
#[test]
fn a_copy_over_the_binding_limit_is_refused() {
    let args = [
        "bench",
        "kernels",
        "--sizes",
        "",
        "--shapes",
        "1x32x32",
        "--copy-size",
        "8G",
        "--no-others",
        "--no-save",
    ];
    let o = refused_within(
        &args,
        &["--copy-size", "allows at most"],
        Duration::from_secs(30),
    );
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(!o.stdout.contains("GB/s"), "{}", o.stdout);
}
