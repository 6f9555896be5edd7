//! A model (or one device's part of it) in GPU memory, and the blocks that encode its forward
//! pass: embedding, layers split at the two points where tensor parallelism all-reduces, and
//! the LM head (decoders) or pooling (encoders).
//!
//! Encoders (BERT) run through the same layer blocks: a post-norm layer skips the norm at the
//! start of `attention` / `mlp` and applies it at the end of `attention_residual` /
//! `mlp_residual`, after the (all-reduced) output has been added, and attention is
//! bidirectional over each sequence's real tokens. Engines therefore call the blocks in the
//! same order for both kinds; an encoder ends with [`GpuModel::pool`] instead of
//! [`GpuModel::head`].

use std::ops::Range;
use std::sync::Arc;

use super::config::{Activation, Arch, ModelConfig, PoolMode};
use super::reference::rope_tables;
use super::shard::{slice_cols, slice_rows, ShardSpec};
use super::weights::{LayerWeights, ModelWeights};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{
    self, AttnMask, AttnShape, Elementwise, Embedding, MatmulKernel, Norm, Positions, RopeTables,
    TokenTypes,
};

/// Which part of the model one device holds.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Decoder layers held (a pipeline stage holds a range; everything else holds all).
    pub layers: Range<usize>,
    /// Share of each layer (tensor parallelism), or the full layer.
    pub shard: ShardSpec,
    /// Holds the token (and position) embedding: the first pipeline stage.
    pub embedding: bool,
    /// Holds the final norm and LM head: the last pipeline stage.
    pub head: bool,
}

impl Placement {
    /// The whole model on one device.
    pub fn whole(config: &ModelConfig) -> Self {
        Self {
            layers: 0..config.layers,
            shard: ShardSpec::full(config),
            embedding: true,
            head: true,
        }
    }
}

/// Tokens processed by one forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Sequences.
    pub batch: usize,
    /// New tokens per sequence.
    pub seq: usize,
    /// Tokens already cached per sequence, when they all have the same number (the plain
    /// batched engines; see [`Step::rows`]). Sequences with different pasts or KV slots
    /// give their own [`SeqRow`]s to [`GpuModel::write_seqs`].
    pub past: usize,
}

impl Step {
    /// New tokens in this call.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// The sequence table of a plain batch: row `b` in KV slot `b`, every row `past` tokens
    /// cached.
    pub fn rows(&self) -> Vec<SeqRow> {
        (0..self.batch)
            .map(|slot| SeqRow {
                slot,
                past: self.past,
            })
            .collect()
    }
}

/// One row of a step's sequence table: which KV-cache slot the sequence reads and writes, and
/// how many tokens it already has there. Its new tokens take positions `past .. past + seq`
/// and each attends causally to the `past + i + 1` keys before and at it. On the device the
/// table is `seqs: array<u32>`, `seqs[2b] = slot`, `seqs[2b + 1] = past`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqRow {
    /// KV-cache slot of the sequence.
    pub slot: usize,
    /// Tokens already cached for it.
    pub past: usize,
}

/// One decoder layer's (shard of) weights on a device.
pub struct GpuLayer {
    shard: ShardSpec,
    attn_norm: Tensor,
    attn_norm_bias: Option<Tensor>,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    wo: Tensor,
    bo: Option<Tensor>,
    mlp_norm: Tensor,
    mlp_norm_bias: Option<Tensor>,
    w_gate: Option<Tensor>,
    w_up: Tensor,
    b_up: Option<Tensor>,
    w_down: Tensor,
    b_down: Option<Tensor>,
}

