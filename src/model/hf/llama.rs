//! Llama-style names to [`ModelWeights`] (Llama, Mistral, Qwen2, Qwen3). Projections are
//! PyTorch `Linear`s, already `[out][in]` as wgpar stores them.
//!
//! | wgpar | Hugging Face (under `model.`) |
//! |---|---|
//! | wte | `embed_tokens.weight` |
//! | attn_norm | `layers.N.input_layernorm.weight` |
//! | wq, wk, wv (+ optional biases) | `layers.N.self_attn.{q,k,v}_proj.{weight,bias}` |
//! | wq, wk, wv (Phi-3) | `layers.N.self_attn.qkv_proj.weight`, rows Q, then K, then V |
//! | q_norm, k_norm (Qwen3) | `layers.N.self_attn.{q,k}_norm.weight` |
//! | wo (+ optional bias) | `layers.N.self_attn.o_proj.{weight,bias}` |
//! | mlp_norm | `layers.N.post_attention_layernorm.weight` |
//! | w_gate, w_up, w_down | `layers.N.mlp.{gate,up,down}_proj.weight` |
//! | w_gate, w_up (Phi-3) | `layers.N.mlp.gate_up_proj.weight`, rows gate, then up |
//!
//! Phi-3's fused projections are split into their parts here, so tensor parallelism shards
//! each part by rows as it does separate ones (the Megatron split).
//! | final_norm | `norm.weight` |
//! | lm_head | `lm_head.weight` (top level) unless `tie_word_embeddings` |
//!
//! Gemma 3 (`sandwich_norms`) names its four norms `input_layernorm` (attn_norm),
//! `post_attention_layernorm` (attn_out_norm), `pre_feedforward_layernorm` (mlp_norm) and
//! `post_feedforward_layernorm` (mlp_out_norm), and stores every RMSNorm scale (these, the
//! head norms and the final norm) as `w` for a multiplier of `1 + w`: the loader adds the 1
//! (in f32, as Gemma3RMSNorm does), so [`ModelWeights`] always holds the multiplier.

use std::ops::Range;

use super::reader::Reader;
use crate::error::Result;
use crate::model::config::ModelConfig;
use crate::model::weights::{LayerWeights, ModelWeights};

/// Reads a Llama-style checkpoint's weights: of layers `keep` alone, the others absent.
pub fn load(r: &Reader, config: &ModelConfig, keep: &Range<usize>) -> Result<ModelWeights> {
    let h = config.hidden;
    let layers = (0..config.layers)
        .map(|i| match keep.contains(&i) {
            true => layer(r, config, i),
            false => Ok(LayerWeights::absent()),
        })
        .collect::<Result<Vec<_>>>()?;
    let lm_head = if config.tied_head {
        None
    } else {
        // transformers 4 saved Gemma3ForConditionalGeneration's head beside its text model.
        let name = match r.prefix() {
            "language_model.model." => "language_model.lm_head.weight",
            _ => "lm_head.weight",
        };
        Some(r.top_level(name, &[config.vocab, h], "LM head")?)
    };
    Ok(ModelWeights {
        config: config.clone(),
        wte: r.tensor("embed_tokens.weight", &[config.vocab, h], "token embedding")?,
        wpe: None,
        token_types: None,
        embed_norm: None,
        embed_norm_bias: None,
        layers,
        final_norm: norm_scale(config, r.tensor("norm.weight", &[h], "final RMSNorm")?),
        final_norm_bias: None,
        lm_head,
        tables: Default::default(),
        packed: None,
    })
}

