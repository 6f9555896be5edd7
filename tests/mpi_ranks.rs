//! wgpar as MPI ranks (`mpirun -np N wgpar ...`), end to end through the command line: the
//! ranks' adapters, PP / TP / hybrid outputs against one device, the cross-process all-reduce
//! benchmark, rank traces merged and projected, and failures. Needs `--features mpi` and
//! Open MPI's `mpirun`; CI runs it (`.ci/run`).
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
mod gguf_support;

use gguf_support::{gguf_tensors, model_meta, write_gguf, GgufSpec};
use wgpar::model::quant::QuantType;
use wgpar::model::ModelWeights;

fn wgpar() -> &'static str {
    env!("CARGO_BIN_EXE_wgpar")
}

/// The test's scratch folder, removed when the test ends: also when a rank fails and the
/// test panics on what the job printed, since the folder belongs to this process, not the ranks.
fn scratch(name: &str) -> common::ScratchDir {
    common::scratch_dir(&format!("mpi-{name}"))
}

/// `mpirun -np N wgpar ARGS` (as root where the tests run as root; oversubscribed cores).
fn mpirun(np: usize, args: &[&str]) -> Output {
    Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .arg(wgpar())
        .args(args)
        .output()
        .expect("mpirun runs (install Open MPI: openmpi-bin)")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(o: Output) -> String {
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    t
}

struct Logits {
    tokens: Vec<Vec<u32>>,
    logits: Vec<Vec<f32>>,
}

fn read_logits(path: &Path) -> Logits {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    Logits {
        tokens: serde_json::from_value(v["tokens"].clone()).unwrap(),
        logits: serde_json::from_value(v["logits"].clone()).unwrap(),
    }
}

/// Largest |a - b| over max |b| of every step. Both runs must have kept every step's logits
/// (the prefill's and each decode step's: `--gen` rows), so the comparison cannot pass empty.
fn rel_err(a: &Logits, b: &Logits) -> f64 {
    assert_eq!(a.logits.len(), b.logits.len(), "steps differ");
    assert_eq!(
        b.logits.len(),
        GEN,
        "the runs kept {} steps' logits",
        b.logits.len()
    );
    assert!(
        b.logits.iter().all(|l| !l.is_empty()),
        "an empty row of logits"
    );
    let mut worst = 0.0f64;
    for (x, y) in a.logits.iter().zip(&b.logits) {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(0.0f64, |m, v| m.max((*v as f64).abs()));
        let diff = x.iter().zip(y).fold(0.0f64, |m, (p, q)| {
            let d = (*p as f64 - *q as f64).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                m.max(d)
            }
        });
        worst = worst.max(diff / scale);
    }
    worst
}

/// Shapes of every comparison; the model comes with each case.
const SHAPE: [&str; 6] = ["--batch", "2", "--prompt-len", "8", "--gen", "3"];
/// `--gen` of [`SHAPE`]: the steps whose logits a run keeps.
const GEN: usize = 3;

fn reference(dir: &Path, model: &str) -> Logits {
    let path = dir.join(format!("single-{model}.json"));
    let o = Command::new(wgpar())
        .args(["run", "--virtual", "1", "--model", model])
        .args(SHAPE)
        .args(["--logits-out", path.to_str().unwrap()])
        .output()
        .unwrap();
    ok(o);
    read_logits(&path)
}

fn ranked(dir: &Path, name: &str, np: usize, model: &str, args: &[&str]) -> Logits {
    ranked_saying(dir, name, np, model, args).0
}

/// [`ranked`], with what the job printed.
fn ranked_saying(
    dir: &Path,
    name: &str,
    np: usize,
    model: &str,
    args: &[&str],
) -> (Logits, String) {
    let path = dir.join(format!("{name}.json"));
    let mut all: Vec<&str> = vec!["run", "--model", model];
    all.extend_from_slice(args);
    all.extend_from_slice(&SHAPE);
    all.extend_from_slice(&["--logits-out", path.to_str().unwrap()]);
    let said = ok(mpirun(np, &all));
    (read_logits(&path), said)
}

