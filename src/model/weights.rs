//! Host-side weights in a fixed layout (matrices `[out][in]`, like a PyTorch `Linear`), and the
//! seeded synthetic weights every test and benchmark uses.

use std::borrow::Cow;
use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::{Arch, ModelConfig};
use super::quant::{dequantize, quantize, QuantType};

/// One layer's weights. Biases and the gate projection exist only where the family has them.
/// In a post-norm (BERT) layer the two norms follow the residual adds instead of starting the
/// blocks: `attn_norm` is then the norm after attention, `mlp_norm` the one after the MLP.
///
/// A projection matrix a GGUF file stores in blocks is held in [`LayerWeights::blocks`] only,
/// its dense field left empty, so a 4-bit file takes about its own size in host memory rather
/// than four bytes a value. [`matrix_values`] reads either form;
/// [`ModelWeights::fill_dense`] dequantizes them all where dense values are wanted.
#[derive(Debug, Clone, Default)]
pub struct LayerWeights {
    /// Attention norm scale `[hidden]` (before the block, or after its residual when post-norm).
    pub attn_norm: Vec<f32>,
    /// Attention norm shift (LayerNorm only).
    pub attn_norm_bias: Option<Vec<f32>>,
    /// Query projection `[heads * head_dim][hidden]`.
    pub wq: Vec<f32>,
    /// Key projection `[kv_heads * head_dim][hidden]`.
    pub wk: Vec<f32>,
    /// Value projection `[kv_heads * head_dim][hidden]`.
    pub wv: Vec<f32>,
    /// Query bias.
    pub bq: Option<Vec<f32>>,
    /// Key bias.
    pub bk: Option<Vec<f32>>,
    /// Value bias.
    pub bv: Option<Vec<f32>>,
    /// RMSNorm scale `[head_dim]` of every query head, after the projection and before RoPE
    /// (Qwen3's `q_norm`); present exactly when the config's `qk_norm` is set.
    pub q_norm: Option<Vec<f32>>,
    /// RMSNorm scale `[head_dim]` of every key head (Qwen3's `k_norm`).
    pub k_norm: Option<Vec<f32>>,
    /// Attention output projection `[hidden][heads * head_dim]`.
    pub wo: Vec<f32>,
    /// Output bias.
    pub bo: Option<Vec<f32>>,
    /// RMSNorm scale `[hidden]` of the attention output before its residual add (Gemma's
    /// `post_attention_layernorm`, the (1 + w) already applied); present exactly when the
    /// config's `sandwich_norms` is set.
    pub attn_out_norm: Option<Vec<f32>>,
    /// RMSNorm scale `[hidden]` of the MLP output before its residual add (Gemma's
    /// `post_feedforward_layernorm`).
    pub mlp_out_norm: Option<Vec<f32>>,
    /// MLP norm scale (before the block, or after its residual when post-norm).
    pub mlp_norm: Vec<f32>,
    /// MLP norm shift (LayerNorm only).
    pub mlp_norm_bias: Option<Vec<f32>>,
    /// Gate projection `[ffn][hidden]` (SwiGLU only).
    pub w_gate: Option<Vec<f32>>,
    /// Up projection `[ffn][hidden]`.
    pub w_up: Vec<f32>,
    /// Up bias.
    pub b_up: Option<Vec<f32>>,
    /// Down projection `[hidden][ffn]`.
    pub w_down: Vec<f32>,
    /// Down bias.
    pub b_down: Option<Vec<f32>>,
    /// The projection matrices a GGUF file stores in blocks the kernels read, kept as stored;
    /// the dense field of each is empty until [`ModelWeights::fill_dense`].
    pub blocks: LayerBlocks,
}

