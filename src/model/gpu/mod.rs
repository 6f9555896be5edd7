//! A model (or one device's part of it) in GPU memory, and how a step runs on it.
//!
//! [`GpuModel`] holds the weights (`layer.rs` per decoder layer, the embedding, the head).
//! [`GpuModel::activations`] allocates an activation set and binds every op of the model part
//! to it once (`act.rs`); [`GpuModel::kv_cache`] allocates a KV cache, whose own ops are bound to
//! each activation set the first time they meet (`kv.rs`). A step is then:
//!
//! 1. [`GpuModel::write_ids`] (first stage), [`GpuModel::begin_step`]: the sequence table is
//!    written, and the ops are configured for the step's shape when it changed (their params
//!    go to the device in one write);
//! 2. the blocks, recorded into shared compute passes: [`GpuModel::embed`], per layer
//!    [`attention`](GpuModel::attention) / [`attention_residual`](GpuModel::attention_residual)
//!    / [`mlp`](GpuModel::mlp) / [`mlp_residual`](GpuModel::mlp_residual) (split where tensor
//!    parallelism all-reduces; [`GpuModel::layers`] runs them back to back), then
//!    [`GpuModel::head`] (final norm, LM head, token pick) or [`GpuModel::pool`] (encoders);
//! 3. [`GpuModel::copy_out`] and, after the submit, [`GpuModel::read_out`]: the picked tokens
//!    (and the logits when asked for).
//!
//! None of it creates a buffer or a bind group once the activation set and the cache exist.
//!
//! Encoders (BERT) run through the same layer blocks: a post-norm layer skips the norm at the
//! start of `attention` / `mlp` and applies it at the end of `attention_residual` /
//! `mlp_residual`, after the (all-reduced) output has been added, and attention is
//! bidirectional over each sequence's real tokens.

mod act;
mod kv;
mod layer;
mod matrix;
mod vocab;

use std::ops::Range;
use std::sync::Arc;

pub use act::Activations;
pub use kv::KvCache;

