//! Phi-3 / Phi-4 (issue 37 item 3): a Llama decoder whose checkpoints fuse the query, key and
//! value projections (`qkv_proj`, GGUF `attn_qkv`) and the MLP's gate and up projections
//! (`gate_up_proj`, GGUF `ffn_up` of twice the width). The loaders split them, so tensor
//! parallelism shards each part the Megatron way: every engine (single, TP over 2, PP over 2
//! stages) on a folder and a GGUF (f32 and Q8_0) gives the CPU f64 reference's greedy tokens;
//! a split in the wrong order does not; what is not supported is refused by name.
//!
//! LongRoPE (Phi-3 128k, Phi-3.5): per-pair divisors from the short list when the served
//! context is within the original one, else from the long list, and a magnitude on cos and
//! sin. Folders in both regimes and a GGUF with `rope_factors_*` load to the parameters this
//! test derives from Transformers' formulas, the reference's tables match those formulas, every
//! engine matches the reference, and the model with the factors ignored, the magnitude off or
//! the other regime's list gives other logits.
//!
//! Partial rotary (Phi-4-mini: `partial_rotary_factor` 0.75, GGUF `rope.dimension_count`
//! below the head): RoPE turns the first `0.75 head_dim` values of each head, pairs `i` and
//! `i + rotary_dim / 2` at `theta^(-2i/rotary_dim)`, and the rest pass. A folder (factor at
//! the top level and in `rope_parameters`) and a GGUF with LongRoPE lists of `rotary_dim / 2`
//! load to that config, every engine (hybrid 2 x 2 too) matches the reference, and the model
//! rotating whole heads or spreading the frequencies over the whole head gives other logits.
//! Checked against transformers once: `tests/hf_support/phi3_partial_transformers.py`
//! (docs/MODELS.md).

mod common;
mod gguf_support;
mod hf_support;

use gguf_support::{gguf_tensors, model_meta, tensor, write_gguf, GgufSpec, GgufTensor};
use hf_support::{write_safetensors, Store};
use serde_json::{json, Value};
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::reference::rope_tables;
use wgpar::model::{CpuReference, LongRopeScaling, ModelConfig, ModelWeights, RopeScaling};
use wgpar::parallel::{
    generate_keeping, Engine, KeepLogits, Partition, PipelineEngine, SingleEngine,
    TensorParallelEngine,
};

const STEPS: usize = 5;
const BAR: f64 = 1e-4;