/// A projection matrix in a GGUF file's own blocks: `rows` rows of `cols` values, each row a
/// whole number of `dtype`'s blocks, rows in wgpar's order (the llama Q/K permutation undone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMatrix {
    /// Block type (any of [`crate::model::quant::ALL_TYPES`] that packs blocks).
    pub dtype: QuantType,
    /// Rows (outputs).
    pub rows: usize,
    /// Columns (inputs).
    pub cols: usize,
    /// `rows` rows of packed blocks.
    pub bytes: Vec<u8>,
}

/// A projection matrix's values: `dense` when held, else `blocks` dequantized (a matrix held
/// in a file's blocks alone; see [`LayerWeights`]).
pub fn matrix_values<'a>(dense: &'a [f32], blocks: Option<&BlockMatrix>) -> Cow<'a, [f32]> {
    match blocks {
        Some(b) if dense.is_empty() => Cow::Owned(b.dequantize()),
        _ => Cow::Borrowed(dense),
    }
}

impl BlockMatrix {
    /// The values the blocks hold, `rows * cols` of them.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize(self.dtype, &self.bytes)
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }

    /// The bytes of rows `range`: one run, since rows are stored one after another.
    pub fn row_run(&self, range: Range<usize>) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes[range.start * rb..range.end * rb]
    }

    /// Rows `range`, as a matrix of their own.
    pub fn slice_rows(&self, range: Range<usize>) -> Self {
        Self {
            rows: range.len(),
            bytes: self.row_run(range).to_vec(),
            ..*self
        }
    }

    /// Columns `range`, which must start and end on block boundaries (callers check with the
    /// tensor-parallel split): the same byte run out of every row.
    pub fn slice_cols(&self, range: Range<usize>) -> Self {
        let (bl, bb) = (self.dtype.block_len(), self.dtype.block_bytes());
        let (from, to) = (range.start / bl * bb, range.end / bl * bb);
        let bytes = self
            .bytes
            .chunks_exact(self.row_bytes().max(1))
            .flat_map(|row| row[from..to].iter().copied())
            .collect();
        Self {
            cols: range.len(),
            bytes,
            ..*self
        }
    }
}

/// A layer's projection matrices kept in a file's blocks; `None` where a matrix is dense.
#[derive(Debug, Clone, Default)]
pub struct LayerBlocks {
    /// Query projection.
    pub wq: Option<BlockMatrix>,
    /// Key projection.
    pub wk: Option<BlockMatrix>,
    /// Value projection.
    pub wv: Option<BlockMatrix>,
    /// Attention output projection.
    pub wo: Option<BlockMatrix>,
    /// Gate projection.
    pub w_gate: Option<BlockMatrix>,
    /// Up projection.
    pub w_up: Option<BlockMatrix>,
    /// Down projection.
    pub w_down: Option<BlockMatrix>,
}

impl LayerBlocks {
    /// The matrices held, with their field names.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &BlockMatrix)> {
        [
            ("wq", &self.wq),
            ("wk", &self.wk),
            ("wv", &self.wv),
            ("wo", &self.wo),
            ("w_gate", &self.w_gate),
            ("w_up", &self.w_up),
            ("w_down", &self.w_down),
        ]
        .into_iter()
        .filter_map(|(n, m)| m.as_ref().map(|m| (n, m)))
    }
}

/// The vocabulary tables a GGUF file stores in blocks the kernels read, kept as stored: the
/// token embedding (whose dense field `wte` is then empty) and an untied LM head (`lm_head`
/// then `Some` and empty), until [`ModelWeights::fill_dense`].
#[derive(Debug, Clone, Default)]
pub struct TableBlocks {
    /// Token embedding `[vocab][hidden]`.
    pub wte: Option<BlockMatrix>,
    /// LM head `[vocab][hidden]`.
    pub lm_head: Option<BlockMatrix>,
}

impl TableBlocks {
    /// The tables held, with their field names.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &BlockMatrix)> {
        [("wte", &self.wte), ("lm_head", &self.lm_head)]
            .into_iter()
            .filter_map(|(n, m)| m.as_ref().map(|m| (n, m)))
    }
}

