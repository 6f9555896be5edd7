//! GPT-2- and Llama-shaped checkpoints written by the tests themselves (random weights under
//! Hugging Face names, safetensors via the safetensors crate, a config.json) load to the same
//! weights and give the same logits as the synthetic-weights engine.

mod common;
mod hf_support;

use hf_support::{write_checkpoint, Store};
use wgpar::device::DType;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, SingleEngine};

/// Every vector of `a` equals `b`'s after `store`'s rounding, bit for bit.
fn assert_same_weights(a: &ModelWeights, b: &ModelWeights, store: Store) {
    let same = |x: &[f32], y: &[f32], what: &str| {
        assert_eq!(x.len(), y.len(), "{what} length");
        let bad = x
            .iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != store.round(*q).to_bits());
        assert!(bad.is_none(), "{what} differs at {bad:?}");
    };
    let opt = |x: &Option<Vec<f32>>, y: &Option<Vec<f32>>, what: &str| match (x, y) {
        (Some(x), Some(y)) => same(x, y, what),
        (None, None) => {}
        _ => panic!("{what}: present on one side only"),
    };
    assert_eq!(a.config.arch, b.config.arch);
    same(&a.wte, &b.wte, "wte");
    opt(&a.wpe, &b.wpe, "wpe");
    opt(&a.lm_head, &b.lm_head, "lm_head");
    same(&a.final_norm, &b.final_norm, "final_norm");
    opt(&a.final_norm_bias, &b.final_norm_bias, "final_norm_bias");
    opt(&a.token_types, &b.token_types, "token_types");
    opt(&a.embed_norm, &b.embed_norm, "embed_norm");
    opt(&a.embed_norm_bias, &b.embed_norm_bias, "embed_norm_bias");
    assert_eq!(a.layers.len(), b.layers.len());
    for (i, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        let w = |s: &str| format!("layer {i} {s}");
        same(&x.attn_norm, &y.attn_norm, &w("attn_norm"));
        opt(&x.attn_norm_bias, &y.attn_norm_bias, &w("attn_norm_bias"));
        same(&x.wq, &y.wq, &w("wq"));
        same(&x.wk, &y.wk, &w("wk"));
        same(&x.wv, &y.wv, &w("wv"));
        opt(&x.bq, &y.bq, &w("bq"));
        opt(&x.bk, &y.bk, &w("bk"));
        opt(&x.bv, &y.bv, &w("bv"));
        same(&x.wo, &y.wo, &w("wo"));
        opt(&x.bo, &y.bo, &w("bo"));
        same(&x.mlp_norm, &y.mlp_norm, &w("mlp_norm"));
        opt(&x.mlp_norm_bias, &y.mlp_norm_bias, &w("mlp_norm_bias"));
        opt(&x.w_gate, &y.w_gate, &w("w_gate"));
        same(&x.w_up, &y.w_up, &w("w_up"));
        opt(&x.b_up, &y.b_up, &w("b_up"));
        same(&x.w_down, &y.w_down, &w("w_down"));
        opt(&x.b_down, &y.b_down, &w("b_down"));
    }
}

/// Loads `dir` and checks its config and weights against `synthetic`.
fn load_and_compare(dir: &std::path::Path, synthetic: &ModelWeights, store: Store) -> ModelWeights {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut want = synthetic.config.clone();
    want.name = ckpt.config().name.clone();
    assert_eq!(ckpt.config(), &want);
    assert_eq!(ckpt.eos_tokens(), &[0]);
    let loaded = ckpt.weights(false).unwrap();
    assert_same_weights(&loaded, synthetic, store);
    loaded
}

/// The engine on loaded weights gives the same logits as on the synthetic ones, prefill and
/// decode, bit for bit (same f32 data, same kernels).
fn same_logits(loaded: &ModelWeights, synthetic: &ModelWeights) {
    let gpu = common::gpus(1).remove(0);
    let mut a = SingleEngine::new(gpu.clone(), loaded, DType::F32).unwrap();
    let mut b = SingleEngine::new(gpu, synthetic, DType::F32).unwrap();
    let prompts = common::prompts(2, 7, synthetic.config.vocab, 3);
    let (la, lb) = (a.prefill(&prompts).unwrap(), b.prefill(&prompts).unwrap());
    assert!(la.data.iter().any(|&v| v != 0.0));
    assert_eq!(la, lb, "prefill logits differ");
    let next = lb.argmax();
    assert_eq!(
        a.decode(&next).unwrap(),
        b.decode(&next).unwrap(),
        "decode logits differ"
    );
}

#[test]
fn gpt2_checkpoint_loads_to_the_same_model() {
    let synthetic = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 21);
    let dir = write_checkpoint("gpt2", &synthetic, Store::F32);
    let loaded = load_and_compare(&dir, &synthetic, Store::F32);
    same_logits(&loaded, &synthetic);
}

