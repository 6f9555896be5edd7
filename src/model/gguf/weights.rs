//! GGUF tensors to [`ModelWeights`]. llama.cpp names (`blk.N.attn_q.weight`, ...) map to
//! wgpar's fields; matrices are stored `[out][in]` with the input dimension innermost, which is
//! wgpar's layout once GGUF's innermost-first dimensions are reversed. Each tensor is
//! dequantized on its own from the mapped bytes and checked; a layer projection matrix, the
//! token embedding or the LM head stored in blocks (every block type the file parser accepts:
//! the kernels read them all) is then kept as its bytes alone ([`LayerWeights::blocks`], [`ModelWeights::tables`], dense
//! field empty), so the device holds the file's own blocks, type by type, and the host about
//! the file's size rather than four bytes a value.
//!
//! The usual converter permutes the Q and K rows of `llama`-architecture files for llama.cpp's
//! interleaved RoPE (pairs `(2i, 2i+1)`); wgpar rotates halves (`i` with `i + head_dim/2`), as
//! Hugging Face does, so those rows are put back here. Qwen2 and Qwen3 files are not permuted
//! (nor are Qwen3's per-head `attn_q_norm` / `attn_k_norm` scales).

use std::ops::Range;

use super::file::{GgufFile, TensorInfo, Value};
use crate::error::{Result, WgparError};
use crate::model::config::{Arch, ModelConfig};
use crate::model::quant::dequantize;
use crate::model::weights::{BlockMatrix, LayerBlocks, LayerWeights, ModelWeights, TableBlocks};

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

    /// Tensor `name`'s index entry, which must have `shape` (outermost first).
    fn info(&self, name: &str, shape: &[usize], what: &str) -> Result<&TensorInfo> {
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
        Ok(info)
    }

    /// Refuses a value that is not finite, naming its index (`offset` + its place in `values`).
    fn check_finite(&self, name: &str, values: &[f32], offset: usize) -> Result<()> {
        match values.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(i) => Err(self.fail(
                name,
                format!(
                    "value {} is {}: the file is corrupt or was saved from a diverged run",
                    offset + i,
                    values[i]
                ),
            )),
        }
    }

    /// Tensor `name` as f32, which must have `shape` (outermost first).
    fn get(&self, name: &str, shape: &[usize], what: &str) -> Result<Vec<f32>> {
        let info = self.info(name, shape, what)?;
        let values = dequantize(info.dtype, self.file.data(info));
        self.check_finite(name, &values, 0)?;
        Ok(values)
    }

    /// Matrix `name` (`shape` = `[rows, cols]`): dense, or, when it is in blocks the kernels
    /// read, its blocks as stored and an empty dense field. The values are checked either
    /// way; blocks a slice of rows at a time, so that no f32 copy of a large table (a
    /// vocabulary's embedding) is ever held whole.
    fn matrix(
        &self,
        name: &str,
        shape: &[usize],
        what: &str,
    ) -> Result<(Vec<f32>, Option<BlockMatrix>)> {
        let info = self.info(name, shape, what)?;
        let dtype = info.dtype;
        if !dtype.is_quantized() {
            return Ok((self.get(name, shape, what)?, None));
        }
        let bytes = self.file.data(info);
        let row = bytes.len() / shape[0].max(1);
        for (i, rows) in bytes.chunks(row.max(1) * 256).enumerate() {
            let values = dequantize(dtype, rows);
            self.check_finite(name, &values, i * 256 * shape[1])?;
        }
        let blocks = BlockMatrix {
            dtype,
            bytes: bytes.to_vec(),
            rows: shape[0],
            cols: shape[1],
        };
        Ok((Vec::new(), Some(blocks)))
    }

    fn optional(&self, name: &str, shape: &[usize], what: &str) -> Result<Option<Vec<f32>>> {
        match self.file.tensor(name) {
            Some(_) => self.get(name, shape, what).map(Some),
            None => Ok(None),
        }
    }
}