impl LayerWeights {
    /// A layer this process does not hold (another MPI rank's): every field empty. No engine
    /// uploads it ([`crate::model::GpuModel::upload`] refuses to).
    pub fn absent() -> Self {
        Self::default()
    }

    /// Whether this is a layer this process does not hold ([`Self::absent`]).
    pub fn is_absent(&self) -> bool {
        self.attn_norm.is_empty()
    }

    /// The projection matrices' dense fields with their blocks, gate included where held.
    fn matrices_mut(&mut self) -> impl Iterator<Item = (&mut Vec<f32>, Option<&BlockMatrix>)> {
        let b = &self.blocks;
        [
            (&mut self.wq, b.wq.as_ref()),
            (&mut self.wk, b.wk.as_ref()),
            (&mut self.wv, b.wv.as_ref()),
            (&mut self.wo, b.wo.as_ref()),
            (&mut self.w_up, b.w_up.as_ref()),
            (&mut self.w_down, b.w_down.as_ref()),
        ]
        .into_iter()
        .chain(self.w_gate.as_mut().map(|g| (g, b.w_gate.as_ref())))
    }

    /// The projection matrices' dense fields with their blocks, gate included where held.
    fn matrices(&self) -> impl Iterator<Item = (&Vec<f32>, Option<&BlockMatrix>)> {
        let b = &self.blocks;
        [
            (&self.wq, b.wq.as_ref()),
            (&self.wk, b.wk.as_ref()),
            (&self.wv, b.wv.as_ref()),
            (&self.wo, b.wo.as_ref()),
            (&self.w_up, b.w_up.as_ref()),
            (&self.w_down, b.w_down.as_ref()),
        ]
        .into_iter()
        .chain(self.w_gate.as_ref().map(|g| (g, b.w_gate.as_ref())))
    }

    /// Bytes this layer holds on the host: its vectors' values and its blocks.
    fn host_bytes(&self) -> u64 {
        let vectors = [
            Some(&self.attn_norm),
            self.attn_norm_bias.as_ref(),
            Some(&self.wq),
            Some(&self.wk),
            Some(&self.wv),
            self.bq.as_ref(),
            self.bk.as_ref(),
            self.bv.as_ref(),
            self.q_norm.as_ref(),
            self.k_norm.as_ref(),
            Some(&self.wo),
            self.bo.as_ref(),
            self.attn_out_norm.as_ref(),
            self.mlp_out_norm.as_ref(),
            Some(&self.mlp_norm),
            self.mlp_norm_bias.as_ref(),
            self.w_gate.as_ref(),
            Some(&self.w_up),
            self.b_up.as_ref(),
            Some(&self.w_down),
            self.b_down.as_ref(),
        ];
        let values: usize = vectors.iter().flatten().map(|v| v.len() * 4).sum();
        let blocks: usize = self.blocks.iter().map(|(_, m)| m.bytes.len()).sum();
        (values + blocks) as u64
    }
}

/// A seeded stream of uniform draws for synthetic weights.
struct Draws(ChaCha8Rng);

impl Draws {
    fn new(seed: u64) -> Self {
        Self(ChaCha8Rng::seed_from_u64(seed))
    }

    /// A `[rows][cols]` matrix, uniform with a 1/sqrt(fan_in) scale.
    fn matrix(&mut self, rows: usize, cols: usize) -> Vec<f32> {
        let scale = (3.0 / cols as f32).sqrt();
        (0..rows * cols)
            .map(|_| self.0.random_range(-scale..scale))
            .collect()
    }

    /// `n` values uniform within `spread` of `center`.
    fn around(&mut self, n: usize, center: f32, spread: f32) -> Vec<f32> {
        (0..n)
            .map(|_| center + self.0.random_range(-spread..spread))
            .collect()
    }
}