#[test]
fn gpt2_with_transformer_prefix_and_untied_head() {
    let config = ModelConfig {
        tied_head: false,
        ..ModelConfig::preset("tiny-gpt2").unwrap()
    };
    let synthetic = ModelWeights::synthetic(&config, 4);
    let dir = hf_support::scratch("gpt2-prefix");
    let mut json = hf_support::config_json(&synthetic);
    json["tie_word_embeddings"] = false.into();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let mut tensors = hf_support::gpt2_tensors(&synthetic, "transformer.");
    tensors.push((
        "lm_head.weight".into(),
        vec![config.vocab, config.hidden],
        synthetic.lm_head.clone().unwrap(),
    ));
    hf_support::write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
    let loaded = load_and_compare(&dir, &synthetic, Store::F32);
    assert!(loaded.lm_head.is_some());
}

#[test]
fn llama_checkpoint_with_gqa_and_untied_head_loads_to_the_same_model() {
    let config = ModelConfig::preset("tiny-llama").unwrap();
    assert!(config.kv_heads < config.heads && !config.tied_head);
    let synthetic = ModelWeights::synthetic(&config, 22);
    let dir = write_checkpoint("llama", &synthetic, Store::F32);
    let loaded = load_and_compare(&dir, &synthetic, Store::F32);
    same_logits(&loaded, &synthetic);
}

#[test]
fn f16_and_bf16_checkpoints_convert_exactly() {
    for store in [Store::F16, Store::Bf16] {
        for preset in ["tiny-llama", "tiny-gpt2"] {
            let synthetic = ModelWeights::synthetic(&ModelConfig::preset(preset).unwrap(), 5);
            let dir = write_checkpoint(&format!("{preset}-{store:?}"), &synthetic, store);
            load_and_compare(&dir, &synthetic, store);
        }
    }
}

#[test]
fn sharded_checkpoint_loads_from_its_index() {
    let synthetic = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 8);
    let dir = hf_support::scratch("sharded");
    std::fs::write(
        dir.join("config.json"),
        hf_support::config_json(&synthetic).to_string(),
    )
    .unwrap();
    let tensors = hf_support::llama_tensors(&synthetic);
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut map = serde_json::Map::new();
    for (part, file) in [first, second].iter().zip(names) {
        hf_support::write_safetensors(&dir.join(file), &part.to_vec(), Store::Bf16);
        for (n, _, _) in part.iter() {
            map.insert(n.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    load_and_compare(&dir, &synthetic, Store::Bf16);
}

#[test]
fn context_limit_truncates_positions() {
    let synthetic = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 9);
    let dir = write_checkpoint("gpt2-ctx", &synthetic, Store::F32);
    let mut ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(ckpt.max_context(), 96);
    ckpt.limit_context(10).unwrap();
    let w = ckpt.weights(false).unwrap();
    assert_eq!(w.config.max_seq, 10);
    assert_eq!(
        w.wpe.as_ref().unwrap()[..],
        synthetic.wpe.as_ref().unwrap()[..10 * 96]
    );
    let e = ckpt.limit_context(97).unwrap_err().to_string();
    assert!(e.contains("1..=96"), "{e}");
}

#[test]
fn llama3_rope_scaling_runs_on_the_gpu_like_the_reference() {
    use wgpar::model::{CpuReference, Llama3Scaling, RopeScaling};
    // A small original context puts tiny-llama's eight frequencies in all three bands.
    let scaling = RopeScaling::Llama3(Llama3Scaling {
        factor: 4.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 64,
    });
    let config = ModelConfig {
        rope_scaling: Some(scaling),
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let synthetic = ModelWeights::synthetic(&config, 23);
    let dir = hf_support::scratch("llama3");
    let mut json = hf_support::config_json(&synthetic);
    json["rope_scaling"] = serde_json::json!({
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    hf_support::write_safetensors(
        &dir.join("model.safetensors"),
        &hf_support::llama_tensors(&synthetic),
        Store::F32,
    );
    let loaded = load_and_compare(&dir, &synthetic, Store::F32);
    let gpu = common::gpus(1).remove(0);
    let mut engine = SingleEngine::new(gpu, &loaded, DType::F32).unwrap();
    let prompts = common::prompts(1, 40, config.vocab, 6);
    let got = engine.prefill(&prompts).unwrap();
    let want = CpuReference::new(&loaded)
        .prefill(&prompts)
        .unwrap()
        .concat();
    let err = got.relative_error(&want);
    assert!(err <= 1e-4, "relative error {err:.2e}");
    let mut plain = loaded.clone();
    plain.config.rope_scaling = None;
    let unscaled = CpuReference::new(&plain)
        .prefill(&prompts)
        .unwrap()
        .concat();
    assert!(
        got.relative_error(&unscaled) > 1e-3,
        "scaling changed nothing"
    );
}