/// Undoes the converter's RoPE permutation of `heads` heads' rows (`cols` elements per row:
/// values, or the bytes of a row of blocks): in each head, stored row `2i + s` is the original
/// row `s * head_dim/2 + i`.
pub fn unpermute_rows<T: Copy + Default>(m: &[T], heads: usize, cols: usize) -> Vec<T> {
    let rows = m.len() / cols;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![T::default(); m.len()];
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

/// Reads the tensors of a GGUF file for `config`, of layers `keep` alone (the others
/// [`LayerWeights::absent`]; the tables and final norm always); `permuted`: the Q/K rows need
/// unpermuting.
pub fn load(
    file: &GgufFile,
    config: &ModelConfig,
    permuted: bool,
    keep: Range<usize>,
) -> Result<ModelWeights> {
    let t = Tensors { file };
    let h = config.hidden;
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        if !keep.contains(&i) {
            layers.push(LayerWeights::absent());
            continue;
        }
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
    let table = [config.vocab, h];
    let (wte, wte_blocks) = t.matrix("token_embd.weight", &table, "token embedding")?;
    let (lm_head, head_blocks) = match file.tensor("output.weight") {
        Some(_) => {
            let (dense, blocks) = t.matrix("output.weight", &table, "LM head")?;
            (Some(dense), blocks)
        }
        None => (None, None),
    };
    Ok(ModelWeights {
        config: ModelConfig {
            tied_head: lm_head.is_none(),
            ..config.clone()
        },
        wte,
        wpe,
        token_types: None,
        embed_norm: None,
        embed_norm_bias: None,
        layers,
        final_norm: t.get("output_norm.weight", &[h], "final norm")?,
        final_norm_bias: t.optional("output_norm.bias", &[h], "final norm shift")?,
        lm_head,
        tables: TableBlocks {
            wte: wte_blocks,
            lm_head: head_blocks,
        },
        packed: None,
    })
}

fn llama_layer(t: &Tensors, c: &ModelConfig, i: usize, permuted: bool) -> Result<LayerWeights> {
    let (h, f, q, kv) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim());
    let n = |part: &str| format!("blk.{i}.{part}");
    let what = |part: &str| format!("layer {i} {part}");
    let get = |part: &str, shape: &[usize], w: &str| t.get(&n(part), shape, &what(w));
    let opt = |part: &str, shape: &[usize], w: &str| t.optional(&n(part), shape, &what(w));
    let matrix = |part: &str, shape: &[usize], w: &str| t.matrix(&n(part), shape, &what(w));
    // The converter permuted Q and K rows; dense values and stored rows are put back alike.
    let fix = |(m, b): (Vec<f32>, Option<BlockMatrix>), heads: usize| {
        if !permuted {
            return (m, b);
        }
        let b = b.map(|b| BlockMatrix {
            bytes: unpermute_rows(&b.bytes, heads, b.row_bytes()),
            ..b
        });
        (unpermute_rows(&m, heads, h), b)
    };
    let fix_bias = |b: Vec<f32>, heads: usize| {
        if permuted {
            unpermute_rows(&b, heads, 1)
        } else {
            b
        }
    };
    // phi3 files fuse Q, K and V (`attn_qkv`) and gate and up (`ffn_up` of 2 x ffn rows,
    // gate first, no `ffn_gate`): split here, so tensor parallelism shards each part.
    let [(wq, bwq), (wk, bwk), (wv, bwv)] = match t.file.tensor(&n("attn_qkv.weight")) {
        Some(_) => split_matrix(
            matrix("attn_qkv.weight", &[q + 2 * kv, h], "fused QKV projection")?,
            h,
            [q, kv, kv],
        ),
        None => [
            fix(
                matrix("attn_q.weight", &[q, h], "query projection")?,
                c.heads,
            ),
            fix(
                matrix("attn_k.weight", &[kv, h], "key projection")?,
                c.kv_heads,
            ),
            matrix("attn_v.weight", &[kv, h], "value projection")?,
        ],
    };
    let (wo, bwo) = matrix("attn_output.weight", &[h, q], "attention output")?;
    let phi3 =
        matches!(t.file.meta.get("general.architecture"), Some(Value::Str(a)) if a == "phi3");
    let [(w_gate, bgate), (w_up, bup)] = match t.file.tensor(&n("ffn_gate.weight")) {
        None if phi3 => split_matrix(
            matrix(
                "ffn_up.weight",
                &[2 * f, h],
                "fused MLP gate and up (no ffn_gate)",
            )?,
            h,
            [f, f],
        ),
        _ => [
            matrix("ffn_gate.weight", &[f, h], "MLP gate")?,
            matrix("ffn_up.weight", &[f, h], "MLP up")?,
        ],
    };
    let (w_down, bdown) = matrix("ffn_down.weight", &[h, f], "MLP down")?;
    Ok(LayerWeights {
        attn_norm: get("attn_norm.weight", &[h], "attention RMSNorm")?,
        attn_norm_bias: None,
        wq,
        wk,
        wv,
        bq: opt("attn_q.bias", &[q], "query bias")?.map(|b| fix_bias(b, c.heads)),
        bk: opt("attn_k.bias", &[kv], "key bias")?.map(|b| fix_bias(b, c.kv_heads)),
        bv: opt("attn_v.bias", &[kv], "value bias")?,
        q_norm: head_norm(t, c, i, "attn_q_norm")?,
        k_norm: head_norm(t, c, i, "attn_k_norm")?,
        wo,
        bo: opt("attn_output.bias", &[h], "attention output bias")?,
        attn_out_norm: out_norm(t, c, i, "post_attention_norm")?,
        mlp_out_norm: out_norm(t, c, i, "post_ffw_norm")?,
        mlp_norm: get("ffn_norm.weight", &[h], "MLP RMSNorm")?,
        mlp_norm_bias: None,
        w_gate: Some(w_gate),
        w_up,
        b_up: None,
        w_down,
        b_down: None,
        blocks: LayerBlocks {
            wq: bwq,
            wk: bwk,
            wv: bwv,
            wo: bwo,
            w_gate: bgate,
            w_up: bup,
            w_down: bdown,
        },
    })
}