/// tiny-llama-like, untied as Phi-3 is: 8 heads of 16 over a stream of 128 (Phi-3's
/// config.json has no head_dim: hidden / heads), 2 KV heads, so the attention output and the
/// MLP split into whole Q8_0 blocks over two shards.
fn weights(seed: u64) -> ModelWeights {
    let config = ModelConfig {
        max_seq: 64,
        hidden: 128,
        heads: 8,
        ffn: 192,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    ModelWeights::synthetic(&config, seed)
}

/// The engine's greedy tokens and every step's logits against the reference on `w`.
fn check_engine(what: &str, engine: &mut dyn Engine, w: &ModelWeights) {
    let prompts = common::prompts(2, 6, w.config.vocab, 5);
    let mut r = CpuReference::new(w);
    let got = generate_keeping(engine, &prompts, STEPS, KeepLogits::All).unwrap();
    let mut want = r.prefill(&prompts).unwrap();
    for step in 0..STEPS {
        let g = &got.logits[step];
        let err = g.relative_error(&want.concat());
        assert!(err <= BAR, "{what} step {step}: relative error {err:.2e}");
        let next: Vec<u32> = got.tokens.iter().map(|t| t[step]).collect();
        let greedy: Vec<u32> = want.iter().map(|row| argmax(row)).collect();
        assert_eq!(
            next, greedy,
            "{what} step {step}: the reference's greedy tokens"
        );
        if step + 1 < STEPS {
            want = r.decode(&next).unwrap();
        }
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Every engine on `w`.
fn check_all(what: &str, w: &ModelWeights) {
    let gpus = common::gpus(2);
    let mut single = SingleEngine::new(gpus[0].clone(), w, DType::F32).unwrap();
    check_engine(&format!("{what} single"), &mut single, w);
    let mut tp =
        TensorParallelEngine::new(&gpus, w, DType::F32, None, CommConfig::default()).unwrap();
    check_engine(&format!("{what} tp=2"), &mut tp, w);
    let mut pp = PipelineEngine::new(
        &gpus,
        w,
        DType::F32,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    check_engine(&format!("{what} pp=2"), &mut pp, w);
}

fn phi3_config_json(w: &ModelWeights) -> Value {
    let c = &w.config;
    json!({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": c.vocab, "hidden_size": c.hidden, "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads,
        "intermediate_size": c.ffn, "max_position_embeddings": c.max_seq,
        "original_max_position_embeddings": c.max_seq, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": null, "sliding_window": null,
        "partial_rotary_factor": 1.0, "tie_word_embeddings": false, "hidden_act": "silu",
        "eos_token_id": 0,
    })
}

/// Rows of `parts` stacked in order.
fn stack(parts: &[&Vec<f32>]) -> Vec<f32> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// Phi-3's Hugging Face names: fused `qkv_proj` and `gate_up_proj` (`swap`: up before gate,
/// a wrong order).
fn phi3_hf_tensors(w: &ModelWeights, swap: bool) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let c = &w.config;
    let (h, f, q, kv) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim());
    let mut t = hf_support::llama_tensors(w);
    let fused = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"];
    t.retain(|(n, _, _)| !fused.iter().any(|p| n.contains(&format!(".{p}."))));
    for (i, l) in w.layers.iter().enumerate() {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let gate = l.w_gate.as_ref().unwrap();
        let gate_up = match swap {
            false => stack(&[gate, &l.w_up]),
            true => stack(&[&l.w_up, gate]),
        };
        t.extend([
            (
                n("self_attn.qkv_proj.weight"),
                vec![q + 2 * kv, h],
                stack(&[&l.wq, &l.wk, &l.wv]),
            ),
            (n("mlp.gate_up_proj.weight"), vec![2 * f, h], gate_up),
        ]);
    }
    t
}

fn write_folder(name: &str, w: &ModelWeights, swap: bool) -> hf_support::Scratch {
    let dir = hf_support::scratch(name);
    let json = phi3_config_json(w);
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let tensors = phi3_hf_tensors(w, swap);
    write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
    dir
}

#[test]
fn a_fused_folder_loads_split_and_runs_on_every_engine() {
    let w = weights(61);
    let dir = write_folder("phi3-hf", &w, false);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut want = w.config.clone();
    want.name = ckpt.config().name.clone();
    assert_eq!(ckpt.config(), &want);
    let loaded = ckpt.weights(false).unwrap();
    for (g, l) in loaded.layers.iter().zip(&w.layers) {
        assert!(
            g.wq == l.wq && g.wk == l.wk && g.wv == l.wv,
            "Q, K, V split"
        );
        assert!(g.w_gate == l.w_gate && g.w_up == l.w_up, "gate, up split");
    }
    check_all("folder", &loaded);
    // A fused gate/up in the other order loads, but to another model: the order matters.
    let swapped = Checkpoint::open(&write_folder("phi3-hf-swap", &w, true))
        .unwrap()
        .weights(false)
        .unwrap();
    let prompts = common::prompts(2, 6, w.config.vocab, 5);
    let gpu = common::gpus(1).remove(0);
    let got = SingleEngine::new(gpu, &swapped, DType::F32)
        .unwrap()
        .prefill(&prompts)
        .unwrap();
    let right = CpuReference::new(&w).prefill(&prompts).unwrap().concat();
    let err = got.relative_error(&right);
    assert!(
        err > 100.0 * BAR,
        "a swapped gate/up moved the logits by {err:.2e}"
    );
}

#[test]
fn what_phi3_folders_need_that_wgpar_lacks_is_refused_by_name() {
    let w = weights(62);
    let dir = write_folder("phi3-hf-bad", &w, false);
    let base = phi3_config_json(&w);
    let refused = |key: &str, value: Value, want: &str| {
        let mut j = base.clone();
        j[key] = value;
        std::fs::write(dir.join("config.json"), j.to_string()).unwrap();
        let e = Checkpoint::open(&dir).err().unwrap().to_string();
        assert!(e.contains(want), "{key}: {e}");
    };
    let longrope = json!({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]});
    refused(
        "rope_scaling",
        longrope,
        "short_factor: 1 values for head_dim 16",
    );
    refused(
        "rope_scaling",
        json!({"type": "dynamic", "factor": 2.0}),
        "type 'dynamic' is not supported",
    );
    // A partial rotary factor must give an even whole number of the head's 16 values.
    refused(
        "partial_rotary_factor",
        json!(0.7),
        "is 0.7: 0.7 x head_dim 16 = 11.2 is not an even whole number",
    );
    refused(
        "partial_rotary_factor",
        json!(0.5625),
        "= 9 is not an even whole number",
    );
    refused("partial_rotary_factor", json!(1.5), "must be in (0, 1]");
    // Transformers 5 writes it (and the base) under "rope_parameters": 1 is whole heads.
    let params =
        |f: f64| json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": f});
    refused("rope_parameters", params(0.3), "= 4.8 is not an even");
    let mut j = base.clone();
    for (f, want) in [(1.0, None), (0.75, Some(12))] {
        j["rope_parameters"] = params(f);
        std::fs::write(dir.join("config.json"), j.to_string()).unwrap();
        let c = Checkpoint::open(&dir).unwrap().config().clone();
        assert_eq!((c.head_dim, c.rope_scaling), (w.config.head_dim, None));
        assert_eq!(c.rotary_dim, want, "factor {f}");
    }
    // LongRoPE lists of the whole head's pairs for a partial rotation: one per rotated pair.
    let mut j = base.clone();
    j["partial_rotary_factor"] = json!(0.75);
    let whole_head = vec![1.0f32; 8];
    j["rope_scaling"] =
        json!({"type": "longrope", "short_factor": whole_head, "long_factor": whole_head});
    std::fs::write(dir.join("config.json"), j.to_string()).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    let want = "short_factor: 8 values for 12 rotated dimensions of head_dim 16 (needs 6)";
    assert!(e.contains(want), "{e}");
}

/// llama.cpp's phi3 tensors of `w`: fused `attn_qkv` and `ffn_up` (gate rows first), no
/// `ffn_gate`.
fn phi3_gguf_tensors(w: &ModelWeights) -> Vec<GgufTensor> {
    let c = &w.config;
    let (h, f, q, kv) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim());
    let mut t = gguf_tensors(w, false);
    let fused = ["attn_q.", "attn_k.", "attn_v.", "ffn_gate.", "ffn_up."];
    t.retain(|x| !fused.iter().any(|p| x.name.contains(p)));
    for (i, l) in w.layers.iter().enumerate() {
        let qkv = stack(&[&l.wq, &l.wk, &l.wv]);
        let gate_up = stack(&[l.w_gate.as_ref().unwrap(), &l.w_up]);
        t.push(tensor(
            format!("blk.{i}.attn_qkv.weight"),
            vec![q + 2 * kv, h],
            &qkv,
        ));
        t.push(tensor(
            format!("blk.{i}.ffn_up.weight"),
            vec![2 * f, h],
            &gate_up,
        ));
    }
    t
}

