//! RoPE as files carry it (issue 38 item 2): linear, Llama 3 and YaRN scaling from
//! `config.json` and from GGUF metadata, and GGUF `rope_freqs.weight` (Llama 3.1 / 3.2).
//! Each is checked at positions past the original context: the reference's tables against
//! frequencies this test computes from the published formulas, the device against the f64
//! reference, and the same run with the scaling off must fail the comparison. A Llama 3.1-style
//! GGUF (per-pair divisors in `rope_freqs.weight`, written by llama.cpp's `gguf` package) runs
//! token-exact against the reference on single, tensor-parallel and pipelined engines.

mod common;
mod gguf_support;
mod hf_support;

use std::f64::consts::PI;
use std::path::{Path, PathBuf};

use gguf_support::{gguf_tensors, model_meta, whole_block_llama, write_gguf, GgufSpec, GgufTensor};
use hf_support::{scratch, Store};
use serde_json::{json, Value};
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::reference::rope_tables;
use wgpar::model::{
    CpuReference, Llama3Scaling, ModelConfig, ModelWeights, RopeScaling, YarnScaling,
};
use wgpar::parallel::{
    generate, Engine, Logits, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

/// The context the scalings say the model was trained for; prompts run past it.
const ORIGINAL: usize = 64;

/// Base inverse frequencies `theta^(-2i/d)`.
fn base_freqs(c: &ModelConfig) -> Vec<f64> {
    let d = c.head_dim as f64;
    (0..c.head_dim / 2)
        .map(|i| 1.0 / (c.rope_theta as f64).powf(2.0 * i as f64 / d))
        .collect()
}

/// Llama 3 as Transformers' `_compute_llama3_parameters` writes it: by wavelength band.
fn llama3_freqs(c: &ModelConfig, s: &Llama3Scaling) -> Vec<f64> {
    let (factor, old) = (s.factor as f64, s.original_context as f64);
    let (lo, hi) = (s.low_freq_factor as f64, s.high_freq_factor as f64);
    let (low_wavelen, high_wavelen) = (old / lo, old / hi);
    base_freqs(c)
        .into_iter()
        .map(|f| {
            let wavelen = 2.0 * PI / f;
            if wavelen > low_wavelen {
                f / factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth = (old / wavelen - lo) / (hi - lo);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// llama.cpp's per-pair divisors for Llama 3 (`rope_freqs.weight`, as its converter computes
/// them): base frequency over the scaled one.
fn llama3_divisors(c: &ModelConfig, s: &Llama3Scaling) -> Vec<f32> {
    let scaled = llama3_freqs(c, s);
    base_freqs(c)
        .iter()
        .zip(&scaled)
        .map(|(b, s)| (b / s) as f32)
        .collect()
}

/// YaRN as llama.cpp's `rope_yarn` computes it: theta_interp = theta / factor, blended with
/// the unscaled theta by `ramp_mix`, cos and sin times the magnitude.
fn yarn_freqs(c: &ModelConfig, s: &YarnScaling) -> (Vec<f64>, f64) {
    let n_dims = c.head_dim as f64;
    let corr_dim = |n_rot: f64| {
        n_dims * (s.original_context as f64 / (n_rot * 2.0 * PI)).ln()
            / (2.0 * (c.rope_theta as f64).ln())
    };
    let start = corr_dim(s.beta_fast as f64).floor().max(0.0);
    let end = corr_dim(s.beta_slow as f64).ceil().min(n_dims - 1.0);
    let freq_scale = 1.0 / s.factor as f64;
    let freqs = base_freqs(c)
        .into_iter()
        .enumerate()
        .map(|(i, extrap)| {
            let y = (i as f64 - start) / (end - start).max(0.001);
            let ramp_mix = 1.0 - y.clamp(0.0, 1.0);
            freq_scale * extrap * (1.0 - ramp_mix) + extrap * ramp_mix
        })
        .collect();
    (freqs, s.attention_factor as f64)
}

fn llama3() -> Llama3Scaling {
    Llama3Scaling {
        factor: 4.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: ORIGINAL,
    }
}

/// YaRN with its defaults for factor 4: betas 32 and 1, attention factor 0.1 ln 4 + 1.
fn yarn() -> YarnScaling {
    YarnScaling {
        factor: 4.0,
        original_context: ORIGINAL,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: (1.0 + 0.1 * 4f64.ln()) as f32,
        truncate: true,
    }
}

/// Each variant, and the frequencies and magnitude the test expects of it.
fn variants(c: &ModelConfig) -> Vec<(&'static str, ModelConfig, Vec<f64>, f64)> {
    let with = |scaling: Option<RopeScaling>, factors: Option<Vec<f32>>| ModelConfig {
        rope_scaling: scaling,
        rope_freq_factors: factors,
        ..c.clone()
    };
    let linear: Vec<f64> = base_freqs(c).iter().map(|f| f / 4.0).collect();
    let (yarn_f, yarn_m) = yarn_freqs(c, &yarn());
    let divisors = llama3_divisors(c, &llama3());
    let by_file: Vec<f64> = (base_freqs(c).iter().zip(&divisors))
        .map(|(f, d)| f / *d as f64)
        .collect();
    vec![
        (
            "linear",
            with(Some(RopeScaling::Linear { factor: 4.0 }), None),
            linear,
            1.0,
        ),
        (
            "llama3",
            with(Some(RopeScaling::Llama3(llama3())), None),
            llama3_freqs(c, &llama3()),
            1.0,
        ),
        (
            "yarn",
            with(Some(RopeScaling::Yarn(yarn())), None),
            yarn_f,
            yarn_m,
        ),
        ("rope_freqs", with(None, Some(divisors)), by_file, 1.0),
    ]
}

#[test]
fn the_reference_tables_follow_the_published_formulas_past_the_original_context() {
    let c = ModelConfig::preset("tiny-llama").unwrap();
    assert!(c.max_seq > ORIGINAL + 16);
    let plain = rope_tables(&c, c.max_seq);
    let half = c.head_dim / 2;
    for (name, config, freqs, magnitude) in variants(&c) {
        config.validate().unwrap();
        let (cos, sin) = rope_tables(&config, config.max_seq);
        let mut compared = 0;
        for pos in ORIGINAL..config.max_seq {
            for (i, f) in freqs.iter().enumerate() {
                let angle = pos as f64 * f;
                let at = pos * half + i;
                assert!(
                    (cos[at] - angle.cos() * magnitude).abs() < 1e-9
                        && (sin[at] - angle.sin() * magnitude).abs() < 1e-9,
                    "{name}: position {pos}, pair {i}"
                );
                compared += 1;
            }
        }
        assert_eq!(compared, (config.max_seq - ORIGINAL) * half);
        assert_ne!(plain.0, cos, "{name} changed nothing");
    }
}

/// A folder with config.json (its `rope_scaling` set) and model.safetensors for `w`.
fn write_hf(w: &ModelWeights, rope_scaling: Value) -> hf_support::Scratch {
    let dir = scratch("rope-hf");
    let mut config = hf_support::config_json(w);
    config["rope_scaling"] = rope_scaling;
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    hf_support::write_safetensors(
        &dir.join("model.safetensors"),
        &hf_support::llama_tensors(w),
        Store::F32,
    );
    dir
}

/// A `llama` GGUF of `w` (F32) with `meta` added and `rope_freqs.weight` if given.
fn write_llama_gguf(
    dir: &Path,
    w: &ModelWeights,
    meta: Vec<Value>,
    freqs: Option<&[f32]>,
) -> PathBuf {
    let mut tensors = gguf_tensors(w, true);
    if let Some(f) = freqs {
        tensors.push(GgufTensor {
            name: "rope_freqs.weight".into(),
            shape: vec![f.len()],
            values: f.to_vec(),
            permute_heads: 0,
        });
    }
    let mut all = model_meta(w, "llama");
    all.extend(meta);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::F32,
        meta: all,
    };
    write_gguf(dir, "rope", &tensors, &spec)
}

/// Loads `path` and checks its RoPE is `want`'s.
fn load_expecting(path: &Path, want: &ModelConfig) -> ModelWeights {
    let ckpt = Checkpoint::open(path).unwrap();
    let got = ckpt.config();
    assert_eq!(
        got.rope_freq_factors,
        want.rope_freq_factors,
        "{}",
        path.display()
    );
    // RopeScaling is not Copy (LongRoPE carries its factor lists): compare by reference.
    match (&got.rope_scaling, &want.rope_scaling) {
        (Some(RopeScaling::Yarn(g)), Some(RopeScaling::Yarn(w))) => {
            let near = (g.attention_factor - w.attention_factor).abs() < 1e-6;
            assert!(near, "{g:?}");
            assert_eq!(
                YarnScaling {
                    attention_factor: 1.0,
                    ..*g
                },
                YarnScaling {
                    attention_factor: 1.0,
                    ..*w
                }
            );
        }
        (g, w) => assert_eq!(g, w, "{}", path.display()),
    }
    ckpt.weights(false).unwrap()
}

/// The single-device logits of a prefill past the original context: within 1e-4 of the
/// reference of `w`, and more than 1e-3 from the reference with the scaling off.
fn device_matches_the_scaled_reference(name: &str, w: &ModelWeights) {
    let prompts = common::prompts(2, ORIGINAL + 8, w.config.vocab, 31);
    let gpu = common::gpus(1).remove(0);
    let mut engine = SingleEngine::new(gpu, w, DType::F32).unwrap();
    let got = engine.prefill(&prompts).unwrap();
    assert!(got.data.iter().all(|v| v.is_finite()) && got.data.iter().any(|&v| v != 0.0));
    let want = CpuReference::new(w).prefill(&prompts).unwrap().concat();
    let err = got.relative_error(&want);
    assert!(err <= 1e-4, "{name}: relative error {err:.2e}");
    let mut off = w.clone();
    off.config.rope_scaling = None;
    off.config.rope_freq_factors = None;
    let unscaled = CpuReference::new(&off).prefill(&prompts).unwrap().concat();
    let wrong = got.relative_error(&unscaled);
    assert!(
        wrong > 1e-3,
        "{name}: the scaling changed the logits by {wrong:.2e} only"
    );
}

#[test]
fn each_scaling_from_config_json_runs_on_the_device_like_the_reference() {
    let c = ModelConfig::preset("tiny-llama").unwrap();
    let cases = [
        ("linear", json!({"type": "linear", "factor": 4.0})),
        (
            "llama3",
            json!({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
        ),
        (
            "yarn",
            json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
        ),
    ];
    let mut ran = 0;
    for ((name, rope), (vname, config, _, _)) in cases.into_iter().zip(variants(&c)) {
        assert_eq!(name, vname);
        let synthetic = ModelWeights::synthetic(&config, 41);
        let dir = write_hf(&synthetic, rope);
        let w = load_expecting(&dir, &config);
        device_matches_the_scaled_reference(name, &w);
        ran += 1;
    }
    assert_eq!(ran, 3);
}

#[test]
fn each_scaling_from_gguf_metadata_runs_on_the_device_like_the_reference() {
    let c = ModelConfig::preset("tiny-llama").unwrap();
    let v = variants(&c);
    let scaling = |kind: &str| json!(["llama.rope.scaling.type", "str", kind]);
    let factor = json!(["llama.rope.scaling.factor", "f32", 4.0]);
    let original = json!([
        "llama.rope.scaling.original_context_length",
        "u32",
        ORIGINAL
    ]);
    let cases: [(&str, &ModelConfig, Vec<Value>); 3] = [
        ("linear", &v[0].1, vec![scaling("linear"), factor.clone()]),
        (
            "yarn",
            &v[2].1,
            vec![scaling("yarn"), factor.clone(), original],
        ),
        ("rope_freqs", &v[3].1, vec![]),
    ];
    for (name, config, meta) in cases {
        let synthetic = ModelWeights::synthetic(config, 43);
        let dir = scratch("rope-gguf");
        let freqs = config.rope_freq_factors.as_deref();
        let w = load_expecting(&write_llama_gguf(&dir, &synthetic, meta, freqs), config);
        device_matches_the_scaled_reference(name, &w);
    }
    // "none" keeps the file's factor out of the rotation, as in llama.cpp.
    let synthetic = ModelWeights::synthetic(&c, 43);
    let dir = scratch("rope-gguf-none");
    let path = write_llama_gguf(&dir, &synthetic, vec![scaling("none"), factor], None);
    load_expecting(&path, &c);
}

#[test]
fn unsupported_rope_in_gguf_is_refused_by_name() {
    let c = ModelConfig::preset("tiny-llama").unwrap();
    let w = ModelWeights::synthetic(&c, 3);
    let cases = [
        (
            vec![json!(["llama.rope.scaling.type", "str", "longrope"])],
            None,
            "is 'longrope': supported RoPE scalings are none, linear and yarn",
        ),
        (
            vec![json!(["llama.rope.scaling.type", "str", "yarn"])],
            None,
            "'llama.rope.scaling.factor' is missing",
        ),
        (
            vec![json!([
                "llama.rope.scaling.yarn_log_multiplier",
                "f32",
                0.1
            ])],
            None,
            "'llama.rope.scaling.yarn_log_multiplier' is 0.1",
        ),
        (
            vec![json!(["llama.rope.dimension_count", "u32", 8])],
            None,
            "RoPE over part of a head",
        ),
        (
            vec![],
            Some(vec![1.0; 7]),
            "tensor 'rope_freqs.weight' has shape [7]",
        ),
        (vec![], Some(vec![-1.0; 8]), "RoPE frequency factor 0 is -1"),
    ];
    for (meta, freqs, want) in cases {
        let dir = scratch("rope-gguf-bad");
        let path = write_llama_gguf(&dir, &w, meta, freqs.as_deref());
        let e = Checkpoint::open(&path).err().expect(want).to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}

/// Greedy tokens `[batch][steps]` and each step's logits of the f64 reference.
fn reference_run(
    w: &ModelWeights,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut r = CpuReference::new(w);
    let mut tokens = vec![Vec::new(); prompts.len()];
    let mut logits = Vec::new();
    let mut rows = r.prefill(prompts).unwrap();
    for step in 0..steps {
        let next: Vec<u32> = rows
            .iter()
            .map(|r| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as u32)
            .collect();
        for (t, n) in tokens.iter_mut().zip(&next) {
            t.push(*n);
        }
        logits.push(rows.concat());
        if step + 1 < steps {
            rows = r.decode(&next).unwrap();
        }
    }
    (tokens, logits)
}

#[test]
fn a_llama31_gguf_with_rope_freqs_runs_token_exact_on_single_tp_and_pp() {
    let c = whole_block_llama();
    let divisors = llama3_divisors(&c, &llama3());
    let config = ModelConfig {
        rope_freq_factors: Some(divisors.clone()),
        ..c.clone()
    };
    let synthetic = ModelWeights::synthetic(&config, 47);
    let dir = scratch("rope-freqs-engines");
    let path = write_llama_gguf(&dir, &synthetic, vec![], Some(&divisors));
    let w = load_expecting(&path, &config);
    let (batch, steps, vocab) = (2, 6, c.vocab);
    let prompts = common::prompts(batch, ORIGINAL + 2, vocab, 5);
    let (want_tokens, want) = reference_run(&w, &prompts, steps);
    // The file's divisors are Llama 3's scaling, as the safetensors path computes it.
    let mut as_llama3 = w.clone();
    as_llama3.config.rope_freq_factors = None;
    as_llama3.config.rope_scaling = Some(RopeScaling::Llama3(llama3()));
    let (_, llama3_logits) = reference_run(&as_llama3, &prompts, 1);
    let logits = |data: &[f32]| Logits {
        batch,
        vocab,
        data: data.to_vec(),
    };
    assert!(logits(&llama3_logits[0]).relative_error(&want[0]) < 1e-6);
    let mut off = w.clone();
    off.config.rope_freq_factors = None;
    let (_, unscaled) = reference_run(&off, &prompts, 1);
    let gpus = common::gpus(2);
    let mut single = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    let first = single.prefill(&prompts).unwrap();
    assert!(first.relative_error(&want[0]) <= 1e-4);
    let wrong = first.relative_error(&unscaled[0]);
    assert!(
        wrong > 1e-3,
        "without rope_freqs the logits moved {wrong:.2e} only"
    );
    let mut engines: Vec<(&str, Box<dyn Engine>)> = vec![
        ("single", Box::new(single)),
        (
            "tp",
            Box::new(
                TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default())
                    .unwrap(),
            ),
        ),
        (
            "pp",
            Box::new(
                PipelineEngine::new(
                    &gpus,
                    &w,
                    DType::F32,
                    &Partition::Even,
                    1,
                    CommConfig::default(),
                )
                .unwrap(),
            ),
        ),
    ];
    for (name, engine) in &mut engines {
        let got = generate(engine.as_mut(), &prompts, steps).unwrap().tokens;
        assert_eq!(got, want_tokens, "{name}");
        assert!(got.iter().all(|t| t.len() == steps));
    }
}
