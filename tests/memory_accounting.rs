//! Device memory: the bytes `wgpar run` allocates on each device against the accounting's
//! prediction (within 5 %) on single, tp and pp, for f32, f16 and packed weights and a GGUF of
//! mixed block types; and `--gpu-memory` refusing a run that does not fit before any device
//! is opened, and accepting one that does.

mod common;
mod gguf_support;
mod serve_support;

use std::process::Command;
use std::time::{Duration, Instant};

use gguf_support::{gguf_tensors, model_meta, whole_block_llama, write_gguf_with, GgufSpec};
use serve_support::Server;
use wgpar::device::DType;
use wgpar::model::gguf::Gguf;
use wgpar::model::memory::{weight_bytes, FileBlocks, Vectors, WeightFormat};
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelWeights, Placement};

/// Runs `wgpar run` with the autotuner off: its timing scratch is allocated through the
/// device once per new kernel shape and counted, but is no part of a run's steady state,
/// which is what the accounting predicts. Returns (success, stdout + stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .arg("run")
        .args(args)
        .env("WGPAR_TUNE", "off")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// The (allocated, accounted) bytes of each `memory gpuN:` line.
fn memory_lines(out: &str) -> Vec<(u64, u64)> {
    out.lines()
        .filter(|l| l.starts_with("memory gpu"))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            (words[2].parse().unwrap(), words[5].parse().unwrap())
        })
        .collect()
}

/// Shapes that are neither tiles nor powers of two: an odd context, a batch of 3 split into
/// unequal micro-batches, an odd prompt.
const SHAPES: [&str; 8] = [
    "--max-seq",
    "37",
    "--batch",
    "3",
    "--prompt-len",
    "5",
    "--gen",
    "2",
];

const STRATEGIES: [(&str, &[&str], usize); 3] = [
    ("single", &["--strategy", "none"], 1),
    ("tp", &["--strategy", "tp", "--virtual", "2"], 2),
    (
        "pp",
        &["--strategy", "pp", "--virtual", "2", "--micro-batches", "2"],
        2,
    ),
];

/// Runs `model` on every strategy and checks each device's allocation against the
/// accounting; returns how many devices were compared.
fn check_model(model: &[&str]) -> usize {
    let mut compared = 0;
    for (name, strategy, devices) in STRATEGIES {
        let args: Vec<&str> = [model, &SHAPES, strategy].concat();
        let (ok, out) = run(&args);
        assert!(ok, "{name} {model:?}: {out}");
        let lines = memory_lines(&out);
        assert_eq!(lines.len(), devices, "{name} {model:?}: {out}");
        for (allocated, accounted) in lines {
            let off = (allocated as f64 - accounted as f64).abs() / accounted as f64;
            assert!(
                allocated > 0 && off <= 0.05,
                "{name} {model:?}: {allocated} B allocated, {accounted} B accounted: {out}"
            );
            compared += 1;
        }
    }
    compared
}

#[test]
fn run_allocates_what_the_accounting_predicts() {
    let mut compared = 0;
    for model in [
        &["--model", "tiny-llama"][..],
        &["--model", "tiny-llama", "--dtype", "f16"],
        &["--model", "tiny-gpt2"],
        // Qwen3's shapes: heads wider than hidden / heads, query/key norms, a tied head.
        &["--model", "tiny-qwen3"],
        // Q8_0 blocks of 32 values stay whole when tp halves the layers of `default`.
        &["--model", "default", "--weights", "q8_0"],
    ] {
        compared += check_model(model);
    }
    // 1 + 2 + 2 devices for each of the five models.
    assert_eq!(compared, 25);
}

#[test]
fn a_gguf_of_mixed_block_types_is_accounted_by_its_own_tensors() {
    let config = whole_block_llama();
    let w = ModelWeights::synthetic(&config, 53);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::Q8_0,
        meta: model_meta(&w, "llama"),
    };
    let dir = common::scratch_dir("memory-gguf-mixed");
    // The MLP down projections in Q4_0, every other matrix Q8_0, as a llama.cpp mix does.
    let file = write_gguf_with(&dir, "mixed", &gguf_tensors(&w, true), &spec, &|t| {
        t.name.contains("ffn_down").then_some(("Q4_0", None))
    });
    let gguf = Gguf::open(&file).unwrap();
    let blocks = FileBlocks::of_gguf(gguf.file(), gguf.config());
    assert_eq!(blocks.types(), vec![QuantType::Q4_0, QuantType::Q8_0]);
    let path = file.to_str().unwrap();
    assert_eq!(check_model(&["--model", path]), 5);
    // Re-packed into one type, the accounting follows --weights.
    assert_eq!(check_model(&["--model", path, "--weights", "q8_0"]), 5);
    plan_counts_the_files_own_blocks(&gguf, path);
}