#[test]
fn fused_gguf_files_run_on_every_engine_f32_and_q8_0() {
    let w = weights(63);
    let dir = hf_support::scratch("phi3-gguf");
    for matrices in [QuantType::F32, QuantType::Q8_0] {
        let spec = GgufSpec {
            arch: "phi3",
            matrices,
            meta: model_meta(&w, "phi3"),
        };
        let file = write_gguf(&dir, "m", &phi3_gguf_tensors(&w), &spec);
        let g = Checkpoint::open(&file).unwrap();
        let mut want = w.config.clone();
        want.name = "gguf-test".into();
        assert_eq!(g.config(), &want);
        let loaded = g.weights(false).unwrap();
        if matrices == QuantType::F32 {
            let l = &loaded.layers[1];
            assert!(
                l.wk == w.layers[1].wk && l.w_up == w.layers[1].w_up,
                "split rows"
            );
        } else {
            // The fused blocks split by rows, kept packed: 7 matrices a layer.
            assert_eq!(loaded.blocks().count(), 7 * w.config.layers);
        }
        check_all(&format!("{matrices:?}"), &loaded);
    }
}

/// A LongRoPE regime: the checkpoint's context, the original one, the context served, and
/// which list that context picks.
struct Regime {
    name: &'static str,
    max_pos: usize,
    original: usize,
    served: usize,
    long: bool,
}