#[test]
fn devices_lists_every_rank() {
    let t = ok(mpirun(2, &["devices"]));
    assert!(t.contains("rank 0 on") && t.contains("rank 1 on"), "{t}");
    assert!(t.contains("driver:"), "{t}");
}

#[test]
fn pp_tp_and_hybrid_across_two_and_three_ranks_equal_one_device() {
    let dir = scratch("equal");
    // `default`: 6 layers, 12 query / 4 KV heads (TP over 2); `tiny-gpt2`: 6 heads (TP over 3).
    let default = reference(&dir, "default");
    let gpt2 = reference(&dir, "tiny-gpt2");
    let pp = ["--strategy", "pp"];
    let cases: [(&str, usize, &str, Vec<&str>, f64); 7] = [
        (
            "pp2",
            2,
            "default",
            [&pp[..], &["--virtual", "1"]].concat(),
            1e-5,
        ),
        // Two stages per rank: in-process hand-offs and one between ranks, two micro-batches.
        (
            "pp2x2",
            2,
            "default",
            [&pp[..], &["--virtual", "2", "--micro-batches", "2"]].concat(),
            1e-5,
        ),
        (
            "pp3",
            3,
            "default",
            [&pp[..], &["--virtual", "1", "--micro-batches", "2"]].concat(),
            1e-5,
        ),
        (
            "tp2",
            2,
            "default",
            vec!["--strategy", "tp", "--virtual", "1"],
            1e-4,
        ),
        (
            "tp3",
            3,
            "tiny-gpt2",
            vec!["--strategy", "tp", "--virtual", "1"],
            1e-4,
        ),
        (
            "hybrid2",
            2,
            "default",
            vec![
                "--strategy",
                "hybrid",
                "--tp",
                "2",
                "--virtual",
                "2",
                "--micro-batches",
                "2",
            ],
            1e-4,
        ),
        (
            "hybrid3",
            3,
            "default",
            vec!["--strategy", "hybrid", "--tp", "2", "--virtual", "2"],
            1e-4,
        ),
    ];
    for (name, np, model, args, tol) in cases {
        let single = if model == "default" { &default } else { &gpt2 };
        let got = ranked(&dir, name, np, model, &args);
        let err = rel_err(&got, single);
        assert!(err <= tol, "{name}: relative error {err:e} > {tol:e}");
        assert_eq!(got.tokens, single.tokens, "{name}: generated tokens differ");
    }
}

/// A GGUF whose layer matrices are Q8_0 blocks (kept as stored on the device) runs over ranks
/// as on one device: pipeline stages each upload their own layers' blocks, tensor parallelism
/// splits them on block boundaries.
#[test]
fn a_gguf_on_its_own_blocks_runs_over_ranks_as_on_one_device() {
    let dir = scratch("gguf");
    let config = gguf_support::whole_block_llama();
    let w = ModelWeights::synthetic(&config, 61);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::Q8_0,
        meta: model_meta(&w, "llama"),
    };
    let file = write_gguf(&dir, "q8", &gguf_tensors(&w, true), &spec);
    let file = file.to_str().unwrap();
    let single = reference(&dir, file);
    // What each rank holds on its host: a pipeline rank its own stage's layers alone (the
    // tables and norms too), a tensor-parallel rank every layer.
    let ckpt = wgpar::model::hf::Checkpoint::open(Path::new(file)).unwrap();
    let layers = config.layers;
    let held = |keep: std::ops::Range<usize>| {
        let w = ckpt.weights_of_layers(false, keep.clone()).unwrap();
        let bytes = wgpar::error::human_bytes(w.host_bytes());
        format!("{bytes} (layers {}..{})", keep.start, keep.end)
    };
    let half = layers / 2;
    let pp = format!(
        "host weights by rank: {}, {}",
        held(0..half),
        held(half..layers)
    );
    let tp = format!(
        "host weights by rank: {}, {}",
        held(0..layers),
        held(0..layers)
    );
    assert_ne!(held(0..half), held(0..layers));
    for (name, args, host) in [
        ("gguf-pp2", ["--strategy", "pp", "--virtual", "1"], pp),
        ("gguf-tp2", ["--strategy", "tp", "--virtual", "1"], tp),
    ] {
        let (got, said) = ranked_saying(&dir, name, 2, file, &args);
        assert!(said.contains("the file's q8_0 blocks"), "{name}: {said}");
        assert!(said.contains(&host), "{name}: {host} in {said}");
        let err = rel_err(&got, &single);
        assert!(err <= 1e-4, "{name}: relative error {err:e}");
        assert_eq!(got.tokens, single.tokens, "{name}: generated tokens differ");
    }
}

