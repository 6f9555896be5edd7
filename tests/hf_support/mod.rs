//! Shared setup for the Hugging Face tests: scratch folders,
//! and a writer that stores `ModelWeights` under Hugging Face names as safetensors, written
//! independently of the loader (its own transposes and name tables) so the two check each other.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use wgpar::model::{Arch, ModelWeights};

/// A scratch folder, removed when dropped.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh, empty scratch folder.
pub fn scratch(name: &str) -> Scratch {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "wgpar-{name}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// How the writer stores floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Store {
    F32,
    F16,
    Bf16,
}

impl Store {
    /// What a value becomes after storing and loading.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Store::F32 => x,
            Store::F16 => half::f16::from_f32(x).to_f32(),
            Store::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            Store::F32 => Dtype::F32,
            Store::F16 => Dtype::F16,
            Store::Bf16 => Dtype::BF16,
        }
    }

    fn bytes(self, v: &[f32]) -> Vec<u8> {
        match self {
            Store::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Store::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            Store::Bf16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

/// Named tensors to write: (name, shape, values).
pub type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// `[cols][rows]` of a row-major `[rows][cols]` matrix, written out plainly.
fn flip(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// GPT-2 names (Conv1D weights input-major, Q/K/V fused).
pub fn gpt2_tensors(w: &ModelWeights, prefix: &str) -> Tensors {
    let c = &w.config;
    let (h, f) = (c.hidden, c.ffn);
    let mut t: Tensors = vec![
        (
            format!("{prefix}wte.weight"),
            vec![c.vocab, h],
            w.wte.clone(),
        ),
        (
            format!("{prefix}wpe.weight"),
            vec![c.max_seq, h],
            w.wpe.clone().unwrap(),
        ),
        (
            format!("{prefix}ln_f.weight"),
            vec![h],
            w.final_norm.clone(),
        ),
        (
            format!("{prefix}ln_f.bias"),
            vec![h],
            w.final_norm_bias.clone().unwrap(),
        ),
    ];
    for (i, l) in w.layers.iter().enumerate() {
        let n = |s: &str| format!("{prefix}h.{i}.{s}");
        let fused: Vec<f32> = [&l.wq, &l.wk, &l.wv]
            .into_iter()
            .flatten()
            .copied()
            .collect();
        let fused_bias: Vec<f32> = [&l.bq, &l.bk, &l.bv]
            .into_iter()
            .flat_map(|b| b.clone().unwrap())
            .collect();
        t.extend([
            (n("ln_1.weight"), vec![h], l.attn_norm.clone()),
            (n("ln_1.bias"), vec![h], l.attn_norm_bias.clone().unwrap()),
            (
                n("attn.c_attn.weight"),
                vec![h, 3 * h],
                flip(&fused, 3 * h, h),
            ),
            (n("attn.c_attn.bias"), vec![3 * h], fused_bias),
            (n("attn.c_proj.weight"), vec![h, h], flip(&l.wo, h, h)),
            (n("attn.c_proj.bias"), vec![h], l.bo.clone().unwrap()),
            (n("ln_2.weight"), vec![h], l.mlp_norm.clone()),
            (n("ln_2.bias"), vec![h], l.mlp_norm_bias.clone().unwrap()),
            (n("mlp.c_fc.weight"), vec![h, f], flip(&l.w_up, f, h)),
            (n("mlp.c_fc.bias"), vec![f], l.b_up.clone().unwrap()),
            (n("mlp.c_proj.weight"), vec![f, h], flip(&l.w_down, h, f)),
            (n("mlp.c_proj.bias"), vec![h], l.b_down.clone().unwrap()),
        ]);
    }
    t
}

/// Llama names (`model.` prefix, `lm_head` at the top level when untied; Qwen3's per-head
/// `q_norm` / `k_norm` where the layers have them).
pub fn llama_tensors(w: &ModelWeights) -> Tensors {
    let c = &w.config;
    let (h, f, q, kv) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim());
    let mut t: Tensors = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![c.vocab, h],
            w.wte.clone(),
        ),
        ("model.norm.weight".into(), vec![h], w.final_norm.clone()),
    ];
    if let Some(head) = &w.lm_head {
        t.push(("lm_head.weight".into(), vec![c.vocab, h], head.clone()));
    }
    for (i, l) in w.layers.iter().enumerate() {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        t.extend([
            (n("input_layernorm.weight"), vec![h], l.attn_norm.clone()),
            (n("self_attn.q_proj.weight"), vec![q, h], l.wq.clone()),
            (n("self_attn.k_proj.weight"), vec![kv, h], l.wk.clone()),
            (n("self_attn.v_proj.weight"), vec![kv, h], l.wv.clone()),
            (n("self_attn.o_proj.weight"), vec![h, q], l.wo.clone()),
            (
                n("post_attention_layernorm.weight"),
                vec![h],
                l.mlp_norm.clone(),
            ),
            (
                n("mlp.gate_proj.weight"),
                vec![f, h],
                l.w_gate.clone().unwrap(),
            ),
            (n("mlp.up_proj.weight"), vec![f, h], l.w_up.clone()),
            (n("mlp.down_proj.weight"), vec![h, f], l.w_down.clone()),
        ]);
        for (name, scale) in [("q_norm", &l.q_norm), ("k_norm", &l.k_norm)] {
            if let Some(s) = scale {
                let name = n(&format!("self_attn.{name}.weight"));
                t.push((name, vec![c.head_dim], s.clone()));
            }
        }
    }
    t
}

