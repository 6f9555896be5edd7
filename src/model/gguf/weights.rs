//! GGUF tensors to [`ModelWeights`]. llama.cpp names (`blk.N.attn_q.weight`, ...) map to
//! wgpar's fields; matrices are stored `[out][in]` with the input dimension innermost, which is
//! wgpar's layout once GGUF's innermost-first dimensions are reversed. Each tensor is
//! dequantized on its own from the mapped bytes.
//!
//! The usual converter permutes the Q and K rows of `llama`-architecture files for llama.cpp's
//! interleaved RoPE (pairs `(2i, 2i+1)`); wgpar rotates halves (`i` with `i + head_dim/2`), as
//! Hugging Face does, so those rows are put back here. Qwen2 files are not permuted.

use super::file::GgufFile;
use crate::error::{Result, WgparError};
use crate::model::config::{Arch, ModelConfig};
use crate::model::quant::dequantize;
use crate::model::weights::{LayerWeights, ModelWeights};

/// Reads tensors by name, checking shapes and values.
struct Tensors<'a> {
    file: &'a GgufFile,
}

impl Tensors<'_> {
    fn fail(&self, name: &str, detail: String) -> WgparError {
        WgparError::Checkpoint {
            file: self.file.path().display().to_string(),
            tensor: Some(name.to_string()),
            detail,
        }
    }

    /// Tensor `name` as f32, which must have `shape` (outermost first).
    fn get(&self, name: &str, shape: &[usize], what: &str) -> Result<Vec<f32>> {
        let info = self
            .file
            .tensor(name)
            .ok_or_else(|| self.fail(name, format!("missing ({what})")))?;
        if info.shape() != shape {
            return Err(self.fail(
                name,
                format!(
                    "shape {:?} (GGUF dimensions {:?}), expected {shape:?} ({what}, from the \
                     metadata)",
                    info.shape(),
                    info.dims
                ),
            ));
        }
        let values = dequantize(info.dtype, self.file.data(info));
        if let Some(first) = values.iter().position(|v| !v.is_finite()) {
            return Err(self.fail(
                name,
                format!(
                    "value {first} is {}: the file is corrupt or was saved from a diverged run",
                    values[first]
                ),
            ));
        }
        Ok(values)
    }

    fn optional(&self, name: &str, shape: &[usize], what: &str) -> Result<Option<Vec<f32>>> {
        match self.file.tensor(name) {
            Some(_) => self.get(name, shape, what).map(Some),
            None => Ok(None),
        }
    }
}

/// Undoes the converter's RoPE permutation of `heads` heads' rows (`cols` values per row): in
/// each head, stored row `2i + s` is the original row `s * head_dim/2 + i`.
pub fn unpermute_rows(m: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = m.len() / cols;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0.0; m.len()];
    for h in 0..heads {
        for i in 0..half {
            for s in 0..2 {
                let from = (h * head_dim + 2 * i + s) * cols;
                let to = (h * head_dim + s * half + i) * cols;
                out[to..to + cols].copy_from_slice(&m[from..from + cols]);
            }
        }
    }
    out
}

/// Reads every tensor of a GGUF file for `config`; `permuted`: the Q/K rows need unpermuting.
pub fn load(file: &GgufFile, config: &ModelConfig, permuted: bool) -> Result<ModelWeights> {
    let t = Tensors { file };
    let h = config.hidden;
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        layers.push(match config.arch {
            Arch::Gpt2 => gpt2_layer(&t, config, i)?,
            _ => llama_layer(&t, config, i, permuted)?,
        });
    }
    let wpe = match config.arch {
        Arch::Gpt2 => {
            let positions = file
                .tensor("position_embd.weight")
                .and_then(|i| i.shape().first().copied())
                .unwrap_or(config.max_seq)
                .max(config.max_seq);
            let mut wpe = t.get(
                "position_embd.weight",
                &[positions, h],
                "position embedding",
            )?;
            wpe.truncate(config.max_seq * h);
            Some(wpe)
        }
        _ => None,
    };
    let lm_head = t.optional("output.weight", &[config.vocab, h], "LM head")?;
    Ok(ModelWeights {
        config: ModelConfig {
            tied_head: lm_head.is_none(),
            ..config.clone()
        },
        wte: t.get("token_embd.weight", &[config.vocab, h], "token embedding")?,
        wpe,
        token_types: None,
        embed_norm: None,
        embed_norm_bias: None,
        layers,
        final_norm: t.get("output_norm.weight", &[h], "final norm")?,
        final_norm_bias: t.optional("output_norm.bias", &[h], "final norm shift")?,
        lm_head,
        packed: None,
    })
}

