//! BERT names to [`ModelWeights`]. The two LayerNorms of a layer follow its residual adds
//! (post-norm); they land in `attn_norm` / `mlp_norm`, which a post-norm model applies after
//! each block. The pooler and MLM head are not read: wgpar pools the token states itself.
//!
//! | wgpar | Hugging Face (optionally under `bert.`) |
//! |---|---|
//! | wte, wpe, token_types | `embeddings.{word,position,token_type}_embeddings.weight` |
//! | embed_norm | `embeddings.LayerNorm.{weight,bias}` |
//! | wq, wk, wv (+ biases) | `encoder.layer.N.attention.self.{query,key,value}.{weight,bias}` |
//! | wo, bo | `encoder.layer.N.attention.output.dense.{weight,bias}` |
//! | attn_norm | `encoder.layer.N.attention.output.LayerNorm.{weight,bias}` |
//! | w_up, b_up | `encoder.layer.N.intermediate.dense.{weight,bias}` |
//! | w_down, b_down | `encoder.layer.N.output.dense.{weight,bias}` |
//! | mlp_norm | `encoder.layer.N.output.LayerNorm.{weight,bias}` |
//!
//! Old TensorFlow conversions call the LayerNorm tensors `gamma` / `beta`; both are read.

use super::reader::Reader;
use crate::error::Result;
use crate::model::config::ModelConfig;
use crate::model::weights::{LayerWeights, ModelWeights};

/// A LayerNorm's scale and shift under `prefix` (`.weight`/`.bias` or `.gamma`/`.beta`).
fn layer_norm(r: &Reader, prefix: &str, h: usize, what: &str) -> Result<(Vec<f32>, Vec<f32>)> {
    let (scale, shift) = if !r.has(&format!("{prefix}.weight")) && r.has(&format!("{prefix}.gamma"))
    {
        ("gamma", "beta")
    } else {
        ("weight", "bias")
    };
    Ok((
        r.tensor(&format!("{prefix}.{scale}"), &[h], &format!("{what} scale"))?,
        r.tensor(&format!("{prefix}.{shift}"), &[h], &format!("{what} shift"))?,
    ))
}

/// Reads a BERT checkpoint's weights; positions beyond `config.max_seq` are dropped.
pub fn load(r: &Reader, config: &ModelConfig, positions: usize) -> Result<ModelWeights> {
    let layers = (0..config.layers)
        .map(|i| load_layer(r, config, i))
        .collect::<Result<Vec<_>>>()?;
    let h = config.hidden;
    let mut wpe = r.tensor(
        "embeddings.position_embeddings.weight",
        &[positions, h],
        "position embedding",
    )?;
    wpe.truncate(config.max_seq * h);
    let (embed_norm, embed_shift) =
        layer_norm(r, "embeddings.LayerNorm", h, "embedding LayerNorm")?;
    Ok(ModelWeights {
        config: config.clone(),
        wte: r.tensor(
            "embeddings.word_embeddings.weight",
            &[config.vocab, h],
            "token embedding",
        )?,
        wpe: Some(wpe),
        token_types: Some(r.tensor(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab, h],
            "token type embedding",
        )?),
        embed_norm: Some(embed_norm),
        embed_norm_bias: Some(embed_shift),
        layers,
        final_norm: Vec::new(),
        final_norm_bias: None,
        lm_head: None,
        tables: Default::default(),
        packed: None,
    })
}

/// Encoder layer `i`: its six biased linears, then its two LayerNorms.
fn load_layer(r: &Reader, config: &ModelConfig, i: usize) -> Result<LayerWeights> {
    let (h, f) = (config.hidden, config.ffn);
    let p = |part: &str| format!("encoder.layer.{i}.{part}");
    let what = |part: &str| format!("layer {i} {part}");
    let linear = |name: &str, rows: usize, cols: usize, part: &str| -> Result<_> {
        Ok((
            r.tensor(&p(&format!("{name}.weight")), &[rows, cols], &what(part))?,
            Some(r.tensor(
                &p(&format!("{name}.bias")),
                &[rows],
                &what(&format!("{part} bias")),
            )?),
        ))
    };
    let (wq, bq) = linear("attention.self.query", h, h, "query projection")?;
    let (wk, bk) = linear("attention.self.key", h, h, "key projection")?;
    let (wv, bv) = linear("attention.self.value", h, h, "value projection")?;
    let (wo, bo) = linear("attention.output.dense", h, h, "attention output")?;
    let (w_up, b_up) = linear("intermediate.dense", f, h, "MLP up projection")?;
    let (w_down, b_down) = linear("output.dense", h, f, "MLP down projection")?;
    let (attn_norm, attn_shift) = layer_norm(
        r,
        &p("attention.output.LayerNorm"),
        h,
        &what("attention LayerNorm"),
    )?;
    let (mlp_norm, mlp_shift) = layer_norm(r, &p("output.LayerNorm"), h, &what("MLP LayerNorm"))?;
    Ok(LayerWeights {
        attn_norm,
        attn_norm_bias: Some(attn_shift),
        wq,
        wk,
        wv,
        bq,
        bk,
        bv,
        q_norm: None,
        k_norm: None,
        attn_out_norm: None,
        mlp_out_norm: None,
        wo,
        bo,
        mlp_norm,
        mlp_norm_bias: Some(mlp_shift),
        w_gate: None,
        w_up,
        b_up,
        w_down,
        b_down,
        blocks: Default::default(),
    })
}