/// Reusable activation buffers for up to `tokens` tokens on one device.
pub struct Activations {
    tokens: usize,
    /// Residual stream `[tokens][hidden]`: the input and output of every layer.
    pub x: Tensor,
    h: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn: Tensor,
    /// Attention output projection, a partial sum under tensor parallelism `[tokens][hidden]`.
    pub attn_out: Tensor,
    gate: Tensor,
    up: Tensor,
    /// MLP down projection, a partial sum under tensor parallelism `[tokens][hidden]`.
    pub mlp_out: Tensor,
    ids: Tensor,
    /// The step's sequence table, `[batch][2]` u32 (KV slot, past), written by
    /// [`GpuModel::write_seqs`].
    seqs: Tensor,
    /// Token type per token (encoders), written by [`GpuModel::write_encoder_inputs`].
    types: Tensor,
    /// Real (non-padding) tokens per sequence; `u32::MAX` (all) until written.
    lens: Tensor,
    last: Tensor,
    last_norm: Tensor,
    /// Logits of each sequence's last token `[batch][vocab]` (decoder head devices only).
    pub logits: Option<Tensor>,
    /// Pooled embedding per sequence `[batch][hidden]` (encoder devices holding the output).
    pub pooled: Option<Tensor>,
}

impl Activations {
    /// Tokens these buffers hold.
    pub fn capacity(&self) -> usize {
        self.tokens
    }
}

/// One device's KV cache for its layers and heads: per layer, keys and values laid out
/// `[slots][kv_heads][max_seq][head_dim]`, one slot per sequence. A step's sequence table
/// says which slot each of its rows uses.
pub struct KvCache {
    slots: usize,
    layers: Vec<(Tensor, Tensor)>,
}

impl KvCache {
    /// Sequences the cache holds.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// A model, or one device's part of it, in GPU memory.
pub struct GpuModel {
    config: ModelConfig,
    gpu: Arc<Gpu>,
    placement: Placement,
    weight_dtype: DType,
    layers: Vec<GpuLayer>,
    wte: Option<Arc<Tensor>>,
    wpe: Option<Tensor>,
    token_types: Option<Tensor>,
    embed_norm: Option<(Tensor, Tensor)>,
    final_norm: Option<(Tensor, Option<Tensor>)>,
    head: Option<Arc<Tensor>>,
    rope: Option<(Tensor, Tensor)>,
}

fn upload_opt(gpu: &Gpu, what: &str, v: Option<&Vec<f32>>) -> Result<Option<Tensor>> {
    v.map(|v| gpu.upload_f32(what, v)).transpose()
}

impl GpuLayer {
    fn upload(
        gpu: &Gpu,
        config: &ModelConfig,
        index: usize,
        w: &LayerWeights,
        shard: &ShardSpec,
        dtype: DType,
    ) -> Result<Self> {
        let h = config.hidden;
        let d = config.head_dim;
        let q_rows = shard.q_heads.start * d..shard.q_heads.end * d;
        let kv_rows = shard.kv_heads.start * d..shard.kv_heads.end * d;
        let f = shard.ffn.clone();
        let name = |part: &str| format!("layer{index}.{part}");
        let weights = |part: &str, data: Vec<f32>| gpu.upload_weights(&name(part), &data, dtype);
        let vector = |part: &str, data: &[f32]| gpu.upload_f32(&name(part), data);
        let opt_slice = |part: &str, v: &Option<Vec<f32>>, r: Range<usize>| {
            v.as_ref()
                .map(|v| gpu.upload_f32(&name(part), &v[r]))
                .transpose()
        };
        Ok(Self {
            attn_norm: vector("attn_norm", &w.attn_norm)?,
            attn_norm_bias: upload_opt(gpu, &name("attn_norm_bias"), w.attn_norm_bias.as_ref())?,
            wq: weights("wq", slice_rows(&w.wq, h, q_rows.clone()))?,
            wk: weights("wk", slice_rows(&w.wk, h, kv_rows.clone()))?,
            wv: weights("wv", slice_rows(&w.wv, h, kv_rows.clone()))?,
            bq: opt_slice("bq", &w.bq, q_rows.clone())?,
            bk: opt_slice("bk", &w.bk, kv_rows.clone())?,
            bv: opt_slice("bv", &w.bv, kv_rows)?,
            wo: weights("wo", slice_cols(&w.wo, config.q_dim(), q_rows))?,
            bo: upload_opt(gpu, &name("bo"), w.bo.as_ref())?,
            mlp_norm: vector("mlp_norm", &w.mlp_norm)?,
            mlp_norm_bias: upload_opt(gpu, &name("mlp_norm_bias"), w.mlp_norm_bias.as_ref())?,
            w_gate: w
                .w_gate
                .as_ref()
                .map(|g| weights("w_gate", slice_rows(g, h, f.clone())))
                .transpose()?,
            w_up: weights("w_up", slice_rows(&w.w_up, h, f.clone()))?,
            b_up: opt_slice("b_up", &w.b_up, f.clone())?,
            w_down: weights("w_down", slice_cols(&w.w_down, config.ffn, f))?,
            b_down: upload_opt(gpu, &name("b_down"), w.b_down.as_ref())?,
            shard: shard.clone(),
        })
    }