/// Served past the original context (long list), and a 128-token model served at its
/// original 64 (short list, the magnitude still from 128 / 64, as Transformers has it).
const REGIMES: [Regime; 2] = [
    Regime {
        name: "long",
        max_pos: 64,
        original: 16,
        served: 64,
        long: true,
    },
    Regime {
        name: "short",
        max_pos: 128,
        original: 64,
        served: 64,
        long: false,
    },
];

/// Distinct divisors for the 8 pairs of a 16-wide head, the long ones larger, as released
/// checkpoints have them.
fn longrope_lists() -> (Vec<f32>, Vec<f32>) {
    let short = (0..8).map(|i| 1.0 + 0.25 * i as f32).collect();
    let long = (0..8).map(|i| 1.0 + 0.5 * (i * i) as f32).collect();
    (short, long)
}

/// Transformers' default attention factor: sqrt(1 + ln(max_pos / original) / ln(original)).
fn magnitude(r: &Regime) -> f64 {
    let (max_pos, original) = (r.max_pos as f64, r.original as f64);
    (1.0 + (max_pos / original).ln() / original.ln()).sqrt()
}

fn longrope_weights(seed: u64, r: &Regime) -> ModelWeights {
    let (short_factor, long_factor) = longrope_lists();
    let mut w = weights(seed);
    assert_eq!(w.config.max_seq, r.served);
    w.config.rope_scaling = Some(RopeScaling::LongRope(LongRopeScaling {
        short_factor,
        long_factor,
        original_context: r.original,
        attention_factor: magnitude(r) as f32,
    }));
    w
}

/// The loaded config is `want` but for the attention factor, which must be within f32
/// rounding of it.
fn assert_longrope_config(got: &ModelConfig, want: &ModelConfig) {
    let (Some(RopeScaling::LongRope(g)), Some(RopeScaling::LongRope(w))) =
        (&got.rope_scaling, &want.rope_scaling)
    else {
        panic!("not LongRoPE: {:?}", got.rope_scaling)
    };
    let near = (g.attention_factor - w.attention_factor).abs() < 1e-6;
    assert!(
        near,
        "attention factor {} for {}",
        g.attention_factor, w.attention_factor
    );
    let mut want = want.clone();
    want.name = got.name.clone();
    want.rope_scaling = got.rope_scaling.clone();
    assert_eq!(got, &want);
    assert_eq!(
        (&g.short_factor, &g.long_factor),
        (&w.short_factor, &w.long_factor)
    );
}

/// The reference's tables against the rotation written from Transformers' formula:
/// `theta^(-2i/d) / factor_i` radians a position (`d` the rotated width), cos and sin times
/// the magnitude; `lists`: the short and long factors.
fn check_tables(c: &ModelConfig, r: &Regime, positions: usize, lists: (Vec<f32>, Vec<f32>)) {
    let (short, long) = lists;
    let list = if positions > r.original { long } else { short };
    let (cos, sin) = rope_tables(c, positions);
    assert_eq!(cos.len(), positions * list.len(), "a pair per factor");
    let m = magnitude(r);
    let d = match c.rotary_dim {
        Some(rot) => rot as f64,
        None => c.head_dim as f64,
    };
    for pos in 0..positions {
        for (i, by) in list.iter().enumerate() {
            let f = (c.rope_theta as f64).powf(-2.0 * i as f64 / d) / *by as f64;
            let at = pos * list.len() + i;
            let (wc, ws) = ((pos as f64 * f).cos() * m, (pos as f64 * f).sin() * m);
            assert!(
                (cos[at] - wc).abs() < 1e-6 && (sin[at] - ws).abs() < 1e-6,
                "{pos} {i}"
            );
        }
    }
}