/// One synthetic layer's vectors: norm scales near 1, the shifts and biases near 0.
struct LayerVectors {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    /// Attention-norm and MLP-norm shifts, then the Q, K, V, output, up and down biases.
    shifts: [Vec<f32>; 8],
}

impl LayerVectors {
    fn draw(d: &mut Draws, c: &ModelConfig) -> Self {
        let h = c.hidden;
        let attn_norm = d.around(h, 1.0, 0.1);
        let mlp_norm = d.around(h, 1.0, 0.1);
        let widths = [h, h, c.q_dim(), c.kv_dim(), c.kv_dim(), h, c.ffn, h];
        Self {
            attn_norm,
            mlp_norm,
            shifts: widths.map(|n| d.around(n, 0.0, 0.1)),
        }
    }

    /// The layer with its matrices drawn from `d` (shifts and biases only where `biased`).
    fn with_matrices(self, d: &mut Draws, c: &ModelConfig, biased: bool) -> LayerWeights {
        let h = c.hidden;
        let [anb, mnb, bq, bk, bv, bo, bu, bd] = self.shifts;
        let opt = |v: Vec<f32>| biased.then_some(v);
        LayerWeights {
            attn_norm: self.attn_norm,
            attn_norm_bias: opt(anb),
            wq: d.matrix(c.q_dim(), h),
            wk: d.matrix(c.kv_dim(), h),
            wv: d.matrix(c.kv_dim(), h),
            bq: opt(bq),
            bk: opt(bk),
            bv: opt(bv),
            q_norm: None,
            k_norm: None,
            wo: d.matrix(h, c.q_dim()),
            bo: opt(bo),
            attn_out_norm: None,
            mlp_out_norm: None,
            mlp_norm: self.mlp_norm,
            mlp_norm_bias: opt(mnb),
            w_gate: (!biased).then(|| d.matrix(c.ffn, h)),
            w_up: d.matrix(c.ffn, h),
            b_up: opt(bu),
            w_down: d.matrix(h, c.ffn),
            b_down: opt(bd),
            blocks: LayerBlocks::default(),
        }
    }
}

/// A whole model's weights.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// The shapes.
    pub config: ModelConfig,
    /// Token embedding `[vocab][hidden]`.
    pub wte: Vec<f32>,
    /// Learned positions `[max_seq][hidden]` (GPT-2, BERT).
    pub wpe: Option<Vec<f32>>,
    /// Token type embeddings `[type_vocab][hidden]` (BERT).
    pub token_types: Option<Vec<f32>>,
    /// LayerNorm scale applied to the summed embeddings (BERT).
    pub embed_norm: Option<Vec<f32>>,
    /// LayerNorm shift applied to the summed embeddings (BERT).
    pub embed_norm_bias: Option<Vec<f32>>,
    /// Layers.
    pub layers: Vec<LayerWeights>,
    /// Final norm scale; empty for an encoder, whose last layer ends with its own norm.
    pub final_norm: Vec<f32>,
    /// Final norm shift (LayerNorm only).
    pub final_norm_bias: Option<Vec<f32>>,
    /// LM head `[vocab][hidden]`; `None` when tied to `wte` (and for an encoder).
    pub lm_head: Option<Vec<f32>>,
    /// The token embedding and LM head a file stores in blocks, kept as stored (their dense
    /// fields empty): the device reads these blocks whatever `packed` says.
    pub tables: TableBlocks,
    /// Block type the layers' projection matrices are stored in on the device (`--weights`):
    /// each is packed from its dense values, except one a file already holds in this type's
    /// blocks ([`LayerWeights::blocks`]), which is kept. `None` keeps a file's blocks as stored
    /// and the other matrices dense (f32, or f16 under `--dtype f16`). The embedding and the
    /// LM head are not packed: they stay dense, or in the file's blocks ([`Self::tables`]).
    pub packed: Option<QuantType>,
}