    fn norm<'a>(gamma: &'a Tensor, beta: &'a Option<Tensor>) -> Norm<'a> {
        match beta {
            Some(beta) => Norm::Layer { gamma, beta },
            None => Norm::Rms { gamma },
        }
    }
}

impl GpuModel {
    /// Uploads the part of `weights` that `placement` gives this device. Weights are stored as
    /// `dtype` (f16 needs `SHADER_F16`); norms, biases and activations stay f32.
    pub fn upload(
        gpu: Arc<Gpu>,
        weights: &ModelWeights,
        placement: Placement,
        dtype: DType,
    ) -> Result<Self> {
        let config = weights.config.clone();
        config.validate()?;
        if placement.layers.end > config.layers || placement.layers.start > placement.layers.end {
            return Err(WgparError::Config(format!(
                "layers {:?} outside the model's {} layers",
                placement.layers, config.layers
            )));
        }
        let layers = placement
            .layers
            .clone()
            .map(|i| {
                GpuLayer::upload(
                    &gpu,
                    &config,
                    i,
                    &weights.layers[i],
                    &placement.shard,
                    dtype,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let decoder_head = placement.head && !config.is_encoder();
        let wte = if placement.embedding || (decoder_head && config.tied_head) {
            Some(Arc::new(gpu.upload_weights("wte", &weights.wte, dtype)?))
        } else {
            None
        };
        let wpe = match (&weights.wpe, placement.embedding) {
            (Some(p), true) => Some(gpu.upload_f32("wpe", p)?),
            _ => None,
        };
        let embedding_part = |v: &Option<Vec<f32>>, what: &str| match (v, placement.embedding) {
            (Some(v), true) => gpu.upload_f32(what, v).map(Some),
            _ => Ok(None),
        };
        let token_types = embedding_part(&weights.token_types, "token_types")?;
        let embed_norm = match (
            embedding_part(&weights.embed_norm, "embed_norm")?,
            embedding_part(&weights.embed_norm_bias, "embed_norm_bias")?,
        ) {
            (Some(g), Some(b)) => Some((g, b)),
            (None, None) => None,
            _ => {
                return Err(WgparError::Config(
                    "embedding norm needs both a scale and a shift".into(),
                ))
            }
        };
        let (final_norm, head) = if decoder_head {
            let norm = (
                gpu.upload_f32("final_norm", &weights.final_norm)?,
                upload_opt(&gpu, "final_norm_bias", weights.final_norm_bias.as_ref())?,
            );
            let head = match (&weights.lm_head, &wte) {
                (Some(h), _) => Arc::new(gpu.upload_weights("lm_head", h, dtype)?),
                (None, Some(wte)) => wte.clone(),
                (None, None) => {
                    return Err(WgparError::Config("tied head without an embedding".into()))
                }
            };
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let rope = if config.arch == Arch::Llama && !layers.is_empty() {
            let (cos, sin) = rope_tables(&config, config.max_seq);
            let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
            Some((
                gpu.upload_f32("rope.cos", &f(cos))?,
                gpu.upload_f32("rope.sin", &f(sin))?,
            ))
        } else {
            None
        };
        gpu.wait()?;
        Ok(Self {
            config,
            gpu,
            placement,
            weight_dtype: dtype,
            layers,
            wte,
            wpe,
            token_types,
            embed_norm,
            final_norm,
            head,
            rope,
        })
    }

    /// The device this part lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The model's shapes.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// What this device holds.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Storage type of the weights.
    pub fn weight_dtype(&self) -> DType {
        self.weight_dtype
    }

    /// Number of decoder layers held.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Allocates activation buffers for up to `tokens` tokens and `batch` sequences.
    pub fn activations(&self, tokens: usize, batch: usize) -> Result<Activations> {
        let g = &self.gpu;
        let c = &self.config;
        let s = &self.placement.shard;
        let f32s = |what: &str, len: usize| g.empty(what, DType::F32, len);
        let d = c.head_dim;
        let lens = g.empty("act.lens", DType::U32, batch)?;
        g.write_u32(&lens, &vec![u32::MAX; batch])?;
        // Until a step writes its own: row b in slot b, nothing cached.
        let seqs = g.empty("act.seqs", DType::U32, 2 * batch)?;
        let identity: Vec<u32> = (0..batch as u32).flat_map(|b| [b, 0]).collect();
        g.write_u32(&seqs, &identity)?;
        Ok(Activations {
            tokens,
            x: f32s("act.x", tokens * c.hidden)?,
            h: f32s("act.h", tokens * c.hidden)?,
            q: f32s("act.q", tokens * s.local_heads() * d)?,
            k: f32s("act.k", tokens * s.local_kv_heads() * d)?,
            v: f32s("act.v", tokens * s.local_kv_heads() * d)?,
            attn: f32s("act.attn", tokens * s.local_heads() * d)?,
            attn_out: f32s("act.attn_out", tokens * c.hidden)?,
            gate: f32s("act.gate", tokens * s.local_ffn())?,
            up: f32s("act.up", tokens * s.local_ffn())?,
            mlp_out: f32s("act.mlp_out", tokens * c.hidden)?,
            ids: g.empty("act.ids", DType::U32, tokens)?,
            seqs,
            types: g.empty("act.types", DType::U32, tokens)?,
            lens,
            last: f32s("act.last", batch * c.hidden)?,
            last_norm: f32s("act.last_norm", batch * c.hidden)?,
            logits: if self.head.is_some() {
                Some(f32s("act.logits", batch * c.vocab)?)
            } else {
                None
            },
            pooled: if self.placement.head && c.is_encoder() {
                Some(f32s("act.pooled", batch * c.hidden)?)
            } else {
                None
            },
        })
    }

    /// Allocates a KV cache of `slots` sequences of up to `max_seq` tokens each.
    pub fn kv_cache(&self, slots: usize) -> Result<KvCache> {
        let c = &self.config;
        if slots == 0 {
            return Err(WgparError::Shape {
                op: "kv_cache".into(),
                detail: "a KV cache needs at least one slot".into(),
            });
        }
        let len = slots * self.placement.shard.local_kv_heads() * c.max_seq * c.head_dim;
        let layers = self
            .placement
            .layers
            .clone()
            .map(|i| {
                Ok((
                    self.gpu
                        .empty(&format!("layer{i}.k_cache"), DType::F32, len)?,
                    self.gpu
                        .empty(&format!("layer{i}.v_cache"), DType::F32, len)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { slots, layers })
    }

    fn check_step(&self, act: &Activations, step: &Step) -> Result<()> {
        if step.tokens() > act.tokens {
            return Err(WgparError::Shape {
                op: "forward".into(),
                detail: format!(
                    "{} tokens, activations sized for {}",
                    step.tokens(),
                    act.tokens
                ),
            });
        }
        if step.seq > self.config.max_seq {
            return Err(WgparError::Config(format!(
                "{} new tokens exceed max_seq {} of model '{}'",
                step.seq, self.config.max_seq, self.config.name
            )));
        }
        Ok(())
    }

    /// Validates a step's sequence table and stages it (lands at the next submit): one row per
    /// sequence of `step`, each in a distinct slot of `kv`, with `past + seq` within the
    /// model's `max_seq`. Every device that runs the step's layers or embedding needs it.
    pub fn write_seqs(
        &self,
        act: &Activations,
        kv: &KvCache,
        step: &Step,
        rows: &[SeqRow],
    ) -> Result<()> {
        self.check_step(act, step)?;
        let bad = |detail: String| {
            Err(WgparError::Shape {
                op: "sequence table".into(),
                detail,
            })
        };
        if rows.len() != step.batch {
            return bad(format!(
                "{} rows for a step of {} sequences",
                rows.len(),
                step.batch
            ));
        }
        let mut table = Vec::with_capacity(2 * rows.len());
        for (b, row) in rows.iter().enumerate() {
            if row.slot >= kv.slots {
                return bad(format!(
                    "row {b} uses KV slot {}, the cache has {}",
                    row.slot, kv.slots
                ));
            }
            if rows[..b].iter().any(|r| r.slot == row.slot) {
                return bad(format!("rows share KV slot {}", row.slot));
            }
            if row.past + step.seq > self.config.max_seq {
                return Err(WgparError::Config(format!(
                    "{} cached + {} new tokens exceed max_seq {} of model '{}'",
                    row.past, step.seq, self.config.max_seq, self.config.name
                )));
            }
            table.push(row.slot as u32);
            table.push(row.past as u32);
        }
        self.gpu.write_u32(&act.seqs, &table)
    }

    /// Validates token ids and stages them for [`Self::embed`] (lands at the next submit).
    pub fn write_ids(&self, act: &Activations, ids: &[u32]) -> Result<()> {
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(WgparError::Config(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        self.gpu.write_u32(&act.ids, ids)
    }

    /// The last block of the model: the LM head for a decoder, pooling for an encoder.
    pub fn finish(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        if self.config.is_encoder() {
            self.pool(encoder, act, step)
        } else {
            self.head(encoder, act, step)
        }
    }

    /// The final output after [`Self::finish`] and its width per sequence: logits (vocab) for
    /// a decoder, the pooled embedding (hidden) for an encoder. `None` off the last stage.
    pub fn output<'a>(&self, act: &'a Activations) -> Option<(&'a Tensor, usize)> {
        if self.config.is_encoder() {
            act.pooled.as_ref().map(|t| (t, self.config.hidden))
        } else {
            act.logits.as_ref().map(|t| (t, self.config.vocab))
        }
    }

    /// Stages an encoder batch's token types (`[tokens]`, each below `type_vocab`) and real
    /// token counts (`[batch]`, each in `1..=seq`) for [`Self::embed`], the bidirectional
    /// attention and [`Self::pool`]; lands at the next submit. Every device running layers of
    /// an encoder needs the counts when sequences are padded.
    pub fn write_encoder_inputs(
        &self,
        act: &Activations,
        step: &Step,
        types: &[u32],
        lens: &[u32],
    ) -> Result<()> {
        let c = &self.config;
        let bad = |detail: String| {
            Err(WgparError::Shape {
                op: "encoder inputs".into(),
                detail,
            })
        };
        if types.len() != step.tokens() || lens.len() != step.batch {
            return bad(format!(
                "{} token types and {} lengths for {} sequences of {} tokens",
                types.len(),
                lens.len(),
                step.batch,
                step.seq
            ));
        }
        if let Some(t) = types.iter().find(|&&t| t as usize >= c.type_vocab) {
            return bad(format!("token type {t} outside the {} types", c.type_vocab));
        }
        if let Some(n) = lens.iter().find(|&&n| n == 0 || n as usize > step.seq) {
            return bad(format!("length {n} outside 1..={}", step.seq));
        }
        self.gpu.write_u32(&act.types, types)?;
        self.gpu.write_u32(&act.lens, lens)
    }

    /// Embeds the ids written by [`Self::write_ids`] into `act.x` (adding positions, token
    /// types and the embedding norm where the model has them).
    pub fn embed(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        self.check_step(act, step)?;
        let wte = self.wte.as_ref().filter(|_| self.placement.embedding);
        let wte = wte.ok_or_else(|| WgparError::Config("this device holds no embedding".into()))?;
        let types = self.token_types.as_ref().map(|table| TokenTypes {
            ids: &act.types,
            table,
            count: self.config.type_vocab,
        });
        let positions = self.wpe.as_ref().map(|wpe| Positions {
            wpe,
            positions: self.config.max_seq,
            seqs: &act.seqs,
        });
        ops::embed_with_types(
            &self.gpu,
            encoder,
            Embedding {
                ids: &act.ids,
                wte,
                positions,
                types,
            },
            &act.x,
            (step.batch, step.seq, self.config.hidden),
        )?;
        match &self.embed_norm {
            Some((gamma, beta)) => {
                self.norm_in_place(encoder, Norm::Layer { gamma, beta }, act, step)
            }
            None => Ok(()),
        }
    }

    /// `h = norm(x)` over the step's tokens.
    fn norm_to_h(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        norm: Norm<'_>,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        let c = &self.config;
        let (t, h) = (step.tokens(), c.hidden);
        ops::norm(&self.gpu, encoder, norm, &act.x, &act.h, t, h, c.norm_eps)
    }

    /// `x = norm(x)` through the scratch `h` (a kernel may not read and write one buffer).
    fn norm_in_place(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        norm: Norm<'_>,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        self.norm_to_h(encoder, norm, act, step)?;
        let bytes = (step.tokens() * self.config.hidden * 4) as u64;
        encoder.copy_buffer_to_buffer(act.h.buffer(), 0, act.x.buffer(), 0, bytes);
        Ok(())
    }

    /// The input of a layer's projections: the normed stream `h` (pre-norm), or the stream
    /// itself when the norm comes after the residual.
    fn block_input<'a>(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        norm: Norm<'_>,
        act: &'a Activations,
        step: &Step,
    ) -> Result<&'a Tensor> {
        if self.config.post_norm() {
            return Ok(&act.x);
        }
        self.norm_to_h(encoder, norm, act, step)?;
        Ok(&act.h)
    }

    fn attn_shape(&self, step: &Step, kv: &KvCache) -> AttnShape {
        let s = &self.placement.shard;
        AttnShape {
            batch: step.batch,
            seq: step.seq,
            slots: kv.slots,
            n_heads: s.local_heads(),
            n_kv_heads: s.local_kv_heads(),
            head_dim: self.config.head_dim,
            max_seq: self.config.max_seq,
            group: self.config.heads / self.config.kv_heads,
            q_head_offset: s.q_heads.start,
            kv_head_offset: s.kv_heads.start,
        }
    }

    /// Attention half of local layer `i`, up to the output projection: leaves the (partial,
    /// under tensor parallelism) projection in `act.attn_out`, without its bias.
    pub fn attention(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        kv: &KvCache,
        step: &Step,
    ) -> Result<()> {
        self.check_step(act, step)?;
        let (g, c, l) = (&*self.gpu, &self.config, &self.layers[i]);
        let t = step.tokens();
        let s = &l.shard;
        let (hd, q_dim, kv_dim) = (
            c.head_dim,
            s.local_heads() * c.head_dim,
            s.local_kv_heads() * c.head_dim,
        );
        let tiled = MatmulKernel::Tiled;
        let norm = GpuLayer::norm(&l.attn_norm, &l.attn_norm_bias);
        let input = self.block_input(encoder, norm, act, step)?;
        ops::matmul(
            g,
            encoder,
            input,
            &l.wq,
            l.bq.as_ref(),
            &act.q,
            (t, q_dim, c.hidden),
            tiled,
        )?;
        ops::matmul(
            g,
            encoder,
            input,
            &l.wk,
            l.bk.as_ref(),
            &act.k,
            (t, kv_dim, c.hidden),
            tiled,
        )?;
        ops::matmul(
            g,
            encoder,
            input,
            &l.wv,
            l.bv.as_ref(),
            &act.v,
            (t, kv_dim, c.hidden),
            tiled,
        )?;
        if let Some((cos, sin)) = &self.rope {
            let tables = RopeTables {
                cos,
                sin,
                positions: c.max_seq,
            };
            let bs = (step.batch, step.seq);
            ops::rope(
                g,
                encoder,
                &act.q,
                tables,
                &act.seqs,
                bs,
                (s.local_heads(), hd),
            )?;
            ops::rope(
                g,
                encoder,
                &act.k,
                tables,
                &act.seqs,
                bs,
                (s.local_kv_heads(), hd),
            )?;
        }
        let shape = self.attn_shape(step, kv);
        let (k_cache, v_cache) = &kv.layers[i];
        let cache = ops::KvCache {
            k: k_cache,
            v: v_cache,
            seqs: &act.seqs,
        };
        ops::kv_store(g, encoder, &act.k, &act.v, cache, &shape)?;
        let mask = if c.causal() {
            AttnMask::Causal
        } else {
            AttnMask::Bidirectional { lens: &act.lens }
        };
        ops::attention_masked(g, encoder, &act.q, cache, &act.attn, &shape, mask)?;
        ops::matmul(
            g,
            encoder,
            &act.attn,
            &l.wo,
            None,
            &act.attn_out,
            (t, c.hidden, q_dim),
            tiled,
        )
    }

    /// Adds the (all-reduced) attention output and its bias to the residual stream, then
    /// applies the layer's attention norm when the model is post-norm.
    pub fn attention_residual(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        let l = &self.layers[i];
        self.residual(encoder, l.bo.as_ref(), &act.attn_out, act, step)?;
        self.post_norm(encoder, &l.attn_norm, &l.attn_norm_bias, act, step)
    }

    /// MLP half of local layer `i`: leaves the (partial) down projection in `act.mlp_out`,
    /// without its bias.
    pub fn mlp(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        self.check_step(act, step)?;
        let (g, c, l) = (&*self.gpu, &self.config, &self.layers[i]);
        let t = step.tokens();
        let f = l.shard.local_ffn();
        let tiled = MatmulKernel::Tiled;
        let norm = GpuLayer::norm(&l.mlp_norm, &l.mlp_norm_bias);
        let input = self.block_input(encoder, norm, act, step)?;
        ops::matmul(
            g,
            encoder,
            input,
            &l.w_up,
            l.b_up.as_ref(),
            &act.up,
            (t, f, c.hidden),
            tiled,
        )?;
        match &l.w_gate {
            Some(w_gate) => {
                ops::matmul(
                    g,
                    encoder,
                    input,
                    w_gate,
                    None,
                    &act.gate,
                    (t, f, c.hidden),
                    tiled,
                )?;
                ops::elementwise(
                    g,
                    encoder,
                    Elementwise::SwiGlu,
                    &act.gate,
                    Some(&act.up),
                    (t, f),
                )?;
                ops::matmul(
                    g,
                    encoder,
                    &act.gate,
                    &l.w_down,
                    None,
                    &act.mlp_out,
                    (t, c.hidden, f),
                    tiled,
                )
            }
            None => {
                let gelu = match c.activation {
                    Activation::GeluErf => Elementwise::GeluErf,
                    _ => Elementwise::Gelu,
                };
                ops::elementwise(g, encoder, gelu, &act.up, None, (t, f))?;
                ops::matmul(
                    g,
                    encoder,
                    &act.up,
                    &l.w_down,
                    None,
                    &act.mlp_out,
                    (t, c.hidden, f),
                    tiled,
                )
            }
        }
    }

    /// Adds the (all-reduced) MLP output and its bias to the residual stream, then applies the
    /// layer's MLP norm when the model is post-norm.
    pub fn mlp_residual(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        let l = &self.layers[i];
        self.residual(encoder, l.b_down.as_ref(), &act.mlp_out, act, step)?;
        self.post_norm(encoder, &l.mlp_norm, &l.mlp_norm_bias, act, step)
    }

    /// Local layer `i` whole, as a device that holds it unsharded runs it (no all-reduce
    /// between the halves): attention half and its residual, then MLP half and its residual.
    pub fn layer(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        kv: &KvCache,
        step: &Step,
    ) -> Result<()> {
        self.attention(encoder, i, act, kv, step)?;
        self.attention_residual(encoder, i, act, step)?;
        self.mlp(encoder, i, act, step)?;
        self.mlp_residual(encoder, i, act, step)
    }

    /// Every local layer whole ([`layer`](Self::layer)), in order.
    pub fn layers(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        act: &Activations,
        kv: &KvCache,
        step: &Step,
    ) -> Result<()> {
        (0..self.num_layers()).try_for_each(|i| self.layer(encoder, i, act, kv, step))
    }

    fn post_norm(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        gamma: &Tensor,
        beta: &Option<Tensor>,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        if !self.config.post_norm() {
            return Ok(());
        }
        self.norm_in_place(encoder, GpuLayer::norm(gamma, beta), act, step)
    }

    fn residual(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        bias: Option<&Tensor>,
        out: &Tensor,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        let shape = (step.tokens(), self.config.hidden);
        if let Some(b) = bias {
            ops::elementwise(
                &self.gpu,
                encoder,
                Elementwise::BiasAdd,
                out,
                Some(b),
                shape,
            )?;
        }
        ops::elementwise(
            &self.gpu,
            encoder,
            Elementwise::Add,
            &act.x,
            Some(out),
            shape,
        )
    }

    /// Encoder output: pools each sequence's final token states (its first `lens[b]` tokens,
    /// as written by [`Self::write_encoder_inputs`], or all of them) into `act.pooled`,
    /// L2-normalised when the model's pooling says so.
    pub fn pool(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        let c = &self.config;
        let Some(pooled) = act.pooled.as_ref() else {
            return Err(WgparError::Config(format!(
                "model '{}' has no pooled output on this device (an encoder's last stage pools)",
                c.name
            )));
        };
        self.check_step(act, step)?;
        ops::pool(
            &self.gpu,
            encoder,
            &act.x,
            &act.lens,
            pooled,
            (step.batch, step.seq, c.hidden),
            c.pooling.mode == PoolMode::Cls,
            c.pooling.normalize,
        )
    }

    /// Final norm and LM head on each sequence's last token: fills `act.logits`.
    pub fn head(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        act: &Activations,
        step: &Step,
    ) -> Result<()> {
        let (Some((gamma, beta)), Some(head), Some(logits)) =
            (&self.final_norm, &self.head, &act.logits)
        else {
            return Err(WgparError::Config("this device holds no LM head".into()));
        };
        let c = &self.config;
        let row = (c.hidden * 4) as u64;
        // Only the last position of each sequence feeds generation: gather those rows.
        for b in 0..step.batch {
            let src = ((b * step.seq + step.seq - 1) * c.hidden * 4) as u64;
            encoder.copy_buffer_to_buffer(
                act.x.buffer(),
                src,
                act.last.buffer(),
                b as u64 * row,
                row,
            );
        }
        let norm = GpuLayer::norm(gamma, beta);
        ops::norm(
            &self.gpu,
            encoder,
            norm,
            &act.last,
            &act.last_norm,
            step.batch,
            c.hidden,
            c.norm_eps,
        )?;
        ops::matmul(
            &self.gpu,
            encoder,
            &act.last_norm,
            head,
            None,
            logits,
            (step.batch, c.vocab, c.hidden),
            MatmulKernel::Tiled,
        )
    }
}
