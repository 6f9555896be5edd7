//! Reliability of the command line (issue 16): absurd inputs are refused before anything is
//! built or opened, options that do not apply are refused, messages say what to do, faults end
//! a run cleanly, and nothing is printed to stderr where nothing failed.

mod common;
mod hf_support;

use std::process::Command;
use std::time::{Duration, Instant};

use common::wgpar;
use hf_support::{write_checkpoint, write_word_tokenizer, Store};
use wgpar::model::{ModelConfig, ModelWeights};

fn refused(args: &[&str]) -> (String, String) {
    let (ok, out, err) = wgpar(args);
    assert!(!ok, "{args:?} succeeded: {out}");
    (out, err)
}

fn assert_mentions(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "'{p}' not in: {text}");
    }
}

/// Item 8: one prefix, and the message says what else `--model` takes.
#[test]
fn unknown_model_is_named_once_with_the_alternatives() {
    let (_, err) = refused(&["run", "--model", "no-such-model"]);
    assert!(
        !err.contains("invalid configuration: invalid configuration"),
        "{err}"
    );
    assert_mentions(&err, &["'no-such-model'", "tiny-llama", "model folder"]);
}

/// Item 2: a model with a matrix larger than the adapter's storage binding is refused from the
/// config and the adapter's limits: nothing is built (the model line is printed only after the
/// weights are) and no device is opened. Token tables are split into blocks that fit, so only
/// a table whose single row exceeds the binding is refused for it.
#[test]
fn oversized_models_are_refused_before_building_weights() {
    // llama-8b's 224 MiB MLP matrices on a 128 MiB binding (lavapipe's; capped on any adapter).
    let (out, err) = refused(&["run", "--model", "llama-8b", "--max-binding", "128M"]);
    assert!(out.is_empty(), "llama-8b: printed {out}");
    assert_mentions(&err, &["layer0.w_up", "storage binding", "MiB"]);
    // llama-1b's 8 KiB embedding rows on a 4 KiB binding.
    let (out, err) = refused(&["run", "--model", "llama-1b", "--max-binding", "4K"]);
    assert!(out.is_empty(), "llama-1b: printed {out}");
    assert_mentions(&err, &["wte (one row)", "storage binding", "KiB"]);
}

/// Item 2, in every command that builds a model: `bench serve`, `compare`, the model benchmarks and
/// `calibrate` check each configuration they will run before opening a device or building a
/// weight.
#[test]
fn every_model_command_refuses_oversized_models_first() {
    // Where the commands would write, inside a folder the test removes whatever happens.
    let dir = common::scratch_dir("oversized");
    let out_dir = dir.join("out").to_string_lossy().to_string();
    let profile = dir.join("profile.toml").to_string_lossy().to_string();
    let commands: [&[&str]; 6] = [
        &["bench", "serve", "--requests", "2"],
        &[
            "bench",
            "serve",
            "--strategy",
            "pp",
            "--virtual",
            "2",
            "--requests",
            "2",
        ],
        &["compare", "--virtual", "2", "--out", &out_dir],
        &["bench", "decode", "--strategies", "single,tp"],
        &["bench", "pipeline", "--stages", "2"],
        &["calibrate", "--quick", "--out", &profile],
    ];
    for command in commands {
        let mut args = command.to_vec();
        // A 128 MiB binding on any adapter (lavapipe's own limit).
        args.extend(["--model", "llama-8b", "--max-binding", "128M"]);
        let start = Instant::now();
        let (out, err) = refused(&args);
        let took = start.elapsed();
        assert!(out.is_empty(), "{args:?}: printed {out}");
        assert_mentions(&err, &["layer0.w_up", "storage binding", "MiB"]);
        // Building llama-8b's weights alone would take minutes on this machine.
        assert!(took < Duration::from_secs(10), "{args:?} took {took:?}");
    }
    assert!(
        !std::path::Path::new(&out_dir).exists(),
        "compare wrote its output folder before refusing"
    );
    assert!(
        !std::path::Path::new(&profile).exists(),
        "calibrate wrote a profile"
    );
}