/// A Qwen3 GGUF (per-head query/key norms, heads wider than hidden / heads, a tied head, Q8_0
/// layers) runs over ranks as on one device: pipeline, tensor-parallel and hybrid.
#[test]
fn a_qwen3_gguf_runs_over_ranks_as_on_one_device() {
    let dir = scratch("qwen3");
    let config = wgpar::model::ModelConfig::preset("tiny-qwen3").unwrap();
    assert!(config.qk_norm && config.q_dim() != config.hidden);
    let w = ModelWeights::synthetic(&config, 62);
    let spec = GgufSpec {
        arch: "qwen3",
        matrices: QuantType::Q8_0,
        meta: model_meta(&w, "qwen3"),
    };
    let file = write_gguf(&dir, "qwen3", &gguf_tensors(&w, false), &spec);
    let file = file.to_str().unwrap();
    let single = reference(&dir, file);
    let hybrid = ["--strategy", "hybrid", "--tp", "2", "--virtual", "2"];
    for (name, args) in [
        ("qwen3-pp2", &["--strategy", "pp", "--virtual", "1"][..]),
        ("qwen3-tp2", &["--strategy", "tp", "--virtual", "1"]),
        ("qwen3-hybrid2", &hybrid),
    ] {
        let got = ranked(&dir, name, 2, file, args);
        let err = rel_err(&got, &single);
        assert!(err <= 1e-4, "{name}: relative error {err:e}");
        assert_eq!(got.tokens, single.tokens, "{name}: generated tokens differ");
    }
}

/// A Gemma 3 GGUF (sliding-window layers with their own RoPE base, sandwich norms, GeGLU,
/// scaled embeddings, Q8_0 layers) runs over ranks as on one device: pipeline (one stage
/// holding only sliding layers), tensor-parallel and hybrid.
#[test]
fn a_gemma3_gguf_runs_over_ranks_as_on_one_device() {
    let dir = scratch("gemma3");
    let config = wgpar::model::ModelConfig {
        hidden: 128,
        head_dim: 32,
        ffn: 256,
        layers: 4,
        embed_scale: Some(128f32.sqrt()),
        attn_scale: Some(1.0 / 32f32.sqrt()),
        ..wgpar::model::ModelConfig::preset("tiny-gemma3").unwrap()
    };
    let config = wgpar::model::ModelConfig {
        sliding: config.sliding.clone().map(|mut s| {
            s.layers = (0..4).map(|i| (i + 1) % 3 != 0).collect();
            s
        }),
        ..config
    };
    let w = ModelWeights::synthetic(&config, 63);
    let spec = GgufSpec {
        arch: "gemma3",
        matrices: QuantType::Q8_0,
        meta: gguf_support::gemma3_meta(&w),
    };
    let file = write_gguf(&dir, "gemma3", &gguf_support::gemma3_tensors(&w), &spec);
    let file = file.to_str().unwrap();
    let single = reference(&dir, file);
    let hybrid = ["--strategy", "hybrid", "--tp", "2", "--virtual", "2"];
    for (name, args) in [
        ("gemma3-pp2", &["--strategy", "pp", "--virtual", "1"][..]),
        ("gemma3-tp2", &["--strategy", "tp", "--virtual", "1"]),
        ("gemma3-hybrid2", &hybrid),
    ] {
        let got = ranked(&dir, name, 2, file, args);
        let err = rel_err(&got, &single);
        assert!(err <= 1e-4, "{name}: relative error {err:e}");
        assert_eq!(got.tokens, single.tokens, "{name}: generated tokens differ");
    }
}

