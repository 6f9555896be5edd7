//! One test per exit-status class of the command line (docs/USAGE.md, "Exit status"): success
//! 0, a failure while running 1, a usage error 2, and an internal error 70 (a library call
//! that does not fit the state it finds). The first three run the binary; the internal class
//! cannot be reached from the command line without a bug, so its test makes the library
//! calls that reach it and checks the status the binary would exit with.

mod common;

use std::process::Command;

use wgpar::comm::{CommConfig, CommError, Communicator};
use wgpar::device::DType;
use wgpar::error::{EXIT_FAILURE, EXIT_INTERNAL, EXIT_USAGE};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, SingleEngine};
use wgpar::WgparError;

/// Runs `wgpar args`: (exit status, stdout, stderr).
fn wgpar(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_run_that_completes_exits_0() {
    let (code, out, err) = wgpar(&[
        "run",
        "--model",
        "tiny-llama",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--gen",
        "2",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("decode:"), "{out}");
}

#[test]
fn what_the_user_typed_exits_2() {
    // clap's own parse error, an option value wgpar refuses, and options that do not apply
    // together.
    let cases: [(&[&str], &str); 5] = [
        (&["run", "--no-such-flag"], "--no-such-flag"),
        (&["run", "--model", "tiny-llama", "--batch", "0"], "--batch"),
        (
            &["run", "--model", "tiny-llama", "--layers", "1,1"],
            "--layers",
        ),
        // Collective options the comm layer refuses (its configuration errors) are what the
        // user typed too.
        (&["allreduce", "--chunk", "1K"], "chunk"),
        (&["allreduce", "--op", "frobnicate"], "frobnicate"),
    ];
    for (args, named) in cases {
        let (code, out, err) = wgpar(args);
        assert_eq!(code, Some(EXIT_USAGE), "{args:?}: {err}");
        assert!(err.contains(named), "{args:?}: {err}");
        assert!(
            !out.contains("decode:") && !out.contains("algbw"),
            "{args:?} ran: {out}"
        );
    }
}

#[test]
fn comm_states_while_running_are_never_usage_errors() {
    let gpus = common::gpus(1);
    let comm = Communicator::new(gpus.clone(), CommConfig::default()).unwrap();
    // A rank the communicator does not have: the calling program's ranks disagree with it.
    let Err(e) = comm.join(1) else {
        panic!("rank 1 joined a communicator of one rank")
    };
    assert!(
        matches!(&e, WgparError::Comm(CommError::RankState { rank: 1, .. })),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    assert!(
        e.to_string().contains("outside a communicator of 1 ranks"),
        "{e}"
    );
    // A collective on an aborted communicator: a rank failed while running.
    let tensor = gpus[0].upload_f32("x", &[1.0, 2.0, 3.0]).unwrap();
    comm.all_reduce(0, &tensor).unwrap();
    comm.abort(0, "its compute failed");
    let e = comm.all_reduce(0, &tensor).unwrap_err();
    assert!(
        matches!(&e, WgparError::Comm(CommError::Aborted { .. })),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_FAILURE, "{e}");
    assert!(e.to_string().contains("its compute failed"), "{e}");
}

#[test]
fn a_failure_while_running_exits_1() {
    // A model folder whose config.json is not a model wgpar can read: the file, not an
    // option, has to change.
    let dir = common::scratch("exit-status-model");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    let (code, _, err) = wgpar(&["run", "--model", dir.to_str().unwrap()]);
    assert_eq!(code, Some(EXIT_FAILURE), "{err}");
    assert!(err.contains("config.json"), "{err}");
    // A trace that is not there.
    let missing = dir.join("no-such-trace.json");
    let (code, _, err) = wgpar(&[
        "project",
        "--trace",
        missing.to_str().unwrap(),
        "--host",
        "pcie3-2gpu",
    ]);
    assert_eq!(code, Some(EXIT_FAILURE), "{err}");
    assert!(err.contains("no-such-trace.json"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_call_that_does_not_fit_the_state_is_internal_not_usage() {
    // A rank joined twice: a runtime state of the communicator, not an option.
    let gpus = common::gpus(1);
    let comm = Communicator::new(gpus.clone(), CommConfig::default()).unwrap();
    let _first = comm.join(0).unwrap();
    let Err(e) = comm.join(0) else {
        panic!("a second join of rank 0 was accepted")
    };
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    assert!(e.to_string().contains("rank 0"), "{e}");
    // An engine decoding before any prefill, and prompts of unequal lengths.
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 1);
    let mut engine = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    let e = engine.decode(&[1]).unwrap_err();
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    let e = engine.prefill(&[vec![1, 2], vec![3]]).unwrap_err();
    assert!(
        matches!(e, WgparError::UnequalPrompts { first: 2, other: 1 }),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL);
}

#[test]
fn calls_out_of_range_are_internal_and_typed_with_their_numbers() {
    use wgpar::parallel::{build_pipeline, measure_decode, partition, Partition, StageCost};
    // A balanced partition over a stage whose measured layer time is not positive.
    let cost = |layer_s: f64| StageCost {
        layer_s,
        embed_s: 0.0,
        head_s: 0.0,
        memory: None,
    };
    let e = partition(4, 2, &Partition::Balanced(vec![cost(1e-3), cost(-2.0)])).unwrap_err();
    assert!(
        matches!(&e, WgparError::StageCost { stage: 1, what, seconds } if what == "layer" && *seconds == -2.0),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    // A single-device strategy handed to the pipeline builder.
    let gpus = common::gpus(1);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 1);
    let single = wgpar::parallel::Strategy::Single;
    let comm = CommConfig::default();
    let Err(e) = build_pipeline(&single, &gpus, &weights, DType::F32, &comm, (1, 1)) else {
        panic!("a pipeline was built from a single-device strategy")
    };
    assert!(
        matches!(&e, WgparError::WrongStrategy { expected, .. } if expected == "pipeline"),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    // A decode measurement with no timed step.
    let mut engine = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    let e = measure_decode(&mut engine, &gpus, &[vec![1, 2]], (0, 0)).unwrap_err();
    assert!(
        matches!(e, WgparError::TooFew { got: 0, min: 1, .. }),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
}

#[test]
fn inputs_for_another_model_are_internal_and_typed_with_their_numbers() {
    use wgpar::model::{CpuReference, EncoderInput};
    // An encoder's sequence with a token id its vocabulary does not have.
    let bert = ModelWeights::synthetic(&ModelConfig::preset("tiny-bert").unwrap(), 1);
    let vocab = bert.config.vocab;
    let e = CpuReference::new(&bert)
        .encode(&[
            EncoderInput::new(vec![1, 2]),
            EncoderInput::new(vec![3, vocab as u32]),
        ])
        .unwrap_err();
    assert!(
        matches!(&e, WgparError::TokenRange { sequence: 1, value, limit, .. }
            if *value as usize == vocab && *limit == vocab),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    // A decoder asked for a pooled embedding.
    let llama = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 1);
    let e = CpuReference::new(&llama)
        .encode(&[EncoderInput::new(vec![1])])
        .unwrap_err();
    assert!(
        matches!(&e, WgparError::WrongModelKind { model, .. } if model == "tiny-llama"),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
}

#[test]
fn parts_an_engine_does_not_have_are_internal_and_typed_with_their_numbers() {
    use wgpar::kernels::ops::{pack_adjustments, LogitAdjust, MAX_ADJUST_PER_ROW};
    use wgpar::model::CpuReference;
    use wgpar::parallel::{Fault, FaultKind, Partition, PipelineEngine};
    // A fault armed on a stage past the end of a two-stage pipeline.
    let gpus = common::gpus(2);
    let weights = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 1);
    let comm = CommConfig::default();
    let mut pp = PipelineEngine::new(&gpus, &weights, DType::F32, &Partition::Even, 1, comm)
        .expect("a two-stage pipeline");
    let fault = Fault {
        after: 0,
        kind: FaultKind::Error,
    };
    let e = pp.inject_fault(5, fault).unwrap_err();
    assert!(
        matches!(&e, WgparError::OutOfRange { index: 5, count: 2, what } if what.contains("stage")),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    // Logit adjustments for a row past the step's rows, and a token past the vocabulary.
    let adjust = |row, token| LogitAdjust {
        row,
        token,
        add: 1.0,
        repetition: 1.0,
        sub: 0.0,
    };
    let e = pack_adjustments(2, 50, &[adjust(3, 1)]).unwrap_err();
    assert!(
        matches!(
            e,
            WgparError::OutOfRange {
                index: 3,
                count: 2,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
    let crowded: Vec<LogitAdjust> = (0..=MAX_ADJUST_PER_ROW as u32)
        .map(|t| adjust(0, t))
        .collect();
    let e = pack_adjustments(1, 4 * MAX_ADJUST_PER_ROW, &crowded).unwrap_err();
    assert!(
        matches!(e, WgparError::LengthMismatch { got, expected, .. }
            if got == MAX_ADJUST_PER_ROW + 1 && expected == MAX_ADJUST_PER_ROW),
        "{e}"
    );
    let e = pack_adjustments(2, 50, &[adjust(1, 60)]).unwrap_err();
    assert!(
        matches!(
            e,
            WgparError::TokenRange {
                sequence: 1,
                value: 60,
                limit: 50,
                ..
            }
        ),
        "{e}"
    );
    // The reference decoder asked of an encoder.
    let bert = ModelWeights::synthetic(&ModelConfig::preset("tiny-bert").unwrap(), 1);
    let Err(e) = CpuReference::with_slots(&bert, 1) else {
        panic!("a decoder reference was made of an encoder")
    };
    assert!(
        matches!(&e, WgparError::WrongModelKind { model, .. } if model == &bert.config.name),
        "{e}"
    );
    assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
}

#[test]
fn the_help_lists_every_status() {
    let (code, out, _) = wgpar(&["--help"]);
    assert_eq!(code, Some(0));
    for status in [
        "0 success",
        "1 failure while running",
        "2 usage error",
        "70 internal",
    ] {
        assert!(out.contains(status), "{status}: {out}");
    }
}

/// A server on a free port that answers every request with 404, `count` times.
fn refusing_server(count: usize) -> u16 {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(count) {
            let Ok(stream) = stream else { continue };
            let mut reader = BufReader::new(stream);
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let reply = r#"{"error":{"message":"no such model","code":404}}"#;
            let _ = write!(
                reader.get_mut(),
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: \
                 {}\r\nConnection: close\r\n\r\n{reply}",
                reply.len()
            );
        }
    });
    port
}

#[test]
fn a_benchmark_whose_every_request_failed_exits_1_with_no_figure() {
    let port = refusing_server(3);
    let url = format!("http://127.0.0.1:{port}");
    let (code, out, err) = wgpar(&["bench", "serve", "--url", &url, "--requests", "3"]);
    assert_eq!(code, Some(EXIT_FAILURE), "{out}\n{err}");
    assert!(err.contains("failed all 3 requests"), "{err}");
    // Nothing was measured: every figure says so instead of a zero.
    for figure in [
        "Mean TTFT (ms):",
        "P99 ITL (ms):",
        "Bubble (% of device-time):",
    ] {
        let line = out.lines().find(|l| l.starts_with(figure));
        let line = line.unwrap_or_else(|| panic!("{figure} missing:\n{out}"));
        assert!(line.trim_end().ends_with("n/a"), "{line}");
    }
}