fn longrope_folder(w: &ModelWeights, r: &Regime) -> hf_support::Scratch {
    let dir = hf_support::scratch(&format!("phi3-longrope-{}", r.name));
    let (short, long) = longrope_lists();
    let mut json = phi3_config_json(w);
    json["max_position_embeddings"] = json!(r.max_pos);
    json["original_max_position_embeddings"] = json!(r.original);
    // The old type name `su` in rope_scaling, and Transformers 5's rope_parameters.
    if r.long {
        json["rope_scaling"] = json!({"type": "su", "short_factor": short, "long_factor": long});
    } else {
        json["rope_parameters"] = json!({"rope_type": "longrope", "rope_theta": 10_000.0,
            "short_factor": short, "long_factor": long});
    }
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    write_safetensors(
        &dir.join("model.safetensors"),
        &phi3_hf_tensors(w, false),
        Store::F32,
    );
    dir
}

/// A change to a model's LongRoPE parameters.
type Edit = fn(&mut LongRopeScaling);

/// `w` with its LongRoPE changed by `f`: a deliberately wrong model.
fn variant(w: &ModelWeights, f: Edit) -> ModelWeights {
    let mut v = w.clone();
    let Some(RopeScaling::LongRope(s)) = &mut v.config.rope_scaling else {
        panic!("not LongRoPE")
    };
    f(s);
    v
}

/// The device running each wrong variant of `w` lands far from the reference on `w`.
fn wrong_variants_fail(w: &ModelWeights, r: &Regime) {
    let prompts = common::prompts(2, 12, w.config.vocab, 9);
    let right = CpuReference::new(w).prefill(&prompts).unwrap().concat();
    let gpu = common::gpus(1).remove(0);
    let variants: [(&str, Edit); 3] = [
        ("factors ignored", |s| {
            s.short_factor.fill(1.0);
            s.long_factor.fill(1.0);
        }),
        ("attention factor off", |s| s.attention_factor = 1.0),
        ("the other regime's list", |s| {
            std::mem::swap(&mut s.short_factor, &mut s.long_factor)
        }),
    ];
    for (what, f) in variants {
        let v = variant(w, f);
        let got = SingleEngine::new(gpu.clone(), &v, DType::F32)
            .unwrap()
            .prefill(&prompts)
            .unwrap();
        let err = got.relative_error(&right);
        assert!(
            err > 100.0 * BAR,
            "{} regime, {what}: moved the logits by {err:.2e}",
            r.name
        );
    }
}

#[test]
fn longrope_folders_run_on_every_engine_in_both_regimes() {
    for (k, r) in REGIMES.iter().enumerate() {
        let w = longrope_weights(70 + k as u64, r);
        let dir = longrope_folder(&w, r);
        let mut ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.max_context(), r.max_pos);
        ckpt.limit_context(r.served).unwrap();
        assert_longrope_config(ckpt.config(), &w.config);
        let loaded = ckpt.weights(false).unwrap();
        check_tables(&loaded.config, r, r.served, longrope_lists());
        check_all(&format!("longrope {}", r.name), &loaded);
        wrong_variants_fail(&loaded, r);
    }
}

/// llama.cpp's LongRoPE metadata for `r`; `attn`: whether the file names the magnitude.
fn longrope_meta(w: &ModelWeights, r: &Regime, attn: bool) -> Vec<Value> {
    let mut meta = model_meta(w, "phi3");
    meta.push(json!([
        "phi3.rope.scaling.original_context_length",
        "u32",
        r.original
    ]));
    if attn {
        meta.push(json!([
            "phi3.rope.scaling.attn_factor",
            "f32",
            magnitude(r)
        ]));
    }
    meta
}