/// Open MPI binds each of two ranks to one core: a rank whose adapter is a CPU driver (whose
/// worker threads then share that core) says so and names the remedy; unbound, it does not.
#[test]
fn a_rank_bound_to_a_core_with_a_cpu_driver_is_warned() {
    let launch = |bind: &str| {
        Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", bind])
            .args(["-np", "2"])
            .arg(wgpar())
            .args(["allreduce", "-b", "8", "-e", "8", "-n", "1", "-w", "0"])
            .output()
            .expect("mpirun runs")
    };
    let free = ok(launch("none"));
    assert!(!free.contains("warning: rank"), "{free}");
    let devices = Command::new(wgpar())
        .args(["devices", "--json"])
        .output()
        .unwrap();
    let list: serde_json::Value = serde_json::from_slice(&devices.stdout).unwrap();
    let cpu_driver = list[0]["device_type"] == "Cpu";
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bound = ok(launch("core"));
    if cpu_driver && cores >= 2 {
        for rank in 0..2 {
            let line = format!("warning: rank {rank} (");
            assert!(bound.contains(&line), "{bound}");
        }
        assert!(bound.contains("mpirun --bind-to none"), "{bound}");
    } else {
        assert!(!bound.contains("warning: rank"), "{bound}");
    }
}

#[test]
fn allreduce_benchmark_checks_every_size_and_reports_its_floor() {
    let t = ok(mpirun(
        2,
        &[
            "allreduce",
            "-b",
            "8",
            "-e",
            "2M",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "1",
            "--chunk",
            "512K",
        ],
    ));
    assert!(t.contains("Out of bounds values : 0 OK"), "{t}");
    assert!(t.contains("x floor") && t.contains("Rank  1"), "{t}");
    // 2 MiB runs in 512 KiB chunks: pipelined.
    let row = t
        .lines()
        .find(|l| l.trim_start().starts_with("2097152"))
        .unwrap_or_else(|| panic!("{t}"));
    assert!(row.split_whitespace().nth(4) == Some("4"), "{row}");
    let t = ok(mpirun(
        2,
        &[
            "allreduce",
            "-b",
            "1K",
            "-e",
            "64K",
            "-n",
            "2",
            "-w",
            "1",
            "--link",
            "f16",
        ],
    ));
    assert!(
        t.contains("Out of bounds values : 0 OK") && t.contains("link F16"),
        "{t}"
    );
    let bad = mpirun(2, &["allreduce", "--op", "allgather"]);
    assert!(!bad.status.success());
    assert!(
        text(&bad).contains("not supported across MPI ranks"),
        "{}",
        text(&bad)
    );
}