/// The row blocks of a `[rows][cols]` matrix and its file blocks, `sizes` rows each in order
/// (a fused projection's parts); dense values are empty where the blocks alone are held.
fn split_matrix<const N: usize>(
    (dense, blocks): (Vec<f32>, Option<BlockMatrix>),
    cols: usize,
    sizes: [usize; N],
) -> [(Vec<f32>, Option<BlockMatrix>); N] {
    let mut start = 0;
    sizes.map(|rows| {
        let range = start..start + rows;
        start += rows;
        let values = match dense.is_empty() {
            true => Vec::new(),
            false => dense[range.start * cols..range.end * cols].to_vec(),
        };
        (values, blocks.as_ref().map(|b| b.slice_rows(range)))
    })
}

/// Layer `i`'s per-head norm scale `part` (qwen3's `attn_q_norm`, `attn_k_norm`), where the
/// config has them.
fn head_norm(t: &Tensors, c: &ModelConfig, i: usize, part: &str) -> Result<Option<Vec<f32>>> {
    if !c.qk_norm {
        return Ok(None);
    }
    let what = format!("layer {i} {part} (per-head RMSNorm)");
    let name = format!("blk.{i}.{part}.weight");
    t.get(&name, &[c.head_dim], &what).map(Some)
}

/// Layer `i`'s output norm scale `part` (gemma3's `post_attention_norm`, `post_ffw_norm`),
/// where the config has them. llama.cpp's converter already added Gemma's 1 to every norm
/// scale, so the file holds the multiplier itself.
fn out_norm(t: &Tensors, c: &ModelConfig, i: usize, part: &str) -> Result<Option<Vec<f32>>> {
    if !c.sandwich_norms {
        return Ok(None);
    }
    let what = format!("layer {i} {part} (block output RMSNorm)");
    let name = format!("blk.{i}.{part}.weight");
    t.get(&name, &[c.hidden], &what).map(Some)
}

fn gpt2_layer(t: &Tensors, c: &ModelConfig, i: usize) -> Result<LayerWeights> {
    let (h, f) = (c.hidden, c.ffn);
    let n = |part: &str| format!("blk.{i}.{part}");
    let what = |part: &str| format!("layer {i} {part}");
    let get = |part: &str, shape: &[usize], w: &str| t.get(&n(part), shape, &what(w));
    let matrix = |part: &str, shape: &[usize], w: &str| t.matrix(&n(part), shape, &what(w));
    // The fused projection's rows are Q, then K, then V.
    let (qkv, qkv_blocks) = matrix("attn_qkv.weight", &[3 * h, h], "fused QKV projection")?;
    let qkv_bias = get("attn_qkv.bias", &[3 * h], "fused QKV bias")?;
    // Empty when the projection is held in blocks alone.
    let rows = |k: usize| qkv.get(k * h * h..(k + 1) * h * h).unwrap_or(&[]).to_vec();
    let row_blocks = |k: usize| {
        qkv_blocks
            .as_ref()
            .map(|b| b.slice_rows(k * h..(k + 1) * h))
    };
    let bias = |k: usize| Some(qkv_bias[k * h..(k + 1) * h].to_vec());
    let (wo, bwo) = matrix("attn_output.weight", &[h, h], "attention output")?;
    let (w_up, bup) = matrix("ffn_up.weight", &[f, h], "MLP up projection")?;
    let (w_down, bdown) = matrix("ffn_down.weight", &[h, f], "MLP down projection")?;
    Ok(LayerWeights {
        attn_norm: get("attn_norm.weight", &[h], "attention LayerNorm scale")?,
        attn_norm_bias: Some(get("attn_norm.bias", &[h], "attention LayerNorm shift")?),
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
        wo,
        bo: Some(get("attn_output.bias", &[h], "attention output bias")?),
        mlp_norm: get("ffn_norm.weight", &[h], "MLP LayerNorm scale")?,
        mlp_norm_bias: Some(get("ffn_norm.bias", &[h], "MLP LayerNorm shift")?),
        w_gate: None,
        w_up,
        b_up: Some(get("ffn_up.bias", &[f], "MLP up bias")?),
        w_down,
        b_down: Some(get("ffn_down.bias", &[h], "MLP down bias")?),
        blocks: LayerBlocks {
            wq: row_blocks(0),
            wk: row_blocks(1),
            wv: row_blocks(2),
            wo: bwo,
            w_gate: None,
            w_up: bup,
            w_down: bdown,
        },
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
        // Rows of bytes (blocks) move as whole runs.
        let bytes: Vec<u8> = [0u8, 2, 1, 3].iter().flat_map(|&r| [r; 3]).collect();
        let want: Vec<u8> = (0..4u8).flat_map(|r| [r; 3]).collect();
        assert_eq!(unpermute_rows(&bytes, 1, 3), want);
    }
}