/// Layer `i`'s weights.
fn layer(r: &Reader, config: &ModelConfig, i: usize) -> Result<LayerWeights> {
    let (h, f, q, kv) = (config.hidden, config.ffn, config.q_dim(), config.kv_dim());
    let p = |part: &str| format!("layers.{i}.{part}");
    let what = |part: &str| format!("layer {i} {part}");
    let attn = |proj: &str, rows: usize, cols: usize, part: &str| {
        r.tensor(
            &p(&format!("self_attn.{proj}.weight")),
            &[rows, cols],
            &what(part),
        )
    };
    // Qwen2 and Llama with attention_bias carry projection biases; plain Llama has none.
    let bias = |proj: &str, rows: usize| {
        r.optional(
            &p(&format!("self_attn.{proj}.bias")),
            &[rows],
            &what(&format!("{proj} bias")),
        )
    };
    let mlp = |proj: &str, rows: usize, cols: usize| {
        r.tensor(
            &p(&format!("mlp.{proj}.weight")),
            &[rows, cols],
            &what(&format!("MLP {proj}")),
        )
    };
    let norm = |name: &str, part: &str| {
        r.tensor(&p(&format!("{name}.weight")), &[h], &what(part))
            .map(|w| norm_scale(config, w))
    };
    let gemma = config.sandwich_norms;
    let out_norm = |name: &str, part: &str| gemma.then(|| norm(name, part)).transpose();
    let mlp_norm_name = match gemma {
        true => "pre_feedforward_layernorm",
        false => "post_attention_layernorm",
    };
    let [wq, wk, wv] = match r.has(&p("self_attn.qkv_proj.weight")) {
        true => {
            let m = attn("qkv_proj", q + 2 * kv, h, "fused QKV projection")?;
            split_rows(m, h, [q, kv, kv])
        }
        false => [
            attn("q_proj", q, h, "query projection")?,
            attn("k_proj", kv, h, "key projection")?,
            attn("v_proj", kv, h, "value projection")?,
        ],
    };
    let [w_gate, w_up] = match r.has(&p("mlp.gate_up_proj.weight")) {
        true => split_rows(mlp("gate_up_proj", 2 * f, h)?, h, [f, f]),
        false => [mlp("gate_proj", f, h)?, mlp("up_proj", f, h)?],
    };
    Ok(LayerWeights {
        attn_norm: norm("input_layernorm", "attention RMSNorm")?,
        attn_norm_bias: None,
        wq,
        wk,
        wv,
        bq: bias("q_proj", q)?,
        bk: bias("k_proj", kv)?,
        bv: bias("v_proj", kv)?,
        q_norm: head_norm(r, config, i, "q_norm")?,
        k_norm: head_norm(r, config, i, "k_norm")?,
        wo: attn("o_proj", h, q, "attention output")?,
        bo: bias("o_proj", h)?,
        attn_out_norm: out_norm("post_attention_layernorm", "attention output RMSNorm")?,
        mlp_out_norm: out_norm("post_feedforward_layernorm", "MLP output RMSNorm")?,
        mlp_norm: norm(mlp_norm_name, "MLP RMSNorm")?,
        mlp_norm_bias: None,
        w_gate: Some(w_gate),
        w_up,
        b_up: None,
        w_down: mlp("down_proj", h, f)?,
        b_down: None,
        blocks: Default::default(),
    })
}

/// Layer `i`'s Qwen3 per-head norm `name` (`q_norm`, `k_norm`): one scale of head_dim values,
/// where the config has them.
fn head_norm(r: &Reader, config: &ModelConfig, i: usize, name: &str) -> Result<Option<Vec<f32>>> {
    if !config.qk_norm {
        return Ok(None);
    }
    let heads = if name == "q_norm" { "query" } else { "key" };
    let what = format!("layer {i} {heads} head RMSNorm");
    let tensor = format!("layers.{i}.self_attn.{name}.weight");
    r.tensor(&tensor, &[config.head_dim], &what)
        .map(|w| Some(norm_scale(config, w)))
}

/// The row blocks of a `[rows][cols]` matrix, `sizes` rows each in order (a fused
/// projection's parts).
fn split_rows<const N: usize>(m: Vec<f32>, cols: usize, sizes: [usize; N]) -> [Vec<f32>; N] {
    let mut start = 0;
    sizes.map(|rows| {
        let part = m[start * cols..(start + rows) * cols].to_vec();
        start += rows;
        part
    })
}

/// An RMSNorm scale as the model multiplies by it: Gemma's checkpoints (the only family
/// here with sandwich norms) store `w` for `1 + w`.
fn norm_scale(config: &ModelConfig, mut w: Vec<f32>) -> Vec<f32> {
    if config.sandwich_norms {
        w.iter_mut().for_each(|v| *v += 1.0);
    }
    w
}