#[test]
fn rank_traces_merge_and_project_onto_one_or_two_nodes() {
    let dir = scratch("trace");
    let trace = dir.join("run.json");
    let t = ok(mpirun(
        2,
        &[
            "run",
            "--strategy",
            "pp",
            "--virtual",
            "1",
            "--micro-batches",
            "2",
            "--model",
            "tiny-llama",
            "--batch",
            "2",
            "--prompt-len",
            "8",
            "--gen",
            "3",
            "--trace",
            trace.to_str().unwrap(),
        ],
    ));
    let r0 = dir.join("run.rank0.json");
    let r1 = dir.join("run.rank1.json");
    assert!(r0.exists() && r1.exists(), "{t}");
    for host in ["pcie4-2gpu", "2node-ib200"] {
        let o = Command::new(wgpar())
            .args([
                "project",
                "--trace",
                r0.to_str().unwrap(),
                "--trace",
                r1.to_str().unwrap(),
                "--host",
                host,
                "--json",
            ])
            .output()
            .unwrap();
        let t = ok(o);
        assert!(t.contains("projected"), "{t}");
    }
    // The merged trace keeps the loop back from the last rank to the first: each micro-batch's
    // picks arrive on rank 0 (a span there that depends on the last rank's output), and rank
    // 0's next pass of that micro-batch waits for the arrival. Without it a projection lets
    // rank 0 run ahead of the tokens it embeds.
    let merged = dir.join("merged.json");
    ok(Command::new(wgpar())
        .args([
            "project",
            "--trace",
            r0.to_str().unwrap(),
            "--trace",
            r1.to_str().unwrap(),
            "--host",
            "pcie4-2gpu",
            "--merged-out",
            merged.to_str().unwrap(),
        ])
        .output()
        .unwrap());
    let m = wgpar::trace::Timeline::read_chrome_trace(&merged).unwrap();
    let by_id: std::collections::HashMap<_, _> = m.spans.iter().map(|s| (s.id, s)).collect();
    let arrivals: Vec<_> = m
        .spans
        .iter()
        .filter(|s| s.name == "mpi recv logits")
        .collect();
    let outputs = m
        .spans
        .iter()
        .filter(|s| s.name == "tokens" && s.device == Some(1))
        .count();
    assert!(outputs > 0);
    assert_eq!(arrivals.len(), outputs, "one arrival per last-rank output");
    // Decoding greedily, rank 0 needs only the picks: 8 bytes per sequence (token and
    // non-finite count) for each decode step's micro-batch of one; the prefill's arrivals
    // carry the logits too, which `run` asks for.
    let picks_only = arrivals.iter().filter(|a| a.bytes == 8).count();
    let with_logits = arrivals.iter().filter(|a| a.bytes == 8 + 4 * 389).count();
    assert_eq!(
        (picks_only, with_logits),
        (arrivals.len() - 2, 2),
        "{:?}",
        arrivals.iter().map(|a| a.bytes).collect::<Vec<_>>()
    );
    for a in &arrivals {
        assert!(
            a.deps.iter().any(|d| by_id[d].device == Some(1)),
            "arrival {:?} does not depend on the last rank: {:?}",
            a.id,
            a.deps
        );
    }
    let waiting = m
        .spans
        .iter()
        .filter(|s| s.device == Some(0) && s.kind == wgpar::trace::SpanKind::Compute)
        .filter(|s| s.deps.iter().any(|d| arrivals.iter().any(|a| a.id == *d)))
        .count();
    assert!(
        waiting >= arrivals.len() / 2,
        "{waiting} of rank 0's passes wait for the {} arrivals",
        arrivals.len()
    );
    // One rank's trace alone is not the run.
    let o = Command::new(wgpar())
        .args([
            "project",
            "--trace",
            r1.to_str().unwrap(),
            "--host",
            "pcie4-2gpu",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("rank 1 of a 2-rank run"), "{}", text(&o));
}

#[test]
fn calibrate_under_mpirun_writes_one_profile_that_projects_rank_traces() {
    let dir = scratch("calibrate");
    let profile = dir.join("ranks.toml");
    let small = ["--model", "tiny-llama", "--batch", "2", "--prompt-len", "8"];
    let mut args = vec!["calibrate", "--quick", "--out", profile.to_str().unwrap()];
    args.extend(small);
    let t = ok(mpirun(2, &args));
    assert!(t.contains("sharing between processes"), "{t}");
    assert!(t.contains("MPI send between ranks on this host"), "{t}");
    let written = std::fs::read_to_string(&profile).unwrap();
    assert!(
        written.contains("# calibrated under mpirun: 2 ranks on 1 host(s)"),
        "{written}"
    );
    // One node whose two devices are the ranks' devices, sharing the processor between the
    // two processes, with one measured slowdown per busy count.
    let p = wgpar::sim::HostProfile::load(&profile).unwrap();
    assert_eq!((p.nodes, p.device_count()), (1, 2), "{written}");
    let sharing = p.devices[0]
        .compute_sharing
        .as_ref()
        .expect("sharing measured");
    assert_eq!(sharing.shared_by, 2);
    assert_eq!(sharing.slowdown.len(), 2);
    assert!(sharing.slowdown[1] >= 1.0 && sharing.slowdown[1].is_finite());
    assert!(!sharing.slowdown_curve.is_empty());
    assert!(p.devices[0].rates.matmul_gflops.is_some_and(|g| g > 0.0));

    // Two rank traces of a pipeline over the same two ranks project onto it.
    let trace = dir.join("run.json");
    let mut run = vec![
        "run",
        "--strategy",
        "pp",
        "--virtual",
        "1",
        "--micro-batches",
        "2",
        "--gen",
        "3",
        "--trace",
        trace.to_str().unwrap(),
    ];
    run.extend(small);
    ok(mpirun(2, &run));
    let o = Command::new(wgpar())
        .args([
            "project",
            "--trace",
            dir.join("run.rank0.json").to_str().unwrap(),
            "--trace",
            dir.join("run.rank1.json").to_str().unwrap(),
            "--host",
            profile.to_str().unwrap(),
            "--json",
        ])
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let ratio = v["projected_over_measured"].as_f64().unwrap();
    assert!(ratio.is_finite() && ratio > 0.0, "{t}");
}

#[test]
fn projection_benchmark_runs_and_calibrates_as_ranks() {
    // `bench projection --ranks 2`: the calibration and every run under the launcher, the
    // rank traces merged and projected onto each round's profile.
    let dir = scratch("bench-projection");
    let out = Command::new(wgpar())
        .args([
            "bench",
            "projection",
            "--ranks",
            "2",
            "--launcher",
            "mpirun --allow-run-as-root --oversubscribe",
            "--quick",
            "--rounds",
            "1",
            "--model",
            "tiny-gpt2",
            "--batch",
            "2",
            "--prompt-len",
            "8",
            "--gen",
            "2",
            "--configs",
            "pp2-m2",
            "--json",
            "--out-dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["ranks"], 2, "{t}");
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{t}");
    let pair = &rows[0]["pairs"][0];
    assert!(pair["measured_ms"].as_f64().unwrap() > 0.0, "{t}");
    assert!(pair["projected_ms"].as_f64().unwrap() > 0.0, "{t}");
    // The profile came from `calibrate` under mpirun, the traces from both ranks.
    let cal = std::fs::read_to_string(dir.join("cal0.toml")).unwrap();
    assert!(cal.contains("calibrated under mpirun: 2 ranks"), "{cal}");
    for r in 0..2 {
        assert!(dir
            .join(format!("tiny-gpt2_2x8.pp2-m2.r0.rank{r}.json"))
            .exists());
    }
    // A configuration that cannot spread over the ranks is refused before anything runs.
    let refused = Command::new(wgpar())
        .args(["bench", "projection", "--ranks", "2", "--configs", "single"])
        .output()
        .unwrap();
    let t = text(&refused);
    assert!(!refused.status.success(), "{t}");
    assert!(t.contains("one device is one process"), "{t}");
}

#[test]
fn calibrate_ranks_must_agree_on_what_they_measure() {
    let dir = scratch("calibrate-mismatch");
    let out = dir.join("x.toml");
    let o = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "1"])
        .arg(wgpar())
        .args([
            "calibrate",
            "--quick",
            "--model",
            "tiny-llama",
            "--batch",
            "2",
        ])
        .args(["--out", out.to_str().unwrap()])
        .args([":", "-np", "1"])
        .arg(wgpar())
        .args([
            "calibrate",
            "--quick",
            "--model",
            "tiny-llama",
            "--batch",
            "4",
        ])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o).contains("ranks disagree: calibration options"),
        "{}",
        text(&o)
    );
    assert!(!out.exists(), "no profile from ranks that disagree");
}

