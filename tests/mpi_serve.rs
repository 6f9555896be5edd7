//! `wgpar serve` under mpirun (issue 27): a pipeline whose stages span two ranks answers as
//! one process does (greedy and seeded sampling, alone and concurrently), idles past the job's
//! timeout, drains on rank 0's SIGTERM with every rank exiting 0, and a failed rank fails the requests in flight with a 500 and
//! turns /health to 503 before the job ends. Needs `--features mpi` and Open MPI's `mpirun`;
//! CI runs it (`.ci/run`).
#![cfg(feature = "mpi")]

mod common;
mod gguf_support;
mod hf_support;
mod serve_support;

use std::process::Command;
use std::time::Duration;

use serve_support::Server;

const LIMIT: Duration = Duration::from_secs(300);

/// `mpirun -np 2 wgpar serve --port 0 --model tiny-gpt2 --strategy pp ARGS`.
fn over_ranks(args: &[&str]) -> Server {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(env!("CARGO_BIN_EXE_wgpar"))
        .args(["serve", "--port", "0", "--model", "tiny-gpt2"])
        .args(["--strategy", "pp", "--max-batch", "8"])
        .args(args);
    Server::spawn(cmd, LIMIT)
}

/// `mpirun -np 2 wgpar serve --port 0 --model MODEL --strategy pp --served-model-name m`.
fn model_over_ranks(model: &std::path::Path) -> Server {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(env!("CARGO_BIN_EXE_wgpar"))
        .args([
            "serve",
            "--port",
            "0",
            "--served-model-name",
            "m",
            "--model",
        ])
        .arg(model)
        .args(["--strategy", "pp", "--max-batch", "8", "--mpi-timeout", "3"]);
    Server::spawn(cmd, LIMIT)
}

/// Structured output with the head in another process: rank 0 masks read-back logits on
/// the host. The `openai` client's `json_schema` and `json_object` requests (nested objects,
/// enums, arrays, numbers), several at once, each finish on their own and validate against
/// their schemas with `jsonschema`, on a random byte-level model whose unmasked text is not
/// JSON.
#[test]
fn structured_output_over_ranks_validates_against_its_schema() {
    let dir = hf_support::scratch("mpi-serve-structured");
    let template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}\
                    {% if add_generation_prompt %}<a>{% endif %}";
    let context = wgpar::model::ModelConfig::preset("tiny-llama")
        .unwrap()
        .max_seq;
    let model = gguf_support::byte_llama(&dir, template, context);
    let mut server = model_over_ranks(&model);
    let port = server.port.to_string();
    let got = common::python_json("tests/serve_structured/client.py", &[&port, "bytes", "80"]);
    let list = got.as_array().unwrap();
    assert!(list.len() >= 4, "{got}");
    for a in list {
        assert_eq!(a["finish"], "stop", "ran out of tokens: {a}");
        assert_eq!(a["valid"], true, "not valid against its schema: {a}");
    }
    stop_through_rank0(&mut server);
}

/// The same model in one process.
fn one_process() -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args([
        "serve",
        "--port",
        "0",
        "--model",
        "tiny-gpt2",
        "--max-batch",
        "8",
    ]);
    Server::spawn(cmd, LIMIT)
}