/// BERT names (with `prefix`, e.g. `bert.`).
pub fn bert_tensors(w: &ModelWeights, prefix: &str) -> Tensors {
    let c = &w.config;
    let (h, f) = (c.hidden, c.ffn);
    let e = |s: &str| format!("{prefix}embeddings.{s}");
    let mut t: Tensors = vec![
        (e("word_embeddings.weight"), vec![c.vocab, h], w.wte.clone()),
        (
            e("position_embeddings.weight"),
            vec![c.max_seq, h],
            w.wpe.clone().unwrap(),
        ),
        (
            e("token_type_embeddings.weight"),
            vec![c.type_vocab, h],
            w.token_types.clone().unwrap(),
        ),
        (
            e("LayerNorm.weight"),
            vec![h],
            w.embed_norm.clone().unwrap(),
        ),
        (
            e("LayerNorm.bias"),
            vec![h],
            w.embed_norm_bias.clone().unwrap(),
        ),
    ];
    for (i, l) in w.layers.iter().enumerate() {
        let n = |s: &str| format!("{prefix}encoder.layer.{i}.{s}");
        let b = |v: &Option<Vec<f32>>| v.clone().unwrap();
        t.extend([
            (n("attention.self.query.weight"), vec![h, h], l.wq.clone()),
            (n("attention.self.query.bias"), vec![h], b(&l.bq)),
            (n("attention.self.key.weight"), vec![h, h], l.wk.clone()),
            (n("attention.self.key.bias"), vec![h], b(&l.bk)),
            (n("attention.self.value.weight"), vec![h, h], l.wv.clone()),
            (n("attention.self.value.bias"), vec![h], b(&l.bv)),
            (n("attention.output.dense.weight"), vec![h, h], l.wo.clone()),
            (n("attention.output.dense.bias"), vec![h], b(&l.bo)),
            (
                n("attention.output.LayerNorm.weight"),
                vec![h],
                l.attn_norm.clone(),
            ),
            (
                n("attention.output.LayerNorm.bias"),
                vec![h],
                b(&l.attn_norm_bias),
            ),
            (n("intermediate.dense.weight"), vec![f, h], l.w_up.clone()),
            (n("intermediate.dense.bias"), vec![f], b(&l.b_up)),
            (n("output.dense.weight"), vec![h, f], l.w_down.clone()),
            (n("output.dense.bias"), vec![h], b(&l.b_down)),
            (n("output.LayerNorm.weight"), vec![h], l.mlp_norm.clone()),
            (n("output.LayerNorm.bias"), vec![h], b(&l.mlp_norm_bias)),
        ]);
    }
    t
}