/// Runs a job in which one rank fails; every rank must be gone, the launcher non-zero, the
/// failure named, all well within the timeout.
fn fails(np: usize, args: &[&str], fault: &str, expect: &[&str]) {
    let dir = scratch(&format!("fault-{}", fault.replace(':', "-")));
    let marker = dir.join("marker.json");
    let mut all: Vec<&str> = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&[
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--gen",
        "4",
        "--mpi-timeout",
        "8",
        "--mpi-fault",
        fault,
    ]);
    all.extend_from_slice(&["--logits-out", marker.to_str().unwrap()]);
    let start = Instant::now();
    let o = mpirun(np, &all);
    let took = start.elapsed();
    let t = text(&o);
    assert!(!o.status.success(), "{fault}: the job succeeded\n{t}");
    for e in expect {
        assert!(t.contains(e), "{fault}: no '{e}' in\n{t}");
    }
    // Generous: start-up and weights plus the 8 s timeout; a hang would take far longer.
    assert!(
        took < Duration::from_secs(90),
        "{fault}: took {took:?}\n{t}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let left = Command::new("pgrep")
        .args(["-f", marker.to_str().unwrap()])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&left.stdout).into_owned();
    // Ranks left behind are this job's (their command line holds this test's own marker
    // path): stop them before failing, so the failure leaves nothing running.
    for pid in left.split_whitespace() {
        let _ = Command::new("kill").args(["-KILL", pid]).status();
    }
    assert!(left.is_empty(), "{fault}: processes left: {left}");
}