#[test]
fn gguf_rope_factor_tensors_load_as_longrope() {
    let r = &REGIMES[0];
    let w = longrope_weights(72, r);
    let dir = hf_support::scratch("phi3-longrope-gguf");
    let (short, long) = longrope_lists();
    let mut t = phi3_gguf_tensors(&w);
    t.push(tensor("rope_factors_long.weight".into(), vec![8], &long));
    let spec = |attn: bool| GgufSpec {
        arch: "phi3",
        matrices: QuantType::F32,
        meta: longrope_meta(&w, r, attn),
    };
    // One list without the other is refused by name.
    let e = Checkpoint::open(&write_gguf(&dir, "half", &t, &spec(true)))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("'rope_factors_long.weight' without 'rope_factors_short.weight'"),
        "{e}"
    );
    t.push(tensor("rope_factors_short.weight".into(), vec![8], &short));
    // Without the magnitude key, the default from the context ratio.
    for attn in [false, true] {
        let g = Checkpoint::open(&write_gguf(&dir, "m", &t, &spec(attn))).unwrap();
        assert_longrope_config(g.config(), &w.config);
    }
    let mut g = Checkpoint::open(&write_gguf(&dir, "m", &t, &spec(true))).unwrap();
    let loaded = g.weights(false).unwrap();
    check_tables(&loaded.config, r, r.served, longrope_lists());
    check_all("gguf longrope", &loaded);
    // Served within the original context, the same file rotates by the short list.
    g.limit_context(r.original).unwrap();
    check_tables(g.config(), r, r.original, longrope_lists());
}

/// LongRoPE divisors for the 12 rotated pairs of a partially rotated 32-wide head.
fn partial_lists() -> (Vec<f32>, Vec<f32>) {
    let short = (0..12).map(|i| 1.0 + 0.25 * i as f32).collect();
    let long = (0..12).map(|i| 1.0 + 0.5 * (i * i) as f32).collect();
    (short, long)
}

