//! `wgpar plan`: models from config.json, long prompts, the memory check, wgpar and CUDA+NCCL
//! rows side by side, and refusals that say what to do.

mod common;

use common::{scratch_dir, wgpar};
use wgpar::compare::{plan, plan_model, PlanOptions, PlanStrategy};
use wgpar::sim::{Engine, HostProfile, NumFormat};

fn json_rows(stdout: &str) -> Vec<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(stdout)
        .unwrap_or_else(|e| panic!("{e}:\n{stdout}"))
        .as_array()
        .unwrap()
        .clone()
}

/// A Mistral-style config.json (grouped-query attention, SwiGLU), small enough to be quick.
const MISTRAL_LIKE: &str = r#"{
  "architectures": ["MistralForCausalLM"],
  "model_type": "mistral",
  "hidden_size": 1024,
  "intermediate_size": 3584,
  "num_hidden_layers": 8,
  "num_attention_heads": 16,
  "num_key_value_heads": 4,
  "vocab_size": 32000,
  "max_position_embeddings": 32768,
  "sliding_window": 4096,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "hidden_act": "silu"
}"#;

#[test]
fn plan_reads_a_config_json_and_shows_both_engines() {
    let dir = scratch_dir("plan-config");
    let file = dir.join("config.json");
    std::fs::write(&file, MISTRAL_LIKE).unwrap();
    let c = plan_model(file.to_str().unwrap()).unwrap();
    assert_eq!(
        (c.hidden, c.layers, c.kv_heads, c.max_seq),
        (1024, 8, 4, 4096)
    );
    // The folder works as well as the file.
    assert_eq!(plan_model(dir.to_str().unwrap()).unwrap().hidden, 1024);

    let (ok, stdout, stderr) = wgpar(&[
        "plan",
        "--model",
        file.to_str().unwrap(),
        "--weights",
        "q4_0",
        "--strategies",
        "single,tp2,pp2-m4",
        "--host",
        "pcie4-2gpu,dgx-a100",
        "--batches",
        "1,8",
        "--seqs",
        "64",
        "--decode-steps",
        "4",
        "--json",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let rows = json_rows(&stdout);
    // 2 profiles x 2 engines x 3 strategies x 2 batches.
    assert_eq!(rows.len(), 24);
    let find = |profile: &str, engine: &str, strategy: &str, batch: u64| {
        rows.iter()
            .find(|r| {
                r["profile"] == profile
                    && r["engine"] == engine
                    && r["strategy"] == strategy
                    && r["batch"] == batch
            })
            .unwrap_or_else(|| panic!("{profile} {engine} {strategy} {batch}"))
    };
    for r in &rows {
        assert_eq!(r["fits"], true, "{r}");
        assert!(r["decode_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["prefill_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
    // On the DGX, wgpar's all-reduces go through host memory; CUDA + NCCL uses NVLink.
    let via = |r: &serde_json::Value| r["collectives_via"].as_array().unwrap().clone();
    assert_eq!(via(find("dgx-a100", "wgpar", "tp2", 8)), ["host-staged"]);
    assert_eq!(
        via(find("dgx-a100", "CUDA+NCCL", "tp2", 8)),
        ["nccl-ring-nvlink"]
    );
    assert_eq!(via(find("pcie4-2gpu", "CUDA+NCCL", "tp2", 8)), ["nccl-shm"]);
    // f16 tensor cores and a flash kernel: CUDA+NCCL prefills faster than f32 WGSL.
    let pre = |e: &str| {
        find("dgx-a100", e, "single", 8)["prefill_ms"]
            .as_f64()
            .unwrap()
    };
    assert!(pre("CUDA+NCCL") < pre("wgpar"));

    // The Markdown table names both engines per profile and says it is modeled.
    let (ok, stdout, _) = wgpar(&[
        "plan",
        "--model",
        file.to_str().unwrap(),
        "--strategies",
        "tp2",
        "--host",
        "dgx-h100",
        "--batches",
        "1",
        "--seqs",
        "32",
    ]);
    assert!(ok);
    assert!(
        stdout.contains("Modeled (not measured)")
            && stdout.contains("| tp2 | wgpar |")
            && stdout.contains("| tp2 | CUDA+NCCL |")
            && stdout.contains("nccl-nvls"),
        "{stdout}"
    );
}

#[test]
fn long_prompts_are_refused_with_the_fix_or_modeled_when_asked() {
    let (ok, stdout, stderr) = wgpar(&[
        "plan",
        "--model",
        "llama-8b",
        "--seqs",
        "65536",
        "--batches",
        "1",
    ]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("65536") && stderr.contains("--max-seq") && stderr.contains("2048"),
        "{stderr}"
    );
    let (ok, stdout, stderr) = wgpar(&[
        "plan",
        "--model",
        "llama-8b",
        "--seqs",
        "65536",
        "--max-seq",
        "65544",
        "--batches",
        "1",
        "--strategies",
        "tp8",
        "--host",
        "dgx-h100",
        "--engines",
        "cuda-nccl",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let rows = json_rows(&stdout);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["seq"], 65536);
    assert_eq!(rows[0]["fits"], true, "{}", rows[0]);
    // A 64k-token prefill of an 8B model takes far longer than a decode step.
    let pre = rows[0]["prefill_ms"].as_f64().unwrap();
    let dec = rows[0]["decode_ms"].as_f64().unwrap();
    assert!(pre > 100.0 * dec, "{pre} vs {dec}");
}

#[test]
fn configurations_that_do_not_fit_are_marked_not_timed() {
    let config = plan_model("llama-8b").unwrap();
    let opts = PlanOptions {
        config,
        weights: NumFormat::F16,
        file_format: None,
        strategies: vec![PlanStrategy::parse("single").unwrap()],
        batches: vec![1],
        seqs: vec![128],
        profiles: vec![HostProfile::shipped("laptop-igpu-dgpu").unwrap()],
        engines: vec![Engine::shipped("cuda-nccl").unwrap()],
        decode_steps: 2,
    };
    let rows = plan(&opts).unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    // 16 GB of f16 weights on an 8 GiB laptop GPU.
    assert!(!r.fits);
    assert!(r.memory.total > r.memory.capacity);
    assert!(r.prefill_ms.is_none() && r.decode_ms.is_none() && r.request_ms.is_none());
    // 4-bit weights fit, and are timed.
    let q4 = plan(&PlanOptions {
        weights: NumFormat::Q4_0,
        ..opts.clone()
    })
    .unwrap();
    assert!(q4[0].fits && q4[0].decode_ms.is_some(), "{:?}", q4[0]);
    // Decode is memory-bound: fewer bytes per weight, a faster step than f16 on a device
    // where f16 fits.
    let big = PlanOptions {
        profiles: vec![HostProfile::shipped("dgx-h100").unwrap()],
        ..opts
    };
    let f16 = plan(&big).unwrap()[0].decode_ms.unwrap();
    let q4 = plan(&PlanOptions {
        weights: NumFormat::Q4_0,
        ..big
    })
    .unwrap()[0]
        .decode_ms
        .unwrap();
    assert!(q4 < 0.5 * f16, "{q4} vs {f16}");

    // The CLI marks it in the table.
    let (ok, stdout, stderr) = wgpar(&[
        "plan",
        "--model",
        "llama-8b",
        "--strategies",
        "single",
        "--host",
        "laptop-igpu-dgpu",
        "--batches",
        "1",
        "--seqs",
        "128",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("does not fit"), "{stdout}");
}

#[test]
fn zeros_and_impossible_models_are_refused_with_a_reason() {
    for (flag, value, needle) in [
        ("--batches", "0", "--batches"),
        ("--batches", "4,0", "--batches"),
        ("--seqs", "0", "--seqs"),
        ("--decode-steps", "0", "--decode-steps"),
        ("--devices", "0", "--devices"),
        ("--weights", "q3", "q4_0"),
        ("--strategies", "tp5x", "tpNxppP"),
        ("--engines", "tensorrt", "cuda-nccl"),
        ("--max-seq", "0", "--max-seq"),
    ] {
        let (ok, stdout, stderr) = wgpar(&["plan", flag, value]);
        assert!(!ok, "{flag} {value}: {stdout}");
        assert!(stderr.contains(needle), "{flag} {value}: {stderr}");
    }
    // tiny-llama's context (96 tokens) is shorter than the default prompts: say so.
    let (ok, stdout, stderr) = wgpar(&["plan", "--model", "tiny-llama"]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("tiny-llama") && stderr.contains("96") && stderr.contains("--seqs"),
        "{stderr}"
    );
    // ... and with prompts that fit, it has results.
    let (ok, stdout, stderr) = wgpar(&[
        "plan",
        "--model",
        "tiny-llama",
        "--seqs",
        "32",
        "--devices",
        "2",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    assert!(!json_rows(&stdout).is_empty());
    // A TP degree the heads do not divide, and a profile too small.
    let (ok, _, stderr) = wgpar(&[
        "plan",
        "--model",
        "tiny-llama",
        "--seqs",
        "8",
        "--strategies",
        "tp4",
    ]);
    assert!(
        !ok && stderr.contains("tp4") && stderr.contains("heads"),
        "{stderr}"
    );
    let (ok, _, stderr) = wgpar(&[
        "plan",
        "--strategies",
        "tp8",
        "--host",
        "pcie4-2gpu",
        "--seqs",
        "128",
    ]);
    assert!(
        !ok && stderr.contains("pcie4-2gpu") && stderr.contains("8"),
        "{stderr}"
    );
}

/// A bare shipped name means the shipped engine or profile even when the working folder holds
/// a file of that name (e.g. the `wgpar` binary copied next to one's traces); `./NAME` names
/// the file.
#[test]
fn shipped_names_win_over_files_of_that_name_in_the_working_folder() {
    let dir = scratch_dir("plan-shadowed-names");
    std::fs::write(dir.join("wgpar"), [0xff_u8, 0xfe, 0x00, 0x01]).unwrap();
    std::fs::write(dir.join("pcie4-2gpu"), "not a profile").unwrap();
    let run = |engines: &str, host: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_wgpar"))
            .current_dir(&dir)
            .args([
                "plan",
                "--model",
                "tiny-llama",
                "--strategies",
                "single",
                "--seqs",
                "32",
            ])
            .args(["--engines", engines, "--host", host, "--json"])
            .output()
            .unwrap()
    };
    let out = run("wgpar", "pcie4-2gpu");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!json_rows(&String::from_utf8_lossy(&out.stdout)).is_empty());
    // The file, when asked for by path, is read (and refused as the garbage it is).
    let out = run("./wgpar", "pcie4-2gpu");
    assert!(!out.status.success());
    let out = run("wgpar", "./pcie4-2gpu");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("pcie4-2gpu"),
        "{stderr}"
    );
}