/// `plan` projects the wgpar engine's memory with the file's block types, as `run` holds them,
/// not with `--weights f16` throughout.
fn plan_counts_the_files_own_blocks(gguf: &Gguf, path: &str) {
    let plan = [
        "plan",
        "--model",
        path,
        "--strategies",
        "single",
        "--host",
        "pcie4-2gpu",
        "--engines",
        "wgpar",
        "--batches",
        "1",
        "--seqs",
        "8",
    ];
    let (ok, out, err) = common::wgpar(&[&plan[..], &["--json"]].concat());
    assert!(ok, "{out}{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let planned = rows[0]["memory"]["weights"].as_u64().unwrap();
    let config = gguf.config();
    let whole = Placement::whole(config);
    let file = WeightFormat {
        dense: DType::F16,
        packed: None,
        blocks: FileBlocks::of_gguf(gguf.file(), config),
        vectors: Vectors::of_gguf(gguf.file()),
    };
    let uniform = WeightFormat::of_config(config, DType::F16, None);
    assert_eq!(planned, weight_bytes(config, &whole, &file, u64::MAX));
    assert!(planned < weight_bytes(config, &whole, &uniform, u64::MAX));
    // The markdown says what it counted.
    let (ok, out, err) = common::wgpar(&plan);
    assert!(
        ok && out.contains("the file's own layer blocks (q4_0, q8_0)"),
        "{out}{err}"
    );
}

#[test]
fn gpu_memory_refuses_what_does_not_fit_before_opening_a_device() {
    let pp = ["--strategy", "pp", "--virtual", "2", "--micro-batches", "2"];
    let started = Instant::now();
    let (ok, out) = run(&[
        &["--model", "tiny-llama", "--gpu-memory", "1M,64K"][..],
        &SHAPES,
        &pp,
    ]
    .concat());
    let took = started.elapsed();
    assert!(!ok, "{out}");
    assert!(
        out.contains("does not fit --gpu-memory")
            && out.contains("gpu0 needs")
            && out.contains("of its 1.0 MiB cap (fits)")
            && out.contains("of its 64.0 KiB cap (over)")
            && out.contains("weights ")
            && out.contains("KV cache "),
        "{out}"
    );
    // Refused before a device opened or a weight was built: no engine, no model line.
    assert!(!out.contains("engine:") && !out.contains("params"), "{out}");
    assert!(took.as_secs_f64() < 10.0, "{took:?}");
    // One size caps every device; a list must have one per device.
    let (ok, out) = run(&[
        &["--model", "tiny-llama", "--gpu-memory", "64K"][..],
        &SHAPES,
    ]
    .concat());
    assert!(!ok && out.contains("gpu0 needs"), "{out}");
    let (ok, out) = run(&[&["--gpu-memory", "1G,1G,1G"][..], &SHAPES, &pp].concat());
    assert!(!ok && out.contains("3 sizes for 2"), "{out}");
    let (ok, out) = run(&[&["--gpu-memory", "0"][..], &SHAPES].concat());
    assert!(!ok && out.contains("zero"), "{out}");
    // Enough for both stages: the run goes ahead.
    let (ok, out) = run(&[
        &["--model", "tiny-llama", "--gpu-memory", "2M,1Mi"][..],
        &SHAPES,
        &pp,
    ]
    .concat());
    assert!(ok && out.contains("decode:"), "{out}");
    assert_eq!(memory_lines(&out).len(), 2, "{out}");
}

#[test]
fn serve_compare_and_bench_check_the_cap_before_opening_a_device() {
    for command in [
        &["serve"][..],
        &["compare"],
        &["bench", "decode"],
        &["bench", "serve"],
        &["bench", "pipeline", "--stages", "2"],
    ] {
        let args = [command, &["--model", "tiny-llama", "--gpu-memory", "1K"]].concat();
        let (ok, out, err) = common::wgpar(&args);
        assert!(!ok, "{command:?}: {out}{err}");
        assert!(
            err.contains("does not fit --gpu-memory") && err.contains("of its 1.0 KiB cap (over)"),
            "{command:?}: {out}{err}"
        );
    }
}

/// Each device's (allocated) bytes of a run, and whether each is within `caps`.
fn within(out: &str, caps: &[u64]) -> bool {
    let lines = memory_lines(out);
    lines.len() == caps.len() && lines.iter().zip(caps).all(|(&(a, _), &c)| a <= c)
}

/// The layer times (ms) and query heads of `--split auto`'s note.
fn measured_split(out: &str) -> (Vec<f64>, Vec<usize>) {
    let line = (out.lines())
        .find(|l| l.contains("--split auto: a layer takes"))
        .unwrap_or_else(|| panic!("no --split auto note: {out}"));
    let times = line
        .split("takes ")
        .nth(1)
        .unwrap()
        .split(" on the")
        .next()
        .unwrap();
    let times = (times.split(", "))
        .map(|t| t.trim_end_matches(" ms").parse().unwrap())
        .collect();
    let heads = line
        .split("query heads [")
        .nth(1)
        .unwrap()
        .split(']')
        .next()
        .unwrap();
    let heads = heads.split(", ").map(|h| h.parse().unwrap()).collect();
    (times, heads)
}

#[test]
fn auto_placement_fits_the_caps_or_refuses_with_the_numbers() {
    let model = [
        "--model",
        "default",
        "--max-seq",
        "37",
        "--batch",
        "3",
        "--prompt-len",
        "5",
    ];
    let pp = [
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--layers",
        "auto",
        "--gen",
        "2",
    ];
    // The second stage, which also holds the 12 MiB LM head, has room for one layer.
    let (ok, out) = run(&[&model[..], &pp, &["--gpu-memory", "48M,24M"]].concat());
    assert!(
        ok && out.contains("caps hold at most [5, 1] layers per stage"),
        "{out}"
    );
    assert!(
        out.contains("layers [5, 1]") && within(&out, &[48 << 20, 24 << 20]),
        "{out}"
    );
    let (ok, out) = run(&[&model[..], &pp, &["--gpu-memory", "20M"]].concat());
    assert!(
        !ok && out.contains("fit no split") && out.contains("stage 1 (gpu1)"),
        "{out}"
    );
    // Tensor parallelism: by speed, within the most heads each cap holds. Both devices are
    // one adapter (equal speed), so the caps decide: 30 MiB holds 5 heads on gpu1, and 30 MiB
    // holds one on gpu0, which also holds the embedding and the 12 MiB LM head.
    let tp = [
        "--strategy",
        "tp",
        "--virtual",
        "2",
        "--split",
        "auto",
        "--gen",
        "2",
    ];
    let (ok, out) = run(&[&model[..], &tp, &["--gpu-memory", "48M,30M"]].concat());
    assert!(
        ok && out.contains("query heads [7, 5] by speed within the --gpu-memory caps"),
        "{out}"
    );
    assert!(within(&out, &[48 << 20, 30 << 20]), "{out}");
    let (ok, out) = run(&[&model[..], &tp, &["--gpu-memory", "30M,48M"]].concat());
    assert!(ok && out.contains("query heads [1, 11] by speed"), "{out}");
    assert!(within(&out, &[30 << 20, 48 << 20]), "{out}");
    let (ok, out) = run(&[&model[..], &tp, &["--gpu-memory", "20M"]].concat());
    assert!(!ok && out.contains("fits no split of its heads"), "{out}");
    // Without caps, by the measured layer times alone: even where they are within 5 %.
    let (ok, out) = run(&[&model[..], &tp].concat());
    let (times, heads) = measured_split(&out);
    assert!(ok && heads.iter().sum::<usize>() == 12, "{out}");
    assert!(out.contains(&format!("(query heads {heads:?})")), "{out}");
    let close = (times[0] - times[1]).abs() < 0.03 * times[0].min(times[1]);
    assert!(!close || heads == [6, 6], "{out}");
}

#[test]
fn serve_and_bench_serve_place_auto_on_the_devices_they_open() {
    let model = ["--model", "default", "--max-seq", "37", "--virtual", "2"];
    let tp = [
        "--strategy",
        "tp",
        "--split",
        "auto",
        "--gpu-memory",
        "48M,30M",
    ];
    let load = ["--requests", "4", "--prompt-len", "5", "--output-len", "3"];
    let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["bench", "serve", "--max-batch", "3"])
        .args([&model[..], &tp, &load].concat())
        .env("WGPAR_TUNE", "off")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("query heads [7, 5] by speed within the --gpu-memory caps")
            && stdout.contains("(query heads [7, 5])"),
        "{stdout}{stderr}"
    );
    // The server places its pipeline within the caps, then answers.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--max-batch", "2"])
        .args(model)
        .args([
            "--strategy",
            "pp",
            "--layers",
            "auto",
            "--gpu-memory",
            "48M,24M",
        ])
        .env("WGPAR_TUNE", "off");
    let mut server = Server::spawn(cmd, Duration::from_secs(120));
    let text = server.complete(r#"{"model": "default", "prompt": "t1 t2 t3", "max_tokens": 3}"#);
    assert!(!text.is_empty(), "no text");
    let said = server.stderr.lock().unwrap().join("\n");
    assert!(
        said.contains("caps hold at most [5, 1] layers per stage"),
        "{said}"
    );
    assert!(
        server.terminate(Duration::from_secs(30)).success(),
        "{said}"
    );
    // Under mpirun each rank would measure alone: auto is refused there (tests/mpi_ranks.rs).
}