impl ModelWeights {
    /// Reproducible random weights: the same config and seed give the same bits everywhere.
    /// Matrices are uniform with a 1/sqrt(fan_in) scale so activations stay O(1) through
    /// the layers; norm scales sit near 1 and biases near 0, all non-zero.
    pub fn synthetic(config: &ModelConfig, seed: u64) -> Self {
        let h = config.hidden;
        // GPT-2 and BERT have biases, LayerNorm shifts and learned positions; Llama has none.
        let biased = config.arch != Arch::Llama;
        let encoder = config.is_encoder();
        // Each kind of tensor draws from its own stream, in a fixed order, so that the same
        // config and seed give the same bits (and adding a kind moves no other's draws).
        let mut tables = Draws::new(seed);
        let wte = tables.matrix(config.vocab, h);
        let wpe = biased.then(|| tables.matrix(config.max_seq, h));
        let lm_head = (!config.tied_head && !encoder).then(|| tables.matrix(config.vocab, h));
        let mut vectors = Draws::new(seed ^ 0x9e37_79b9_7f4a_7c15);
        let layer_vectors: Vec<LayerVectors> = (0..config.layers)
            .map(|_| LayerVectors::draw(&mut vectors, config))
            .collect();
        let (final_norm, final_norm_bias) = if encoder {
            (Vec::new(), None)
        } else {
            let norm = vectors.around(h, 1.0, 0.1);
            (norm, biased.then(|| vectors.around(h, 0.0, 0.1)))
        };
        let mut matrices = Draws::new(seed.wrapping_add(1));
        let mut layers: Vec<LayerWeights> = (layer_vectors.into_iter())
            .map(|v| v.with_matrices(&mut matrices, config, biased))
            .collect();
        if config.qk_norm {
            // Scales well away from 1 (as trained Qwen3 ones are), so a norm applied in the
            // wrong place or not at all changes the logits.
            let mut norms = Draws::new(seed ^ 0x2545_f491_4f6c_dd1d);
            for l in &mut layers {
                l.q_norm = Some(norms.around(config.head_dim, 1.0, 0.5));
                l.k_norm = Some(norms.around(config.head_dim, 1.0, 0.5));
            }
        }
        if config.sandwich_norms {
            // Gemma's output norms, also well away from 1, from a stream of their own.
            let mut norms = Draws::new(seed ^ 0x6a09_e667_f3bc_c909);
            for l in &mut layers {
                l.attn_out_norm = Some(norms.around(h, 1.0, 0.5));
                l.mlp_out_norm = Some(norms.around(h, 1.0, 0.5));
            }
        }
        // Encoder-only tables come from their own stream so the decoders' draws stay as they were.
        let mut enc = Draws::new(seed ^ 0x5bd1_e995);
        let token_types = encoder.then(|| enc.around(config.type_vocab * h, 0.0, 0.5));
        let embed_norm = encoder.then(|| enc.around(h, 1.0, 0.1));
        let embed_norm_bias = encoder.then(|| enc.around(h, 0.0, 0.1));
        Self {
            config: config.clone(),
            wte,
            wpe,
            token_types,
            embed_norm,
            embed_norm_bias,
            layers,
            final_norm,
            final_norm_bias,
            lm_head,
            tables: TableBlocks::default(),
            packed: None,
        }
    }

    /// Keeps layers `keep` alone, the others [`LayerWeights::absent`]: what one MPI rank of a
    /// pipeline holds on its host.
    pub fn keep_layers(&mut self, keep: &Range<usize>) {
        for (i, l) in self.layers.iter_mut().enumerate() {
            if !keep.contains(&i) {
                *l = LayerWeights::absent();
            }
        }
    }

