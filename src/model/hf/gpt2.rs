//! GPT-2 names to [`ModelWeights`]. GPT-2 stores its projections as Conv1D, input-major
//! (`[in][out]`), and fuses Q, K and V into one `c_attn`; both are undone here.
//!
//! | wgpar | Hugging Face (optionally under `transformer.`) |
//! |---|---|
//! | wte, wpe | `wte.weight`, `wpe.weight` |
//! | attn_norm | `h.N.ln_1.{weight,bias}` |
//! | wq, wk, wv (+ biases) | `h.N.attn.c_attn.{weight,bias}`, split in three |
//! | wo, bo | `h.N.attn.c_proj.{weight,bias}` |
//! | mlp_norm | `h.N.ln_2.{weight,bias}` |
//! | w_up, b_up | `h.N.mlp.c_fc.{weight,bias}` |
//! | w_down, b_down | `h.N.mlp.c_proj.{weight,bias}` |
//! | final_norm | `ln_f.{weight,bias}` |
//! | lm_head | `lm_head.weight` when untied |

use std::ops::Range;

use super::reader::{transpose, Reader};
use crate::error::Result;
use crate::model::config::ModelConfig;
use crate::model::weights::{LayerWeights, ModelWeights};

/// Reads a GPT-2 checkpoint's weights; positions beyond `config.max_seq` are dropped.
pub fn load(
    r: &Reader,
    config: &ModelConfig,
    positions: usize,
    keep: &Range<usize>,
) -> Result<ModelWeights> {
    let h = config.hidden;
    let f = config.ffn;
    let conv = |name: &str, inputs: usize, outputs: usize, what: &str| -> Result<Vec<f32>> {
        let m = r.tensor(name, &[inputs, outputs], what)?;
        Ok(transpose(&m, inputs, outputs))
    };
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        if !keep.contains(&i) {
            layers.push(LayerWeights::absent());
            continue;
        }
        let p = |part: &str| format!("h.{i}.{part}");
        let what = |part: &str| format!("layer {i} {part}");
        let qkv = conv(
            &p("attn.c_attn.weight"),
            h,
            3 * h,
            &what("fused QKV projection"),
        )?;
        let qkv_bias = r.tensor(&p("attn.c_attn.bias"), &[3 * h], &what("fused QKV bias"))?;
        // After the transpose the rows are the outputs: Q rows, then K rows, then V rows.
        let rows = |k: usize| qkv[k * h * h..(k + 1) * h * h].to_vec();
        let bias = |k: usize| Some(qkv_bias[k * h..(k + 1) * h].to_vec());
        layers.push(LayerWeights {
            attn_norm: r.tensor(&p("ln_1.weight"), &[h], &what("attention LayerNorm scale"))?,
            attn_norm_bias: Some(r.tensor(
                &p("ln_1.bias"),
                &[h],
                &what("attention LayerNorm shift"),
            )?),
            wq: rows(0),
            wk: rows(1),
            wv: rows(2),
            bq: bias(0),
            bk: bias(1),
            bv: bias(2),
            q_norm: None,
            k_norm: None,
            attn_out_norm: None,
            mlp_out_norm: None,
            wo: conv(&p("attn.c_proj.weight"), h, h, &what("attention output"))?,
            bo: Some(r.tensor(&p("attn.c_proj.bias"), &[h], &what("attention output bias"))?),
            mlp_norm: r.tensor(&p("ln_2.weight"), &[h], &what("MLP LayerNorm scale"))?,
            mlp_norm_bias: Some(r.tensor(&p("ln_2.bias"), &[h], &what("MLP LayerNorm shift"))?),
            w_gate: None,
            w_up: conv(&p("mlp.c_fc.weight"), h, f, &what("MLP up projection"))?,
            b_up: Some(r.tensor(&p("mlp.c_fc.bias"), &[f], &what("MLP up bias"))?),
            w_down: conv(&p("mlp.c_proj.weight"), f, h, &what("MLP down projection"))?,
            b_down: Some(r.tensor(&p("mlp.c_proj.bias"), &[h], &what("MLP down bias"))?),
            blocks: Default::default(),
        });
    }
    let mut wpe = r.tensor("wpe.weight", &[positions, h], "position embedding")?;
    wpe.truncate(config.max_seq * h);
    let lm_head = if config.tied_head {
        None
    } else {
        Some(r.top_level("lm_head.weight", &[config.vocab, h], "LM head")?)
    };
    Ok(ModelWeights {
        config: config.clone(),
        wte: r.tensor("wte.weight", &[config.vocab, h], "token embedding")?,
        wpe: Some(wpe),
        token_types: None,
        embed_norm: None,
        embed_norm_bias: None,
        layers,
        final_norm: r.tensor("ln_f.weight", &[h], "final LayerNorm scale")?,
        final_norm_bias: Some(r.tensor("ln_f.bias", &[h], "final LayerNorm shift")?),
        lm_head,
        tables: Default::default(),
        packed: None,
    })
}