/// The family's tensors under its usual names.
pub fn tensors(w: &ModelWeights) -> Tensors {
    match w.config.arch {
        Arch::Gpt2 => gpt2_tensors(w, ""),
        Arch::Llama => llama_tensors(w),
        Arch::Bert => bert_tensors(w, ""),
    }
}

/// Writes `tensors` as one safetensors file with the safetensors crate.
pub fn write_safetensors(path: &Path, tensors: &Tensors, store: Store) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            assert_eq!(s.iter().product::<usize>(), v.len(), "{n}");
            (n.clone(), s.clone(), store.bytes(v))
        })
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(store.dtype(), s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// config.json for `w`'s family and shapes.
pub fn config_json(w: &ModelWeights) -> serde_json::Value {
    let c = &w.config;
    match c.arch {
        Arch::Gpt2 => json!({
            "model_type": "gpt2", "vocab_size": c.vocab, "n_embd": c.hidden,
            "n_layer": c.layers, "n_head": c.heads, "n_positions": c.max_seq,
            "n_inner": c.ffn, "layer_norm_epsilon": c.norm_eps,
            "activation_function": "gelu_new", "eos_token_id": 0,
        }),
        Arch::Llama => json!({
            "model_type": if c.qk_norm { "qwen3" } else { "llama" },
            "vocab_size": c.vocab, "hidden_size": c.hidden,
            "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
            "intermediate_size": c.ffn,
            "max_position_embeddings": c.max_seq, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta, "tie_word_embeddings": c.tied_head,
            "hidden_act": "silu", "eos_token_id": 0,
        }),
        Arch::Bert => json!({
            "model_type": "bert", "vocab_size": c.vocab, "hidden_size": c.hidden,
            "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
            "intermediate_size": c.ffn, "max_position_embeddings": c.max_seq,
            "type_vocab_size": c.type_vocab, "layer_norm_eps": c.norm_eps,
            "hidden_act": "gelu",
        }),
    }
}

/// A whole checkpoint folder for `w`: config.json and model.safetensors.
pub fn write_checkpoint(name: &str, w: &ModelWeights, store: Store) -> Scratch {
    let dir = scratch(name);
    write_checkpoint_to(&dir, w, store);
    dir
}

/// [`write_checkpoint`] into an existing folder.
pub fn write_checkpoint_to(dir: &Path, w: &ModelWeights, store: Store) {
    std::fs::write(dir.join("config.json"), config_json(w).to_string()).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &tensors(w), store);
}

/// A word-level tokenizer.json whose tokens are `t0`, `t1`, ... (one per id), split on
/// whitespace: enough to drive text in / text out on a synthetic model.
pub fn write_word_tokenizer(dir: &Path, vocab: usize) {
    let words: serde_json::Map<String, serde_json::Value> =
        (0..vocab).map(|i| (format!("t{i}"), json!(i))).collect();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "t1"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

/// A chat template over word tokens (`tN`): BOS, ` t6` when given tools, ` t4 CONTENT` per
/// message, ` t5` to prompt.
pub const CHAT_TEMPLATE: &str =
    "{{ bos_token }}{% if tools %} t6{% endif %}{% for m in messages %} t4 {{ m.content | trim }}\
{% endfor %}{% if add_generation_prompt %} t5{% endif %}";

/// tiny-gpt2 (context 96, seed 21) with a word tokenizer (`tN` is token N) and
/// [`CHAT_TEMPLATE`] in tokenizer_config.json (BOS `t2`, EOS `t0`).
pub fn chat_checkpoint(name: &str) -> (Scratch, ModelWeights) {
    let config = wgpar::model::ModelConfig::preset("tiny-gpt2").unwrap();
    let weights = ModelWeights::synthetic(&config, 21);
    let dir = write_checkpoint(name, &weights, Store::F32);
    write_word_tokenizer(&dir, weights.config.vocab);
    let tok = json!({"chat_template": CHAT_TEMPLATE, "bos_token": "t2", "eos_token": "t0"});
    std::fs::write(dir.join("tokenizer_config.json"), tok.to_string()).unwrap();
    (dir, weights)
}