    /// The LM head matrix `[vocab][hidden]` (the embedding when tied).
    pub fn head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.wte)
    }

    /// Dequantizes every matrix held in a file's blocks alone into its dense field (the
    /// blocks stay): for code that reads the dense values, at four bytes a value.
    pub fn fill_dense(&mut self) {
        for (dense, blocks) in self.matrices_mut() {
            if let (Some(b), true) = (blocks, dense.is_empty()) {
                *dense = b.dequantize();
            }
        }
    }

    /// Every matrix's dense field with the file's blocks of it, where kept: the token table,
    /// an untied head, then each layer's projections.
    fn matrices_mut(&mut self) -> impl Iterator<Item = (&mut Vec<f32>, Option<&BlockMatrix>)> {
        let t = &self.tables;
        let tables = [
            (Some(&mut self.wte), t.wte.as_ref()),
            (self.lm_head.as_mut(), t.lm_head.as_ref()),
        ];
        (tables.into_iter())
            .filter_map(|(dense, blocks)| dense.map(|d| (d, blocks)))
            .chain(self.layers.iter_mut().flat_map(LayerWeights::matrices_mut))
    }

    /// [`Self::matrices_mut`], to read.
    fn matrices(&self) -> impl Iterator<Item = (&Vec<f32>, Option<&BlockMatrix>)> {
        let t = &self.tables;
        let tables = [
            (Some(&self.wte), t.wte.as_ref()),
            (self.lm_head.as_ref(), t.lm_head.as_ref()),
        ];
        (tables.into_iter())
            .filter_map(|(dense, blocks)| dense.map(|d| (d, blocks)))
            .chain(self.layers.iter().flat_map(LayerWeights::matrices))
    }

    /// The same weights with every matrix's dense values filled in ([`Self::fill_dense`]).
    pub fn with_dense(mut self) -> Self {
        self.fill_dense();
        self
    }

    /// Whether some matrix is held in a file's blocks alone (its dense field empty).
    pub fn has_blocks_only(&self) -> bool {
        self.matrices()
            .any(|(dense, blocks)| dense.is_empty() && blocks.is_some())
    }

    /// Bytes the weights take on the host: dense values at four bytes each, blocks as stored.
    pub fn host_bytes(&self) -> u64 {
        let vectors = [
            Some(&self.wte),
            self.wpe.as_ref(),
            self.token_types.as_ref(),
            self.embed_norm.as_ref(),
            self.embed_norm_bias.as_ref(),
            Some(&self.final_norm),
            self.final_norm_bias.as_ref(),
            self.lm_head.as_ref(),
        ];
        let top: usize = vectors.iter().flatten().map(|v| v.len() * 4).sum();
        let tables: usize = self.tables.iter().map(|(_, m)| m.bytes.len()).sum();
        (top + tables) as u64
            + self
                .layers
                .iter()
                .map(LayerWeights::host_bytes)
                .sum::<u64>()
    }

    /// The same weights with every projection matrix packed as `t` and unpacked again: what
    /// the device computes with when the matrices are stored as `t` (a CPU reference for
    /// packed runs, and the accuracy figures). Rows must be whole blocks.
    pub fn dequantized(&self, t: QuantType) -> Self {
        let mut out = self.clone().with_dense();
        for l in &mut out.layers {
            for (m, _) in l.matrices_mut() {
                *m = dequantize(t, &quantize(t, m));
            }
        }
        out.packed = None;
        out.drop_blocks();
        out
    }

    /// Forgets the blocks a file stored, dequantized into the dense fields first: every matrix
    /// then goes to the device dense, or packed by `--weights`.
    pub fn drop_blocks(&mut self) {
        self.fill_dense();
        self.tables = TableBlocks::default();
        for l in &mut self.layers {
            l.blocks = LayerBlocks::default();
        }
    }

    /// The layers' matrices kept in a file's blocks: (layer, field name, matrix).
    pub fn blocks(&self) -> impl Iterator<Item = (usize, &'static str, &BlockMatrix)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.blocks.iter().map(move |(n, m)| (i, n, m)))
    }

    /// The block types of the file's blocks kept (layers and tables), by name, each once.
    pub fn block_types(&self) -> Vec<QuantType> {
        let tables = self.tables.iter().map(|(_, m)| m.dtype);
        let mut types: Vec<QuantType> = self
            .blocks()
            .map(|(_, _, m)| m.dtype)
            .chain(tables)
            .collect();
        types.sort_unstable_by_key(|t| t.name());
        types.dedup();
        types
    }

    /// The same weights rounded through f16, so a reference can match an f16-weight run.
    /// Matrices held in blocks alone stay as they are: the device reads those blocks.
    pub fn rounded_to_f16(&self) -> Self {
        let r = |v: &Vec<f32>| -> Vec<f32> {
            v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
        };
        let mut out = self.clone();
        out.wte = r(&self.wte);
        out.lm_head = self.lm_head.as_ref().map(r);
        for (dst, src) in out.layers.iter_mut().zip(&self.layers) {
            dst.wq = r(&src.wq);
            dst.wk = r(&src.wk);
            dst.wv = r(&src.wv);
            dst.wo = r(&src.wo);
            dst.w_gate = src.w_gate.as_ref().map(r);
            dst.w_up = r(&src.w_up);
            dst.w_down = r(&src.w_down);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_weights_are_reproducible_and_nonzero() {
        let cfg = ModelConfig::preset("tiny-gpt2").unwrap();
        let a = ModelWeights::synthetic(&cfg, 7);
        let b = ModelWeights::synthetic(&cfg, 7);
        let c = ModelWeights::synthetic(&cfg, 8);
        assert_eq!(a.layers[1].w_down, b.layers[1].w_down);
        assert_ne!(a.layers[1].w_down, c.layers[1].w_down);
        assert!(a.wte.iter().all(|&x| x != 0.0));
        assert_eq!(a.layers[0].wq.len(), cfg.q_dim() * cfg.hidden);
        assert!(a.layers[0].bq.is_some() && a.layers[0].w_gate.is_none());
        assert!(a.token_types.is_none() && a.embed_norm.is_none());
    }

    #[test]
    fn block_matrices_slice_on_rows_and_block_columns() {
        // 3 rows of 64 values as Q8_0 (two blocks a row): slices dequantize to the same values
        // as the dense matrix's slices.
        let x: Vec<f32> = (0..192)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let dense = dequantize(QuantType::Q8_0, &quantize(QuantType::Q8_0, &x));
        let m = BlockMatrix {
            dtype: QuantType::Q8_0,
            rows: 3,
            cols: 64,
            bytes: quantize(QuantType::Q8_0, &x),
        };
        let rows = m.slice_rows(1..3);
        assert_eq!((rows.rows, rows.cols), (2, 64));
        assert_eq!(dequantize(rows.dtype, &rows.bytes), dense[64..].to_vec());
        let cols = m.slice_cols(32..64);
        assert_eq!((cols.rows, cols.cols), (3, 32));
        let want: Vec<f32> = dense.chunks(64).flat_map(|r| r[32..].to_vec()).collect();
        assert_eq!(dequantize(cols.dtype, &cols.bytes), want);
    }

    #[test]
    fn synthetic_encoder_has_types_and_embedding_norm_but_no_head() {
        let cfg = ModelConfig::preset("tiny-bert").unwrap();
        let w = ModelWeights::synthetic(&cfg, 3);
        assert_eq!(w.token_types.as_ref().map(Vec::len), Some(2 * cfg.hidden));
        assert_eq!(w.embed_norm.as_ref().map(Vec::len), Some(cfg.hidden));
        assert_eq!(w.wpe.as_ref().map(Vec::len), Some(cfg.max_seq * cfg.hidden));
        assert!(w.lm_head.is_none() && w.final_norm.is_empty());
        assert!(w.layers[0].b_up.is_some() && w.layers[0].mlp_norm_bias.is_some());
    }
}