/// Phi-4-mini's shape, smaller: 4 heads of 32 over 128 (2 KV heads), the first 24 values of
/// each head rotated (`partial_rotary_factor` 0.75), LongRoPE over those 12 pairs in the long
/// regime (64 served past an original 16).
fn partial_weights(seed: u64) -> ModelWeights {
    let r = &REGIMES[0];
    let (short_factor, long_factor) = partial_lists();
    let config = ModelConfig {
        max_seq: r.served,
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 192,
        rotary_dim: Some(24),
        rope_scaling: Some(RopeScaling::LongRope(LongRopeScaling {
            short_factor,
            long_factor,
            original_context: r.original,
            attention_factor: magnitude(r) as f32,
        })),
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    ModelWeights::synthetic(&config, seed)
}

/// A Phi-4-mini-style folder of `w`: the factor at the top level beside `rope_scaling`, or
/// (`in_params`) inside Transformers 5's `rope_parameters`, whose own value wins over the
/// top level's 1.
fn partial_folder(w: &ModelWeights, in_params: bool) -> hf_support::Scratch {
    let r = &REGIMES[0];
    let dir = hf_support::scratch(&format!("phi3-partial-{in_params}"));
    let (short, long) = partial_lists();
    let mut json = phi3_config_json(w);
    json["max_position_embeddings"] = json!(r.max_pos);
    json["original_max_position_embeddings"] = json!(r.original);
    if in_params {
        json["rope_parameters"] = json!({"rope_type": "longrope", "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.75, "short_factor": short, "long_factor": long});
    } else {
        json["partial_rotary_factor"] = json!(0.75);
        json["rope_scaling"] =
            json!({"type": "longrope", "short_factor": short, "long_factor": long});
    }
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    write_safetensors(
        &dir.join("model.safetensors"),
        &phi3_hf_tensors(w, false),
        Store::F32,
    );
    dir
}

/// A change to a partially rotated model's config.
type ConfigEdit = fn(&mut ModelConfig);

/// The short and long LongRoPE lists of `c`.
fn lists(c: &mut ModelConfig) -> [&mut Vec<f32>; 2] {
    match &mut c.rope_scaling {
        Some(RopeScaling::LongRope(s)) => [&mut s.short_factor, &mut s.long_factor],
        _ => panic!("not LongRoPE"),
    }
}

/// The device running each wrong rotation of `w` lands far from the reference on `w`: whole
/// heads turned (the lists extended by ones), and the right 24 values turned at frequencies
/// spread over the whole head (`theta^(-2i/32)`, the lists' divisors adjusted to give them).
fn partial_variants_fail(w: &ModelWeights) {
    let prompts = common::prompts(2, 12, w.config.vocab, 9);
    let right = CpuReference::new(w).prefill(&prompts).unwrap().concat();
    let gpu = common::gpus(1).remove(0);
    let variants: [(&str, ConfigEdit); 2] = [
        ("whole heads", |c| {
            c.rotary_dim = None;
            for l in lists(c) {
                l.resize(16, 1.0);
            }
        }),
        ("frequencies over the whole head", |c| {
            let theta = c.rope_theta as f64;
            for l in lists(c) {
                for (i, by) in l.iter_mut().enumerate() {
                    let i = i as f64;
                    *by *= theta.powf(-2.0 * i / 24.0 + 2.0 * i / 32.0) as f32;
                }
            }
        }),
    ];
    for (what, edit) in variants {
        let mut v = w.clone();
        edit(&mut v.config);
        v.config.validate().unwrap();
        let got = SingleEngine::new(gpu.clone(), &v, DType::F32)
            .unwrap()
            .prefill(&prompts)
            .unwrap();
        let err = got.relative_error(&right);
        assert!(err > 100.0 * BAR, "{what}: moved the logits by {err:.2e}");
    }
}

#[test]
fn partial_rotary_folders_run_on_every_engine() {
    let r = &REGIMES[0];
    let w = partial_weights(80);
    for in_params in [false, true] {
        let ckpt = Checkpoint::open(&partial_folder(&w, in_params)).unwrap();
        assert_eq!(ckpt.config().rotary_dim, Some(24), "in_params {in_params}");
        assert_longrope_config(ckpt.config(), &w.config);
    }
    let loaded = Checkpoint::open(&partial_folder(&w, false))
        .unwrap()
        .weights(false)
        .unwrap();
    check_tables(&loaded.config, r, r.served, partial_lists());
    check_all("partial rotary", &loaded);
    // Tensor parallel 2 inside each of 2 pipeline stages: the same kernels, each shard's heads.
    let gpus = common::gpus(4);
    let mut hybrid = PipelineEngine::hybrid(
        &gpus,
        &loaded,
        DType::F32,
        2,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    check_engine("partial rotary hybrid 2 x 2", &mut hybrid, &loaded);
    partial_variants_fail(&loaded);
}

#[test]
fn a_gguf_rotating_part_of_each_head_loads_and_runs() {
    let r = &REGIMES[0];
    let w = partial_weights(81);
    let dir = hf_support::scratch("phi3-partial-gguf");
    let (short, long) = partial_lists();
    let mut t = phi3_gguf_tensors(&w);
    t.push(tensor("rope_factors_short.weight".into(), vec![12], &short));
    t.push(tensor("rope_factors_long.weight".into(), vec![12], &long));
    let spec = |rotated: usize| {
        let mut meta = longrope_meta(&w, r, true);
        meta.push(json!(["phi3.rope.dimension_count", "u32", rotated]));
        GgufSpec {
            arch: "phi3",
            matrices: QuantType::F32,
            meta,
        }
    };
    let g = Checkpoint::open(&write_gguf(&dir, "m", &t, &spec(24))).unwrap();
    assert_eq!(g.config().rotary_dim, Some(24));
    assert_longrope_config(g.config(), &w.config);
    let loaded = g.weights(false).unwrap();
    check_tables(&loaded.config, r, r.served, partial_lists());
    check_all("gguf partial rotary", &loaded);
    // An odd count, one beyond the head, and the factor lists of the whole head's pairs.
    for (rotated, want) in [
        (23, "is 23: RoPE needs an even count of at most head_dim 32"),
        (34, "is 34: RoPE needs an even count"),
        (16, "tensor 'rope_factors_short.weight' has shape [12]"),
    ] {
        let e = Checkpoint::open(&write_gguf(&dir, "bad", &t, &spec(rotated)))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want), "{rotated}: {e}");
    }
}