use super::config::{Arch, ModelConfig, PoolMode};
use super::reference::rope_tables;
use super::shard::ShardSpec;
use super::weights::ModelWeights;
use crate::device::{DType, Gpu, Readback, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{
    adjust_words, allow_words, AttnShape, Elementwise, ElementwiseOp, Embed, Embedding, NormOp,
    Operand, Params, Pass, Pick, PickIo, PickSetup, Pool, Pooling, Positions, RopeTables,
    TokenPick, TokenTable, TokenTypes,
};
use act::{Buffers, EmbedOps, HeadBlock, HeadOps};
use kv::KvSpec;
use layer::{norm, upload_opt, BindContext, GpuLayer};
use matrix::{DeviceMatrix, Projection};
use vocab::{TableSource, VocabTable};

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
    /// give their own [`SeqRow`]s to [`GpuModel::begin_step`].
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

/// A model, or one device's part of it, in GPU memory.
pub struct GpuModel {
    config: ModelConfig,
    gpu: Arc<Gpu>,
    placement: Placement,
    weight_dtype: DType,
    layers: Vec<GpuLayer>,
    wte: Option<Arc<VocabTable>>,
    wpe: Option<Tensor>,
    token_types: Option<Tensor>,
    embed_norm: Option<(Tensor, Tensor)>,
    final_norm: Option<FinalNorm>,
    head: Option<Arc<VocabTable>>,
    rope: Option<(Tensor, Tensor)>,
    /// The sliding layers' own RoPE tables (Gemma 3), where this part holds such a layer.
    rope_local: Option<(Tensor, Tensor)>,
}

/// What a step hands back from the device that holds the head ([`GpuModel::read_out`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepOut {
    /// Each sequence's picked token.
    pub tokens: Vec<u32>,
    /// Each sequence's count of non-finite logits (NaN or infinity); its token is then not
    /// to be trusted.
    pub non_finite: Vec<u32>,
    /// `[batch][vocab]` logits, when asked for ([`Activations::set_readout`]).
    pub logits: Option<Vec<f32>>,
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
        check_upload(&config, weights, &placement)?;
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
                    (dtype, weights.packed),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let decoder_head = placement.head && !config.is_encoder();
        let embed = EmbedParts::upload(&gpu, weights, &placement, dtype)?;
        let (final_norm, head) = if decoder_head {
            let (norm, head) = upload_head(&gpu, weights, embed.wte.as_ref(), dtype)?;
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let rope = match config.arch == Arch::Llama && !layers.is_empty() {
            true => Some(upload_rope(&gpu, &config, "rope")?),
            false => None,
        };
        let local = config.local_rope();
        let rope_local = match local.filter(|_| {
            placement
                .layers
                .clone()
                .any(|i| config.layer_window(i).is_some())
        }) {
            Some(c) => Some(upload_rope(&gpu, &c, "rope_local")?),
            None => None,
        };
        gpu.wait()?;
        Ok(Self {
            config,
            gpu,
            placement,
            weight_dtype: dtype,
            layers,
            wte: embed.wte,
            wpe: embed.wpe,
            token_types: embed.token_types,
            embed_norm: embed.embed_norm,
            final_norm,
            head,
            rope,
            rope_local,
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

    /// Allocates activation buffers for up to `tokens` tokens and `batch` sequences, and binds
    /// every op of this model part to them (the KV cache's ops are bound when a cache first
    /// runs a step with them).
    pub fn activations(&self, tokens: usize, batch: usize) -> Result<Activations> {
        let g = &*self.gpu;
        let c = &self.config;
        if batch == 0 {
            return Err(WgparError::Shape {
                op: "activations".into(),
                detail: "an activation set needs room for at least one sequence".into(),
            });
        }
        // Whole rows per sequence, so that `tokens / batch` is a per-sequence capacity.
        let tokens = tokens.max(batch).div_ceil(batch) * batch;
        let buf = self.alloc_buffers(tokens, batch)?;
        let mut params = Params::new(g, "act.params", self.param_slots())?;
        let cx = BindContext {
            config: c,
            tokens,
            batch,
            rope: rope_bind(self.rope.as_ref(), c.max_seq),
            rope_local: rope_bind(self.rope_local.as_ref(), c.max_seq),
        };
        let embed = self.bind_embedding(&mut params, &buf, (batch, tokens))?;
        let layers = self
            .layers
            .iter()
            .map(|l| l.bind(g, &mut params, &buf, &cx))
            .collect::<Result<Vec<_>>>()?;
        let head = self.bind_head(&mut params, &buf, batch)?;
        let pool = self.bind_pool(&mut params, &buf, (batch, tokens))?;
        let tokens_out = self
            .head
            .is_some()
            .then(|| Readback::new(g, "act.tokens_out", (2 * batch * 4) as u64))
            .transpose()?;
        Ok(Activations {
            token: Arc::new(()),
            tokens,
            batch,
            buf,
            params,
            embed,
            layers,
            head,
            pool,
            configured: None,
            pick_configured: None,
            pick: TokenPick::Greedy,
            masked: false,
            adjusted: false,
            want_logits: false,
            tokens_out,
            logits_out: None,
        })
    }

    /// The activation buffers for `tokens` rows of `batch` sequences; the length table starts
    /// empty and the sequence table as row b in slot b, nothing cached, until a step writes
    /// its own.
    fn alloc_buffers(&self, tokens: usize, batch: usize) -> Result<Buffers> {
        let g = &*self.gpu;
        let c = &self.config;
        let s = &self.placement.shard;
        let f32s = |what: &str, len: usize| g.empty(what, DType::F32, len);
        let d = c.head_dim;
        let lens = g.empty("act.lens", DType::U32, batch)?;
        g.write_u32(&lens, &vec![u32::MAX; batch])?;
        let seqs = g.empty("act.seqs", DType::U32, 2 * batch)?;
        let identity: Vec<u32> = (0..batch as u32).flat_map(|b| [b, 0]).collect();
        g.write_u32(&seqs, &identity)?;
        let decoder_head = self.head.is_some();
        Ok(Buffers {
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
            logits: decoder_head
                .then(|| f32s("act.logits", batch * c.vocab))
                .transpose()?,
            pooled: (self.placement.head && c.is_encoder())
                .then(|| f32s("act.pooled", batch * c.hidden))
                .transpose()?,
            draws: decoder_head.then(|| f32s("act.draws", batch)).transpose()?,
            allow: decoder_head
                .then(|| g.empty("act.allow", DType::U32, batch * allow_words(c.vocab)))
                .transpose()?,
            adjust: decoder_head
                .then(|| g.empty("act.adjust", DType::U32, adjust_words(batch)))
                .transpose()?,
            picked: decoder_head
                .then(|| g.empty("act.picked", DType::U32, 2 * batch))
                .transpose()?,
            unused: f32s("act.unused", 1)?,
            hidden: c.hidden,
        })
    }

    /// Upper bound of the ops' params slots: a lookup per table block and the embedding norm,
    /// every layer, the head's two norms, matmul per table block and pick, pooling.
    fn param_slots(&self) -> usize {
        let blocks = |t: &Option<Arc<VocabTable>>| t.as_ref().map_or(0, |t| t.blocks().len());
        // The embedding's scale and the logits' soft-cap take one each.
        blocks(&self.wte) + 2 + self.layers.len() * layer::PARAM_SLOTS + blocks(&self.head) + 4 + 1
    }

    /// The encoder's pooling over `(batch, tokens)` rows, when this part holds it.
    fn bind_pool(
        &self,
        params: &mut Params,
        buf: &Buffers,
        (batch, tokens): (usize, usize),
    ) -> Result<Option<Pool>> {
        let c = &self.config;
        let Some(pooled) = &buf.pooled else {
            return Ok(None);
        };
        Pool::bind(
            &self.gpu,
            params,
            (&buf.x, &buf.lens, pooled),
            (batch, tokens, c.hidden),
            Pooling {
                first_token: c.pooling.mode == PoolMode::Cls,
                normalize: c.pooling.normalize,
            },
        )
        .map(Some)
    }

    fn bind_embedding(
        &self,
        params: &mut Params,
        a: &Buffers,
        (batch, tokens): (usize, usize),
    ) -> Result<Option<EmbedOps>> {
        let Some(wte) = self.wte.as_ref().filter(|_| self.placement.embedding) else {
            return Ok(None);
        };
        let g = &*self.gpu;
        let c = &self.config;
        let embed = wte
            .blocks()
            .iter()
            .map(|block| {
                let wte = match &block.table {
                    DeviceMatrix::Dense(t) => TokenTable::Dense(t),
                    DeviceMatrix::Packed(m) => TokenTable::Packed(m),
                };
                let input = Embedding {
                    ids: &a.ids,
                    wte,
                    first_row: block.first,
                    positions: self.wpe.as_ref().map(|wpe| Positions {
                        wpe,
                        positions: c.max_seq,
                        seqs: &a.seqs,
                    }),
                    types: self.token_types.as_ref().map(|table| TokenTypes {
                        ids: &a.types,
                        table,
                        count: c.type_vocab,
                    }),
                };
                Embed::bind(g, params, (input, &a.x), (batch, tokens, c.hidden))
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = match &self.embed_norm {
            Some((gamma, beta)) => Some(NormOp::bind(
                g,
                params,
                ops_norm_layer(gamma, beta),
                (&a.x, &a.h),
                (tokens, c.hidden),
                c.norm_eps,
            )?),
            None => None,
        };
        let scale = match c.embed_scale {
            Some(s) => Some(
                ElementwiseOp::bind(
                    g,
                    params,
                    Elementwise::Scale,
                    (&a.x, Operand::Unused(&a.unused)),
                    (tokens, c.hidden),
                )?
                .with_scalar(s),
            ),
            None => None,
        };
        Ok(Some(EmbedOps { embed, norm, scale }))
    }

    fn bind_head(&self, params: &mut Params, a: &Buffers, batch: usize) -> Result<Option<HeadOps>> {
        let (Some((gamma, beta)), Some(head), Some(logits), Some(draws), Some(picked)) =
            (&self.final_norm, &self.head, &a.logits, &a.draws, &a.picked)
        else {
            return Ok(None);
        };
        let (Some(allow), Some(adjust)) = (&a.allow, &a.adjust) else {
            return Ok(None);
        };
        let g = &*self.gpu;
        let c = &self.config;
        let (rows, h) = (batch, c.hidden);
        let final_norm = |params: &mut Params, x: &Tensor| {
            NormOp::bind(
                g,
                params,
                norm(gamma, beta),
                (x, &a.last_norm),
                (rows, h),
                c.norm_eps,
            )
        };
        let softcap = match c.final_softcap {
            Some(cap) => Some(
                ElementwiseOp::bind(
                    g,
                    params,
                    Elementwise::Softcap,
                    (logits, Operand::Unused(&a.unused)),
                    (rows, c.vocab),
                )?
                .with_scalar(cap),
            ),
            None => None,
        };
        Ok(Some(HeadOps {
            norm_x: final_norm(params, &a.x)?,
            norm_last: final_norm(params, &a.last)?,
            logits: self.bind_head_blocks(params, head, (&a.last_norm, logits), rows)?,
            softcap,
            pick: Pick::bind(
                g,
                params,
                PickIo {
                    logits,
                    draws,
                    allow,
                    adjust,
                    out: picked,
                },
                (rows, c.vocab),
            )?,
        }))
    }

    /// The LM head's matmul per block of its table, over `rows` normed last tokens: a table of
    /// one block writes the logits directly, blocks of a split table write a part each, which
    /// [`Self::head`] copies into the logits' columns.
    fn bind_head_blocks(
        &self,
        params: &mut Params,
        head: &VocabTable,
        (x, logits): (&Tensor, &Tensor),
        rows: usize,
    ) -> Result<Vec<HeadBlock>> {
        let g = &*self.gpu;
        let whole = head.blocks().len() == 1;
        head.blocks()
            .iter()
            .enumerate()
            .map(|(i, block)| {
                let part = (!whole)
                    .then(|| {
                        g.empty(
                            &format!("act.logits.block{i}"),
                            DType::F32,
                            rows * block.rows,
                        )
                    })
                    .transpose()?;
                let y = part.as_ref().unwrap_or(logits);
                let matmul = Projection::bind(
                    g,
                    params,
                    (x, &block.table, None, y),
                    (rows, block.rows, self.config.hidden),
                )?
                .for_logits();
                Ok(HeadBlock {
                    matmul,
                    first: block.first,
                    rows: block.rows,
                    part,
                })
            })
            .collect()
    }

    /// Allocates a KV cache of `slots` sequences of up to `max_seq` tokens each, in the
    /// device's KV type ([`Gpu::kv_dtype`]).
    pub fn kv_cache(&self, slots: usize) -> Result<KvCache> {
        let c = &self.config;
        if slots == 0 {
            return Err(WgparError::Shape {
                op: "kv_cache".into(),
                detail: "a KV cache needs at least one slot".into(),
            });
        }
        let stored = self.gpu.kv_dtype();
        let layers = (self.placement.layers.clone())
            .map(|i| {
                // A sliding layer keeps only its ring: its window and one step's keys.
                let rows = c.cached_positions(i);
                let len = slots * self.placement.shard.local_kv_heads() * rows * c.head_dim;
                Ok((
                    self.gpu.empty(&format!("layer{i}.k_cache"), stored, len)?,
                    self.gpu.empty(&format!("layer{i}.v_cache"), stored, len)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let rings = (self.placement.layers.clone())
            .map(|i| c.layer_ring(i))
            .collect();
        let layout = kv::KvLayout {
            kv_heads: self.placement.shard.local_kv_heads(),
            max_seq: c.max_seq,
            head_dim: c.head_dim,
        };
        KvCache::new(&self.gpu, slots, layout, (layers, rings))
    }

    fn check_step(&self, act: &Activations, step: &Step) -> Result<()> {
        if step.tokens() > act.tokens || step.batch > act.batch || step.batch == 0 {
            return Err(WgparError::Shape {
                op: "forward".into(),
                detail: format!(
                    "{} sequences of {} tokens, activations sized for {} sequences and {} tokens",
                    step.batch, step.seq, act.batch, act.tokens
                ),
            });
        }
        if let Some(most) = self.config.ring_step().filter(|&m| step.seq > m) {
            // Past it, the step's first queries would need keys its own writes overwrote.
            return Err(WgparError::limit(
                "new positions per sequence in one step",
                (step.seq as u64, most as u64),
                format!(
                    "{} new tokens per sequence in one step: the sliding-window layers of \
                     model '{}' keep a ring of their window and {most} new positions, so \
                     longer prompts go in chunks of at most {most}",
                    step.seq, self.config.name
                ),
            ));
        }
        if step.seq == 0 || step.seq > self.config.max_seq {
            return Err(WgparError::limit(
                "context (tokens)",
                (step.seq as u64, self.config.max_seq as u64),
                format!(
                    "{} new tokens per sequence: needs 1..={} (max_seq of model '{}')",
                    step.seq, self.config.max_seq, self.config.name
                ),
            ));
        }
        Ok(())
    }

    /// Validates a step's sequence table: one row per sequence of `step`, each in a distinct
    /// slot of `kv`, with `past + seq` within the model's `max_seq`. Returns it as the device
    /// reads it.
    fn seq_table(&self, kv: &KvCache, step: &Step, rows: &[SeqRow]) -> Result<Vec<u32>> {
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
            if row.slot >= kv.slots() {
                return bad(format!(
                    "row {b} uses KV slot {}, the cache has {}",
                    row.slot,
                    kv.slots()
                ));
            }
            if rows[..b].iter().any(|r| r.slot == row.slot) {
                return bad(format!("rows share KV slot {}", row.slot));
            }
            if row.past + step.seq > self.config.max_seq {
                return Err(WgparError::limit(
                    "context (tokens)",
                    ((row.past + step.seq) as u64, self.config.max_seq as u64),
                    format!(
                        "{} cached + {} new tokens exceed max_seq {} of model '{}'",
                        row.past, step.seq, self.config.max_seq, self.config.name
                    ),
                ));
            }
            table.push(row.slot as u32);
            table.push(row.past as u32);
        }
        Ok(table)
    }

    /// Starts a step of `step.batch` sequences of `step.seq` new tokens on `act` and `kv`:
    /// validates and stages the step's sequence table `rows` (one row per sequence: its KV
    /// slot, distinct, inside `kv`, and its past, with `past + seq <= max_seq`; [`Step::rows`]
    /// gives a plain batch's), binds `kv`'s ops to `act` the first time they meet, and
    /// configures the ops for the step's shape and token pick when those changed (their
    /// params then reach the device in one write). Nothing is allocated once `act` and `kv`
    /// have run a step of this shape together.
    pub fn begin_step(
        &self,
        act: &mut Activations,
        kv: &mut KvCache,
        step: &Step,
        rows: &[SeqRow],
    ) -> Result<()> {
        self.check_step(act, step)?;
        let table = self.seq_table(kv, step, rows)?;
        let g = &*self.gpu;
        g.write_u32(&act.buf.seqs, &table)?;
        let shape = (step.batch, step.seq);
        let reshaped = act.configured != Some(shape);
        let params = &mut act.params;
        if reshaped {
            // A failure part-way leaves the set unconfigured, never half-configured.
            act.configured = None;
            if let Some(e) = &mut act.embed {
                for lookup in &mut e.embed {
                    lookup.configure(g, params, shape)?;
                }
                if let Some(n) = &mut e.norm {
                    n.configure(g, params, step.tokens())?;
                }
                if let Some(s) = &mut e.scale {
                    s.configure(g, params, step.tokens())?;
                }
            }
            for l in &mut act.layers {
                l.configure(g, params, shape)?;
            }
            if let Some(h) = &mut act.head {
                h.norm_x.configure(g, params, step.batch)?;
                h.norm_last.configure(g, params, step.batch)?;
                for block in &mut h.logits {
                    block.matmul.configure(g, params, step.batch)?;
                }
                if let Some(s) = &mut h.softcap {
                    s.configure(g, params, step.batch)?;
                }
            }
            if let Some(p) = &mut act.pool {
                p.configure(g, params, shape)?;
            }
        }
        if let Some(h) = &mut act.head {
            let how = PickSetup {
                how: act.pick,
                masked: act.masked,
                adjusted: act.adjusted,
            };
            if reshaped || act.pick_configured != Some(how) {
                act.pick_configured = None;
                h.pick.configure(g, params, step.batch, how)?;
                act.pick_configured = Some(how);
            }
            if act.want_logits && act.logits_out.is_none() {
                let bytes = (act.batch * self.config.vocab * 4) as u64;
                act.logits_out = Some(Readback::new(g, "act.logits_out", bytes)?);
            }
        }
        act.configured = Some(shape);
        params.flush(g);
        if !self.layers.is_empty() {
            let c = &self.config;
            let spec = KvSpec {
                heads: self.attn_heads(),
                causal: c.causal(),
                scale: c.attn_scale,
                windows: (self.placement.layers.clone())
                    .map(|i| c.layer_window(i))
                    .collect(),
            };
            let context = rows.iter().map(|r| r.past).max().unwrap_or(0) + step.seq;
            kv.prepare(g, act, &spec, shape, context)?;
        }
        Ok(())
    }

    fn attn_heads(&self) -> AttnShape {
        let s = &self.placement.shard;
        AttnShape {
            batch: 1,
            seq: 1,
            slots: 1,
            n_heads: s.local_heads(),
            n_kv_heads: s.local_kv_heads(),
            head_dim: self.config.head_dim,
            max_seq: self.config.max_seq,
            group: self.config.heads / self.config.kv_heads,
            q_head_offset: s.q_heads.start,
            kv_head_offset: s.kv_heads.start,
        }
    }

    /// The (batch, seq) `act` was last configured for by [`Self::begin_step`].
    fn shape(act: &Activations) -> Result<(usize, usize)> {
        act.configured.ok_or_else(|| WgparError::Shape {
            op: "forward".into(),
            detail: "a block was recorded before begin_step configured the step".into(),
        })
    }

    /// Validates token ids and stages them for [`Self::embed`] (lands at the next submit).
    pub fn write_ids(&self, act: &Activations, ids: &[u32]) -> Result<()> {
        if let Some(i) = ids.iter().position(|&t| t as usize >= self.config.vocab) {
            let per_sequence = (ids.len() / act.batch.max(1)).max(1);
            return Err(WgparError::TokenRange {
                sequence: i / per_sequence,
                what: "token id",
                value: ids[i],
                range: "vocabulary",
                limit: self.config.vocab,
            });
        }
        self.gpu.write_u32(&act.buf.ids, ids)
    }

    /// Stages each row's bit set of the tokens it may pick (`[rows][allow_words(vocab)]`
    /// u32, bit t % 32 of word t / 32 is token t) and marks the step's pick masked (lands at
    /// the next submit).
    pub fn write_allow(&self, act: &mut Activations, allow: &[u32]) -> Result<()> {
        let t = act.buf.allow.as_ref().ok_or_else(|| act.no_head())?;
        let words = allow_words(self.config.vocab);
        if !allow.len().is_multiple_of(words) || allow.len() / words > act.batch {
            return Err(WgparError::LengthMismatch {
                what: format!("logit mask words (whole rows of {words})"),
                got: allow.len(),
                expected: words * act.batch,
            });
        }
        self.gpu.write_u32(t, allow)?;
        act.set_masked();
        Ok(())
    }

    /// Stages the step's logit adjustments (bias and penalties of some rows, packed by
    /// `ops::pack_adjustments`) and marks the step's pick adjusted (lands at the next
    /// submit).
    pub fn write_adjust(&self, act: &mut Activations, words: &[u32]) -> Result<()> {
        let t = act.buf.adjust.as_ref().ok_or_else(|| act.no_head())?;
        let rows = words.first().copied().unwrap_or(0) as usize;
        if rows > act.batch || words.len() > adjust_words(act.batch) {
            return Err(WgparError::LengthMismatch {
                what: format!(
                    "logit adjustment words for {rows} rows (at most {})",
                    act.batch
                ),
                got: words.len(),
                expected: adjust_words(act.batch),
            });
        }
        self.gpu.write_u32(t, words)?;
        act.set_adjusted();
        Ok(())
    }

    /// Stages one uniform random number in [0, 1) per sequence for a sampling token pick
    /// (lands at the next submit).
    pub fn write_draws(&self, act: &Activations, draws: &[f32]) -> Result<()> {
        let t = act.buf.draws.as_ref().ok_or_else(|| act.no_head())?;
        self.gpu.write_f32(t, draws)
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
        self.gpu.write_u32(&act.buf.types, types)?;
        self.gpu.write_u32(&act.buf.lens, lens)
    }

    /// Embeds the ids written by [`Self::write_ids`] into the stream (adding positions, token
    /// types and the embedding norm where the model has them).
    pub fn embed(&self, encoder: &mut wgpu::CommandEncoder, act: &Activations) -> Result<()> {
        let (batch, seq) = Self::shape(act)?;
        let ops = act.embed.as_ref().ok_or_else(|| WgparError::NotHeld {
            part: "embedding".into(),
            holder: "this device (not the model's first stage)".into(),
        })?;
        let mut pass = Pass::new(encoder);
        for lookup in &ops.embed {
            pass.run(lookup)?;
        }
        if let Some(s) = &ops.scale {
            pass.run(s)?;
        }
        if let Some(n) = &ops.norm {
            pass.run(n)?;
            act.buf.copy_h_to_x(&mut pass, batch * seq);
        }
        Ok(())
    }

    fn layer_ops<'a>(&self, act: &'a Activations, i: usize) -> Result<&'a layer::LayerOps> {
        act.layers.get(i).ok_or_else(|| WgparError::OutOfRange {
            what: "local layer on this device".into(),
            index: i,
            count: self.layers.len(),
        })
    }

    /// Attention half of local layer `i`, up to the output projection: leaves the (partial,
    /// under tensor parallelism) projection in `attn_out`, without its bias.
    pub fn attention(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        kv: &KvCache,
    ) -> Result<()> {
        Self::shape(act)?;
        let mut pass = Pass::new(encoder);
        self.layer_ops(act, i)?
            .attention(&mut pass, kv.layer(act, i)?)
    }

    /// Adds the (all-reduced) attention output and its bias to the residual stream, then
    /// applies the layer's attention norm when the model is post-norm.
    pub fn attention_residual(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
    ) -> Result<()> {
        let (batch, seq) = Self::shape(act)?;
        let mut pass = Pass::new(encoder);
        self.layer_ops(act, i)?
            .attention_residual(&mut pass, &act.buf, batch * seq)
    }

    /// MLP half of local layer `i`: leaves the (partial) down projection in `mlp_out`,
    /// without its bias.
    pub fn mlp(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
    ) -> Result<()> {
        Self::shape(act)?;
        let mut pass = Pass::new(encoder);
        self.layer_ops(act, i)?.mlp(&mut pass)
    }

    /// Adds the (all-reduced) MLP output and its bias to the residual stream, then applies the
    /// layer's MLP norm when the model is post-norm.
    pub fn mlp_residual(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
    ) -> Result<()> {
        let (batch, seq) = Self::shape(act)?;
        let mut pass = Pass::new(encoder);
        self.layer_ops(act, i)?
            .mlp_residual(&mut pass, &act.buf, batch * seq)
    }

    /// Local layer `i` whole, as a device that holds it unsharded runs it (no all-reduce
    /// between the halves): attention half and its residual, then MLP half and its residual.
    pub fn layer(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        i: usize,
        act: &Activations,
        kv: &KvCache,
    ) -> Result<()> {
        self.layer_range(encoder, i..i + 1, act, kv)
    }

    /// Every local layer whole ([`layer`](Self::layer)), in order, in one compute pass.
    pub fn layers(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        act: &Activations,
        kv: &KvCache,
    ) -> Result<()> {
        self.layer_range(encoder, 0..self.layers.len(), act, kv)
    }

    /// Local layers `range` whole ([`layer`](Self::layer)), in order, in one compute pass.
    pub(crate) fn layer_range(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        range: Range<usize>,
        act: &Activations,
        kv: &KvCache,
    ) -> Result<()> {
        let (batch, seq) = Self::shape(act)?;
        let t = batch * seq;
        let mut pass = Pass::new(encoder);
        for i in range {
            let l = self.layer_ops(act, i)?;
            l.attention(&mut pass, kv.layer(act, i)?)?;
            l.attention_residual(&mut pass, &act.buf, t)?;
            l.mlp(&mut pass)?;
            l.mlp_residual(&mut pass, &act.buf, t)?;
        }
        Ok(())
    }

    /// Encoder output: pools each sequence's final token states (its first `lens[b]` tokens,
    /// as written by [`Self::write_encoder_inputs`], or all of them) into the pooled output,
    /// L2-normalised when the model's pooling says so.
    pub fn pool(&self, encoder: &mut wgpu::CommandEncoder, act: &Activations) -> Result<()> {
        Self::shape(act)?;
        let op = act.pool.as_ref().ok_or_else(|| WgparError::NotHeld {
            part: "pooled output (an encoder's last stage pools)".into(),
            holder: format!("this device of model '{}'", self.config.name),
        })?;
        Pass::new(encoder).run(op)
    }

    /// Final norm and LM head on each sequence's last token, then the token pick: fills the
    /// logits and the picks ([`Activations::picked`]).
    pub fn head(&self, encoder: &mut wgpu::CommandEncoder, act: &Activations) -> Result<()> {
        let (batch, seq) = Self::shape(act)?;
        let h = act.head.as_ref().ok_or_else(|| act.no_head())?;
        let mut pass = Pass::new(encoder);
        if seq == 1 {
            // One token per sequence: the stream's rows are the last tokens.
            pass.run(&h.norm_x)?;
        } else {
            // Only the last position of each sequence feeds generation: gather those rows.
            let row = (self.config.hidden * 4) as u64;
            for b in 0..batch {
                let src = (b * seq + seq - 1) as u64 * row;
                pass.copy(
                    (act.buf.x.buffer(), src),
                    (act.buf.last.buffer(), b as u64 * row),
                    row,
                );
            }
            pass.run(&h.norm_last)?;
        }
        let logits = act.buf.logits.as_ref().ok_or_else(|| act.no_head())?;
        let vocab = self.config.vocab as u64;
        for block in &h.logits {
            pass.run(&block.matmul)?;
            if let Some(part) = &block.part {
                // The block's columns of each sequence's logits row.
                let width = block.rows as u64 * 4;
                for b in 0..batch as u64 {
                    pass.copy(
                        (part.buffer(), b * width),
                        (logits.buffer(), (b * vocab + block.first as u64) * 4),
                        width,
                    );
                }
            }
        }
        if let Some(s) = &h.softcap {
            pass.run(s)?;
        }
        pass.run(&h.pick)
    }

    /// The last block of the model: the LM head for a decoder, pooling for an encoder.
    pub fn finish(&self, encoder: &mut wgpu::CommandEncoder, act: &Activations) -> Result<()> {
        if self.config.is_encoder() {
            self.pool(encoder, act)
        } else {
            self.head(encoder, act)
        }
    }

    /// The final output after [`Self::finish`] and its width per sequence: logits (vocab) for
    /// a decoder, the pooled embedding (hidden) for an encoder. `None` off the last stage.
    pub fn output<'a>(&self, act: &'a Activations) -> Option<(&'a Tensor, usize)> {
        if self.config.is_encoder() {
            act.pooled().map(|t| (t, self.config.hidden))
        } else {
            act.logits().map(|t| (t, self.config.vocab))
        }
    }

    /// Records the copy of the step's picks (and logits, when asked for by
    /// [`Activations::set_readout`]) into `act`'s readback buffers, after [`Self::head`].
    pub fn copy_out(&self, encoder: &mut wgpu::CommandEncoder, act: &Activations) -> Result<()> {
        let (batch, _) = Self::shape(act)?;
        let (Some(out), Some(picked)) = (&act.tokens_out, &act.buf.picked) else {
            return Err(act.no_head());
        };
        out.copy(encoder, picked, (2 * batch * 4) as u64)?;
        if act.want_logits {
            if let (Some(out), Some(logits)) = (&act.logits_out, &act.buf.logits) {
                out.copy(encoder, logits, (batch * self.config.vocab * 4) as u64)?;
            }
        }
        Ok(())
    }

    /// After the submit holding [`Self::copy_out`]: waits for it and returns the step's
    /// tokens, non-finite counts and (when asked for) logits.
    pub fn read_out(&self, act: &Activations) -> Result<StepOut> {
        let (batch, _) = Self::shape(act)?;
        let out = act.tokens_out.as_ref().ok_or_else(|| act.no_head())?;
        let words: Vec<u32> =
            bytemuck::pod_collect_to_vec(&out.read(&self.gpu, (2 * batch * 4) as u64)?);
        let logits = match (&act.logits_out, act.want_logits) {
            (Some(out), true) => {
                let bytes = out.read(&self.gpu, (batch * self.config.vocab * 4) as u64)?;
                Some(bytemuck::pod_collect_to_vec(&bytes))
            }
            _ => None,
        };
        Ok(StepOut {
            tokens: words[..batch].to_vec(),
            non_finite: words[batch..2 * batch].to_vec(),
            logits,
        })
    }

    /// Where the configured step first produces non-finite values, found by running it again
    /// block by block and reading the stream after each (`None`: nowhere before the head, or
    /// this device cannot tell: it must hold the embedding and whole layers). Re-running
    /// stores the same keys and values again, so the cache is unchanged. For error reports
    /// only: it reads back after every layer.
    pub fn locate_non_finite(&self, act: &Activations, kv: &KvCache) -> Result<Option<String>> {
        let (batch, seq) = Self::shape(act)?;
        if act.embed.is_none() || self.placement.shard.world != 1 {
            return Ok(None);
        }
        let g = &*self.gpu;
        let len = batch * seq * self.config.hidden;
        let stream_bad = |record: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>| {
            let mut enc = g.encoder();
            record(&mut enc)?;
            g.submit(enc);
            let x = g.read_f32(&act.buf.x)?;
            Ok::<bool, WgparError>(x[..len].iter().any(|v| !v.is_finite()))
        };
        if stream_bad(&|e| self.embed(e, act))? {
            return Ok(Some("the embedding".into()));
        }
        for i in 0..self.layers.len() {
            if stream_bad(&|e| self.layer(e, i, act, kv))? {
                let layer = self.placement.layers.start + i;
                return Ok(Some(format!("layer {layer}")));
            }
        }
        Ok(None)
    }
}

/// A LayerNorm of scale `gamma` and shift `beta`.
/// Refuses a model that fails validation, weights that cannot be packed as asked, and a layer
/// range outside the model.
fn check_upload(config: &ModelConfig, weights: &ModelWeights, placement: &Placement) -> Result<()> {
    config.validate()?;
    if let Some(t) = weights.packed {
        crate::model::quant::check_packable(config, t)?;
    }
    if placement.layers.start > placement.layers.end {
        return Err(WgparError::OutOfRange {
            what: format!("first layer of the range {:?}", placement.layers),
            index: placement.layers.start,
            count: placement.layers.end,
        });
    }
    if placement.layers.end > config.layers {
        return Err(WgparError::OutOfRange {
            what: format!("last layer of the range {:?}", placement.layers),
            index: placement.layers.end - 1,
            count: config.layers,
        });
    }
    let absent = placement
        .layers
        .clone()
        .find(|&i| weights.layers[i].is_absent());
    if let Some(i) = absent {
        return Err(WgparError::NotHeld {
            part: format!("weights of layer {i}"),
            holder: "this process (it loaded other layers)".into(),
        });
    }
    Ok(())
}

/// The embedding's tables on one device: the token table also where only a tied head needs
/// it, the rest only where the placement holds the embedding.
struct EmbedParts {
    wte: Option<Arc<VocabTable>>,
    wpe: Option<Tensor>,
    token_types: Option<Tensor>,
    embed_norm: Option<(Tensor, Tensor)>,
}

impl EmbedParts {
    fn upload(
        gpu: &Gpu,
        weights: &ModelWeights,
        placement: &Placement,
        dtype: DType,
    ) -> Result<Self> {
        let config = &weights.config;
        let decoder_head = placement.head && !config.is_encoder();
        let table = (config.vocab, config.hidden);
        let wte = if placement.embedding || (decoder_head && config.tied_head) {
            let source = TableSource {
                dense: &weights.wte,
                blocks: weights.tables.wte.as_ref(),
            };
            Some(Arc::new(VocabTable::upload(
                gpu, "wte", source, table, dtype,
            )?))
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
                return Err(WgparError::model(
                    config.name.clone(),
                    "embed_norm",
                    "embedding norm needs both a scale and a shift".into(),
                ))
            }
        };
        Ok(Self {
            wte,
            wpe,
            token_types,
            embed_norm,
        })
    }
}

/// A final norm's scale and, for a layer norm, its shift.
type FinalNorm = (Tensor, Option<Tensor>);

/// A decoder head's final norm and output table (`wte` when the head is tied to it).
fn upload_head(
    gpu: &Gpu,
    weights: &ModelWeights,
    wte: Option<&Arc<VocabTable>>,
    dtype: DType,
) -> Result<(FinalNorm, Arc<VocabTable>)> {
    let config = &weights.config;
    let table = (config.vocab, config.hidden);
    let norm = (
        gpu.upload_f32("final_norm", &weights.final_norm)?,
        upload_opt(gpu, "final_norm_bias", weights.final_norm_bias.as_ref())?,
    );
    let head = match (&weights.lm_head, wte) {
        (Some(h), _) => {
            let source = TableSource {
                dense: h,
                blocks: weights.tables.lm_head.as_ref(),
            };
            Arc::new(VocabTable::upload(gpu, "lm_head", source, table, dtype)?)
        }
        (None, Some(wte)) => wte.clone(),
        (None, None) => {
            return Err(WgparError::model(
                config.name.clone(),
                "lm_head",
                "tied head without an embedding".into(),
            ))
        }
    };
    Ok((norm, head))
}

/// Uploaded RoPE tables as the rotation binds them.
fn rope_bind(tables: Option<&(Tensor, Tensor)>, positions: usize) -> Option<RopeTables<'_>> {
    tables.map(|(cos, sin)| RopeTables {
        cos,
        sin,
        positions,
    })
}

/// RoPE tables of `config` (its base and scaling) on the device, named `name.cos` / `.sin`.
fn upload_rope(gpu: &Gpu, config: &ModelConfig, name: &str) -> Result<(Tensor, Tensor)> {
    let (cos, sin) = rope_tables(config, config.max_seq);
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    Ok((
        gpu.upload_f32(&format!("{name}.cos"), &f(cos))?,
        gpu.upload_f32(&format!("{name}.sin"), &f(sin))?,
    ))
}

fn ops_norm_layer<'a>(gamma: &'a Tensor, beta: &'a Tensor) -> crate::kernels::ops::Norm<'a> {
    crate::kernels::ops::Norm::Layer { gamma, beta }
}