#[test]
fn a_failing_rank_stops_every_rank_and_is_named() {
    let pp = [
        "--model",
        "tiny-llama",
        "--strategy",
        "pp",
        "--virtual",
        "1",
    ];
    let tp = [
        "--model",
        "tiny-llama",
        "--strategy",
        "tp",
        "--virtual",
        "1",
    ];
    // An error in rank 1's stage: rank 0 stops naming rank 1.
    fails(
        2,
        &pp,
        "1:error",
        &["injected error fault", "rank 1 (", "failed"],
    );
    // A panic on rank 0 of a tensor-parallel job: rank 1 stops naming rank 0.
    fails(2, &tp, "0:panic", &["injected panic", "rank 0 ("]);
    // Three ranks, the middle one fails: both others stop.
    let pp3 = [
        "--model",
        "default",
        "--strategy",
        "pp",
        "--virtual",
        "1",
        "--micro-batches",
        "2",
    ];
    fails(3, &pp3, "1:error:1", &["injected error fault", "rank 1 ("]);
    // Killed: the launcher ends the job and names the rank.
    fails(2, &pp, "1:kill:0", &["rank 1"]);
    // Hung (stopped): the peer's receive times out, naming the rank it waited for.
    fails(2, &pp, "1:hang:0", &["nothing from rank 1 within"]);
}

#[test]
fn options_that_do_not_apply_across_ranks_are_refused() {
    let o = mpirun(
        2,
        &[
            "run",
            "--strategy",
            "tp",
            "--virtual",
            "2",
            "--model",
            "tiny-llama",
        ],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("one device per rank"), "{}", text(&o));
    let o = mpirun(2, &["run", "--model", "tiny-llama"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("--strategy none is not supported across MPI ranks"),
        "{}",
        text(&o)
    );
    let o = mpirun(2, &["compare"]);
    assert!(!o.status.success());
    // Each rank would measure its own device alone.
    let args = [
        "run",
        "--strategy",
        "pp",
        "--layers",
        "auto",
        "--model",
        "tiny-llama",
    ];
    let o = mpirun(2, &args);
    assert!(!o.status.success());
    assert!(text(&o).contains("not taken under mpirun"), "{}", text(&o));
}

#[test]
fn gpu_memory_is_checked_per_rank_before_any_rank_opens_its_device() {
    let run = [
        "run",
        "--model",
        "default",
        "--max-seq",
        "37",
        "--batch",
        "3",
        "--prompt-len",
        "5",
        "--gen",
        "2",
        "--strategy",
        "pp",
        "--layers",
        "5,1",
    ];
    // The last stage holds one layer and the 12 MiB LM head: 24 MiB holds it.
    let out = ok(mpirun(
        2,
        &[&run[..], &["--gpu-memory", "48M,24M"]].concat(),
    ));
    assert!(out.contains("first sequence's tokens"), "{out}");
    // 20 MiB holds neither rank's share: every rank refuses, naming each, before opening.
    let started = std::time::Instant::now();
    let o = mpirun(2, &[&run[..], &["--gpu-memory", "20M"]].concat());
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("does not fit --gpu-memory over the ranks")
            && t.contains("rank 0 (")
            && t.contains("rank 1 (")
            && t.contains("of its 20.0 MiB cap"),
        "{t}"
    );
    assert!(!t.contains("first sequence's tokens"), "{t}");
    // Only the second rank is over its cap: the refusal names it alone.
    let o = mpirun(2, &[&run[..], &["--gpu-memory", "48M,12M"]].concat());
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    let named: Vec<&str> = (t.split("over the ranks: ").skip(1))
        .map(|rest| rest.split(". Lower").next().unwrap())
        .collect();
    assert!(!named.is_empty(), "{t}");
    for ranks in named {
        assert!(
            ranks.starts_with("rank 1 (") && !ranks.contains("rank 0 ("),
            "{t}"
        );
    }
    eprintln!("refusals took {:?}", started.elapsed());
}