fn llama_layer(t: &Tensors, c: &ModelConfig, i: usize, permuted: bool) -> Result<LayerWeights> {
    let (h, f, q, kv) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim());
    let n = |part: &str| format!("blk.{i}.{part}");
    let what = |part: &str| format!("layer {i} {part}");
    let get = |part: &str, shape: &[usize], w: &str| t.get(&n(part), shape, &what(w));
    let opt = |part: &str, shape: &[usize], w: &str| t.optional(&n(part), shape, &what(w));
    let fix = |m: Vec<f32>, heads: usize, cols: usize| {
        if permuted {
            unpermute_rows(&m, heads, cols)
        } else {
            m
        }
    };
    Ok(LayerWeights {
        attn_norm: get("attn_norm.weight", &[h], "attention RMSNorm")?,
        attn_norm_bias: None,
        wq: fix(
            get("attn_q.weight", &[q, h], "query projection")?,
            c.heads,
            h,
        ),
        wk: fix(
            get("attn_k.weight", &[kv, h], "key projection")?,
            c.kv_heads,
            h,
        ),
        wv: get("attn_v.weight", &[kv, h], "value projection")?,
        bq: opt("attn_q.bias", &[q], "query bias")?.map(|b| fix(b, c.heads, 1)),
        bk: opt("attn_k.bias", &[kv], "key bias")?.map(|b| fix(b, c.kv_heads, 1)),
        bv: opt("attn_v.bias", &[kv], "value bias")?,
        wo: get("attn_output.weight", &[h, q], "attention output")?,
        bo: opt("attn_output.bias", &[h], "attention output bias")?,
        mlp_norm: get("ffn_norm.weight", &[h], "MLP RMSNorm")?,
        mlp_norm_bias: None,
        w_gate: Some(get("ffn_gate.weight", &[f, h], "MLP gate")?),
        w_up: get("ffn_up.weight", &[f, h], "MLP up")?,
        b_up: None,
        w_down: get("ffn_down.weight", &[h, f], "MLP down")?,
        b_down: None,
    })
}

fn gpt2_layer(t: &Tensors, c: &ModelConfig, i: usize) -> Result<LayerWeights> {
    let (h, f) = (c.hidden, c.ffn);
    let n = |part: &str| format!("blk.{i}.{part}");
    let what = |part: &str| format!("layer {i} {part}");
    let get = |part: &str, shape: &[usize], w: &str| t.get(&n(part), shape, &what(w));
    // The fused projection's rows are Q, then K, then V.
    let qkv = get("attn_qkv.weight", &[3 * h, h], "fused QKV projection")?;
    let qkv_bias = get("attn_qkv.bias", &[3 * h], "fused QKV bias")?;
    let rows = |k: usize| qkv[k * h * h..(k + 1) * h * h].to_vec();
    let bias = |k: usize| Some(qkv_bias[k * h..(k + 1) * h].to_vec());
    Ok(LayerWeights {
        attn_norm: get("attn_norm.weight", &[h], "attention LayerNorm scale")?,
        attn_norm_bias: Some(get("attn_norm.bias", &[h], "attention LayerNorm shift")?),
        wq: rows(0),
        wk: rows(1),
        wv: rows(2),
        bq: bias(0),
        bk: bias(1),
        bv: bias(2),
        wo: get("attn_output.weight", &[h, h], "attention output")?,
        bo: Some(get("attn_output.bias", &[h], "attention output bias")?),
        mlp_norm: get("ffn_norm.weight", &[h], "MLP LayerNorm scale")?,
        mlp_norm_bias: Some(get("ffn_norm.bias", &[h], "MLP LayerNorm shift")?),
        w_gate: None,
        w_up: get("ffn_up.weight", &[f, h], "MLP up projection")?,
        b_up: Some(get("ffn_up.bias", &[f], "MLP up bias")?),
        w_down: get("ffn_down.weight", &[h, f], "MLP down projection")?,
        b_down: Some(get("ffn_down.bias", &[h], "MLP down bias")?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_undoes_the_converters_interleave() {
        // One head of 4 rows, 1 column: original rows [a, b, c, d] are stored [a, c, b, d].
        assert_eq!(
            unpermute_rows(&[0.0, 2.0, 1.0, 3.0], 1, 1),
            vec![0.0, 1.0, 2.0, 3.0]
        );
        // Two heads, 2 columns each row.
        let stored = [
            0., 0., 2., 2., 1., 1., 3., 3., 4., 4., 6., 6., 5., 5., 7., 7.,
        ];
        let want: Vec<f32> = (0..8).flat_map(|r| [r as f32; 2]).collect();
        assert_eq!(unpermute_rows(&stored, 2, 2), want);
    }
}