/// Request `i`: greedy when even, sampled with seed `i` when odd.
fn body(i: usize, max_tokens: usize) -> String {
    let prompt = format!("t{} t{} t{}", 11 + i, 140 + 9 * i, 3 + i);
    let pick = if i.is_multiple_of(2) {
        r#""temperature":0"#.to_string()
    } else {
        format!(r#""temperature":1.1,"top_p":0.9,"seed":{i}"#)
    };
    format!(r#"{{"prompt":"{prompt}","max_tokens":{max_tokens},{pick}}}"#)
}

/// Request `i` with a prompt of 30 words, longer than a step budget of 8 tokens.
fn long_body(i: usize, max_tokens: usize) -> String {
    let words: Vec<String> = (0..30)
        .map(|k| format!("t{}", (7 * i + 13 * k) % 200))
        .collect();
    let prompt = words.join(" ");
    let pick = if i.is_multiple_of(2) {
        r#""temperature":0"#.to_string()
    } else {
        format!(r#""temperature":1.1,"top_p":0.9,"seed":{i}"#)
    };
    format!(r#"{{"prompt":"{prompt}","max_tokens":{max_tokens},{pick}}}"#)
}

#[test]
fn prompts_chunked_over_ranks_answer_as_one_process() {
    let bodies: Vec<String> = (0..6).map(|i| long_body(i, 6)).collect();
    // One process prefills each prompt whole (its budget, 512, holds them).
    let want: Vec<String> = {
        let single = one_process();
        bodies.iter().map(|b| single.complete(b)).collect()
    };
    let mut server = over_ranks(&["--mpi-timeout", "3", "--max-step-tokens", "8"]);
    for (b, w) in bodies.iter().zip(&want) {
        assert_eq!(&server.complete(b), w, "{b}");
    }
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (bodies.iter())
            .map(|b| s.spawn(|| server.complete(b)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, want, "concurrent chunked requests over ranks");
    assert!(want.iter().all(|w| !w.is_empty()), "every answer has text");
    stop_through_rank0(&mut server);
}

#[test]
fn serving_over_ranks_answers_as_one_process() {
    let bodies: Vec<String> = (0..8).map(|i| body(i, 10)).collect();
    let want: Vec<String> = {
        let single = one_process();
        bodies.iter().map(|b| single.complete(b)).collect()
    };
    // --mpi-timeout 3, then an idle wait of 5 s: a server's links wait for the next request.
    let mut server = over_ranks(&["--mpi-timeout", "3"]);
    std::thread::sleep(Duration::from_secs(5));
    for (b, w) in bodies.iter().zip(&want) {
        assert_eq!(&server.complete(b), w, "{b}");
    }
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (bodies.iter())
            .map(|b| s.spawn(|| server.complete(b)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, want, "concurrent requests over ranks");
    let distinct: std::collections::BTreeSet<&String> = want.iter().collect();
    assert!(
        distinct.len() > 1,
        "every request gave the same text: {want:?}"
    );
    stop_through_rank0(&mut server);
}

/// Stops the job as an operator does: mpirun kills the job at SIGTERM, so the signal goes to
/// rank 0, which drains and stops the pipeline; mpirun must then exit cleanly.
fn stop_through_rank0(server: &mut Server) {
    let said = server.stderr.lock().unwrap().join("\n");
    let pid: i32 = said
        .split("SIGTERM rank 0: pid ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid of rank 0 in: {said}"));
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = server.wait(Duration::from_secs(60));
    assert!(
        status.success(),
        "mpirun after rank 0's SIGTERM: {status:?}"
    );
}

#[test]
fn a_failed_rank_fails_requests_in_flight_and_health() {
    // Rank 1's stage fails 30 micro-batches after the warm-up began: inside the long request.
    let mut server = over_ranks(&["--mpi-fault", "1:error:30"]);
    let (code, text) = server.post("/v1/completions", &body(0, 60));
    assert_eq!(code, 500, "{text}");
    assert!(
        text.contains("rank 1") && text.contains("injected"),
        "{text}"
    );
    assert_eq!(server.get("/health").0, 503);
    let status = server.wait(Duration::from_secs(60));
    assert!(!status.success(), "the job ends failed: {status:?}");
    let said = server.stderr.lock().unwrap().join("\n");
    assert!(
        said.contains("rank 1 (") && said.contains("failed"),
        "{said}"
    );
}

#[test]
fn tensor_parallelism_over_ranks_is_refused() {
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(env!("CARGO_BIN_EXE_wgpar"))
        .args([
            "serve",
            "--port",
            "0",
            "--model",
            "tiny-gpt2",
            "--strategy",
            "tp",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("pp or hybrid"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_server_over_ranks_checks_each_ranks_memory_cap_before_it_listens() {
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(env!("CARGO_BIN_EXE_wgpar"))
        .args(["serve", "--port", "0", "--model", "tiny-gpt2"])
        .args(["--strategy", "pp", "--gpu-memory", "64K"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("over the ranks: rank 0 (") && err.contains("of its 64.0 KiB cap"),
        "{err}"
    );
    assert!(
        !err.contains("listening on") && !err.contains("panicked"),
        "{err}"
    );
}