/// Item 2: `allreduce` refuses sizes beyond the adapter's buffers before allocating.
#[test]
fn allreduce_refuses_sizes_beyond_the_adapter() {
    let (out, err) = refused(&["allreduce", "-b", "4G", "-e", "4G"]);
    assert!(out.is_empty(), "{out}");
    assert_mentions(&err, &["4.0 GiB", "adapter"]);
}

/// Item 4: arguments are checked against the model and the strategy before devices open.
#[test]
fn arguments_are_validated_before_devices_open() {
    let (out, err) = refused(&["run", "--strategy", "tp", "--virtual", "1000"]);
    assert!(out.is_empty(), "{out}");
    assert_mentions(&err, &["degree 1000", "valid degrees"]);
    let (out, err) = refused(&["run", "--strategy", "pp", "--virtual", "300"]);
    assert!(out.is_empty(), "{out}");
    assert_mentions(&err, &["300 pipeline stages"]);
    let (_, err) = refused(&["run", "--virtual", "300"]);
    assert_mentions(&err, &["300 devices selected", "--strategy"]);
    let dir = common::scratch_dir("unwritable-trace");
    let trace = dir.join("no-such-folder").join("t.json");
    let (out, err) = refused(&[
        "run",
        "--model",
        "tiny-llama",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--gen",
        "2",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(out.is_empty(), "the run went ahead: {out}");
    assert_mentions(&err, &["t.json"]);
}

/// Item 6: options that do not apply to the strategy are refused, not ignored.
#[test]
fn options_that_do_not_apply_are_refused() {
    let cases: [(&[&str], &str); 6] = [
        (&["--strategy", "pp", "--split", "1,1"], "--split"),
        (&["--strategy", "hybrid", "--split", "1,1"], "--split"),
        (&["--strategy", "tp", "--layers", "3,3"], "--layers"),
        (&["--layers", "3,3"], "--layers"),
        (&["--strategy", "pp", "--tp", "2"], "--tp"),
        (&["--micro-batches", "2"], "--micro-batches"),
    ];
    for (args, option) in cases {
        let mut all = vec!["run", "--virtual", "2"];
        all.extend_from_slice(args);
        let (out, err) = refused(&all);
        assert!(out.is_empty(), "{args:?}: {out}");
        assert_mentions(&err, &[option, "does not apply"]);
    }
}

/// Item 7: more micro-batches than sequences is refused rather than clamped silently, and a
/// pipeline run prints its bubble share.
#[test]
fn micro_batches_beyond_the_batch_and_the_bubble_share() {
    let (_, err) = refused(&[
        "run",
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--batch",
        "4",
        "--micro-batches",
        "8",
    ]);
    assert_mentions(&err, &["--micro-batches 8", "batch of 4"]);
    let (ok, out, err) = wgpar(&[
        "run",
        "--model",
        "tiny-llama",
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--batch",
        "4",
        "--micro-batches",
        "2",
        "--prompt-len",
        "8",
        "--gen",
        "3",
    ]);
    assert!(ok, "{err}");
    assert_mentions(&out, &["bubble", "measured", "2 stages x 2 micro-batches"]);
}

/// Item 7: compare refuses zero micro-batches and zero repetitions.
#[test]
fn compare_refuses_zero_counts() {
    let (_, err) = refused(&["compare", "--micro-batches", "0"]);
    assert_mentions(&err, &["--micro-batches"]);
    let (_, err) = refused(&["compare", "--reps", "0"]);
    assert_mentions(&err, &["--reps"]);
}

/// Item 9: messages in the user's terms.
#[test]
fn messages_say_what_is_wrong_in_the_users_terms() {
    let (_, err) = refused(&["run", "--dtype", "f16", "--force-f32"]);
    assert_mentions(&err, &["--force-f32", "drop one"]);
    assert!(!err.contains("lacks"), "{err}");
    let (_, err) = refused(&[
        "run",
        "--model",
        "tiny-llama",
        "--batch",
        "1125",
        "--prompt-len",
        "64",
    ]);
    assert_mentions(&err, &["72000 tokens", "--batch", "--prompt-len"]);
    assert!(!err.contains("shape mismatch in norm"), "{err}");
}

/// Item 10: listing adapters in a headless shell that inherited a Wayland display name prints
/// nothing on stderr.
#[test]
fn adapter_discovery_is_quiet_where_nothing_failed() {
    // Issue 29 item 1: no WAYLAND_DISPLAY (Mesa 22.3's device-select layer still connects to
    // `wayland-0`), a relative one, and an XDG_RUNTIME_DIR that is unset, empty or not a folder.
    let cases: [(Option<&str>, Option<&str>); 6] = [
        (None, None),
        (Some("wayland-0"), None),
        (None, Some("")),
        (Some("wayland-0"), Some("")),
        (None, Some("/nonexistent-runtime-dir")),
        (Some("wayland-0"), Some("/nonexistent-runtime-dir")),
    ];
    for (display, runtime) in cases {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
        cmd.arg("devices").env_remove("NODEVICE_SELECT");
        match display {
            Some(d) => cmd.env("WAYLAND_DISPLAY", d),
            None => cmd.env_remove("WAYLAND_DISPLAY"),
        };
        match runtime {
            Some(r) => cmd.env("XDG_RUNTIME_DIR", r),
            None => cmd.env_remove("XDG_RUNTIME_DIR"),
        };
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{display:?} {runtime:?}: {text}");
        assert!(text.contains("Vulkan"), "{display:?} {runtime:?}: {text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.trim().is_empty(),
            "{display:?} {runtime:?}: stderr: {err}"
        );
    }
}

/// Item 11: every injected fault, in a pipeline stage or a tensor-parallel rank, ends the run
/// with a failing exit status and an error naming the worker.
#[test]
fn injected_faults_end_the_run_and_name_the_worker() {
    let base = [
        "run",
        "--model",
        "tiny-llama",
        "--virtual",
        "2",
        "--batch",
        "2",
        "--prompt-len",
        "4",
        "--gen",
        "4",
    ];
    for (strategy, worker, name) in [("pp", "stage=1", "stage 1"), ("tp", "rank=1", "rank 1")] {
        for kind in ["error", "panic", "device-lost"] {
            let spec = format!("{worker},kind={kind},at=step:1");
            let mut args = base.to_vec();
            args.extend(["--strategy", strategy, "--inject-fault", &spec]);
            let start = Instant::now();
            let (ok, out, err) = wgpar(&args);
            let took = start.elapsed();
            eprintln!("{strategy} {kind}: {took:?}: {}", err.trim());
            assert!(!ok, "{spec}: exit 0: {out}");
            assert_mentions(&err, &[name]);
            // The whole run (devices, model, warm-up) plus the failure; a hang would be 120 s.
            assert!(took < Duration::from_secs(30), "{spec} took {took:?}");
        }
    }
    let (_, err) = refused(&["run", "--inject-fault", "stage=1,kind=error"]);
    assert_mentions(&err, &["--strategy"]);
    let (_, err) = refused(&[
        "run",
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--inject-fault",
        "stage=5,kind=oops",
    ]);
    assert_mentions(&err, &["unknown kind 'oops'"]);
}

fn tiny_checkpoint(name: &str) -> hf_support::Scratch {
    let weights = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 12);
    let dir = write_checkpoint(name, &weights, Store::F32);
    write_word_tokenizer(&dir, weights.config.vocab);
    dir
}

/// Item 6: text generation honours the strategy, the devices, the trace and the pacer, and
/// generates the same text as on one device.
#[test]
fn text_generation_runs_under_every_strategy() {
    let dir = tiny_checkpoint("text-strategies");
    let model = dir.to_str().unwrap();
    let prompt = ["--prompt", "t5 t17 t300 t42", "--gen", "5"];
    let (ok, single, err) = wgpar(&[&["run", "--model", model][..], &prompt[..]].concat());
    assert!(ok, "{err}");
    let trace = dir.join("text-trace.json");
    let trace = trace.to_str().unwrap();
    for strategy in [
        &["--strategy", "tp", "--virtual", "2"][..],
        &["--strategy", "pp", "--virtual", "2", "--pace", "pcie3-2gpu"][..],
        &["--strategy", "hybrid", "--virtual", "4", "--layers", "1,1"][..],
    ] {
        let args = [
            &["run", "--model", model, "--trace", trace][..],
            strategy,
            &prompt[..],
        ]
        .concat();
        let (ok, out, err) = wgpar(&args);
        assert!(ok, "{strategy:?}: {err}");
        assert_eq!(out.lines().next(), single.lines().next(), "{strategy:?}");
        assert_mentions(&out, &["trace:"]);
        let label = match strategy[1] {
            "tp" => "tp=2",
            "pp" => "pp=2",
            _ => "hybrid tp=2 x pp=2",
        };
        assert!(err.contains(label), "{strategy:?}: {err}");
        assert!(std::fs::metadata(trace).unwrap().len() > 100);
    }
}

/// `run --logits-out` writes one row of logits per generated step, and each sequence's pick in
/// a row is the token the run reports (greedy), for a single device and a pipeline alike.
#[test]
fn logits_out_holds_every_step_and_its_picks() {
    for strategy in ["single", "pp"] {
        let dir = common::scratch_dir(&format!("logits-{strategy}"));
        let path = dir.join("logits.json");
        let mut args = vec!["run", "--model", "tiny-gpt2", "--strategy", strategy];
        if strategy == "pp" {
            args.extend(["--virtual", "2"]);
        }
        args.extend(["--batch", "2", "--prompt-len", "5", "--gen", "4"]);
        args.extend(["--logits-out", path.to_str().unwrap()]);
        let (ok, _, err) = common::wgpar(&args);
        assert!(ok, "{strategy}: {err}");
        let text = std::fs::read_to_string(&path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let (batch, vocab) = (
            v["batch"].as_u64().unwrap() as usize,
            v["vocab"].as_u64().unwrap() as usize,
        );
        let tokens: Vec<Vec<u64>> = serde_json::from_value(v["tokens"].clone()).unwrap();
        let rows: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
        assert_eq!((batch, tokens.len()), (2, 2), "{strategy}");
        assert_eq!(rows.len(), 4, "{strategy}: one row per generated step");
        let mut compared = 0;
        for (step, row) in rows.iter().enumerate() {
            assert_eq!(row.len(), batch * vocab, "{strategy} step {step}");
            for (b, seq) in tokens.iter().enumerate() {
                let logits = &row[b * vocab..(b + 1) * vocab];
                let argmax = (0..vocab)
                    .max_by(|&i, &j| logits[i].total_cmp(&logits[j]))
                    .unwrap();
                assert_eq!(argmax as u64, seq[step], "{strategy} step {step} seq {b}");
                compared += 1;
            }
        }
        assert_eq!(compared, 8);
    }
}

/// Issue 39 item 7: a run of one generated token times no decode step, so its decode rates
/// were never measured: they print `n/a`, not 0 or NaN.
#[test]
fn a_run_without_decode_steps_prints_no_made_up_rates() {
    let (ok, out, err) = wgpar(&[
        "run",
        "--model",
        "tiny-llama",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--gen",
        "1",
    ]);
    assert!(ok, "{err}");
    let decode = out
        .lines()
        .find(|l| l.starts_with("decode:"))
        .unwrap_or_else(|| panic!("no decode line in {out}"));
    assert!(
        decode.contains("n/a ms per token, n/a tokens/s"),
        "{decode}"
    );
    assert!(!out.contains("NaN"), "{out}");
    // The prefill was measured: its rate is a number.
    let prefill = out.lines().find(|l| l.starts_with("prefill:")).unwrap();
    assert!(!prefill.contains("n/a"), "{prefill}");
}
