//! One decoder layer on a device: its (shard of) weights, and its ops bound once to an
//! activation set. A layer's forward is split where tensor parallelism all-reduces:
//! `attention` leaves the (partial) output projection in `attn_out`, `attention_residual`
//! adds it (and the bias, once) to the residual stream; likewise `mlp` / `mlp_residual`.
//! A post-norm layer (BERT) skips the norm at the start of each half and applies it at the
//! end of its residual, after the (all-reduced) output has been added.

use std::ops::Range;

use super::act::Buffers;
use super::kv::KvLayer;
use super::matrix::{DeviceMatrix, Projection};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{
    Elementwise, ElementwiseOp, HeadNormOp, Norm, NormOp, Operand, Params, Pass, Rope, RopeHeads,
    RopeTables,
};
use crate::kernels::quant::PackedMatrix;
use crate::model::config::{Activation, ModelConfig};
use crate::model::quant::{check_block_split, quantize, QuantType};
use crate::model::shard::{slice_cols, slice_rows, ShardSpec};
use crate::model::weights::{matrix_values, BlockMatrix, LayerWeights};

/// One decoder layer's (shard of) weights on a device.
pub(super) struct GpuLayer {
    pub(super) shard: ShardSpec,
    attn_norm: Tensor,
    attn_norm_bias: Option<Tensor>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    /// Qwen3's per-head query and key norm scales (whole on every shard: each head has them).
    qk_norm: Option<(Tensor, Tensor)>,
    /// Gemma's norms of the attention and MLP outputs (whole on every shard: they apply
    /// after the all-reduce).
    out_norms: Option<(Tensor, Tensor)>,
    /// Whether the layer slides (rotates with the sliding layers' RoPE tables).
    sliding: bool,
    wo: DeviceMatrix,
    bo: Option<Tensor>,
    mlp_norm: Tensor,
    mlp_norm_bias: Option<Tensor>,
    w_gate: Option<DeviceMatrix>,
    w_up: DeviceMatrix,
    b_up: Option<Tensor>,
    w_down: DeviceMatrix,
    b_down: Option<Tensor>,
}

/// The part of a `[rows][cols]` matrix a shard holds.
#[derive(Clone)]
enum Part {
    /// Output rows (Q/K/V, up, gate).
    Rows(Range<usize>),
    /// Input columns (attention output, down).
    Cols(Range<usize>),
}

/// One projection matrix to upload: its dense values, the file's blocks if kept, its shape.
struct MatrixSource<'a> {
    name: String,
    dense: &'a [f32],
    blocks: Option<&'a BlockMatrix>,
    /// Columns of the whole matrix.
    cols: usize,
    part: Part,
}

/// How matrices are stored: `--dtype` for dense ones, `--weights` for packing.
#[derive(Clone, Copy)]
struct Storage {
    dtype: DType,
    packed: Option<QuantType>,
}

impl Storage {
    /// The file's blocks, when they are kept: always without `--weights`, and with it when
    /// they are already in its type.
    fn kept<'a>(&self, blocks: Option<&'a BlockMatrix>) -> Option<&'a BlockMatrix> {
        blocks.filter(|b| self.packed.is_none_or(|t| t == b.dtype))
    }

    /// Checks that a column split keeps whole blocks of the type `src` is stored in.
    fn check_split(&self, src: &MatrixSource<'_>) -> Result<()> {
        let Part::Cols(cols) = &src.part else {
            return Ok(());
        };
        match (self.kept(src.blocks), self.packed) {
            (Some(b), _) => check_block_split(b.dtype, &src.name, cols, true),
            (None, Some(t)) => check_block_split(t, &src.name, cols, false),
            (None, None) => Ok(()),
        }
    }

    fn upload(&self, gpu: &Gpu, src: &MatrixSource<'_>) -> Result<DeviceMatrix> {
        if let Some(b) = self.kept(src.blocks) {
            let part = match &src.part {
                Part::Rows(r) => b.slice_rows(r.clone()),
                Part::Cols(c) => b.slice_cols(c.clone()),
            };
            let shape = (part.rows, part.cols);
            return PackedMatrix::upload(gpu, &src.name, part.dtype, &part.bytes, shape)
                .map(DeviceMatrix::Packed);
        }
        // A file's blocks re-packed by `--weights`: dequantized here, one matrix at a time.
        let dense = matrix_values(src.dense, src.blocks);
        let (data, cols) = match &src.part {
            Part::Rows(r) => (slice_rows(&dense, src.cols, r.clone()), src.cols),
            Part::Cols(c) => (slice_cols(&dense, src.cols, c.clone()), c.len()),
        };
        let Some(t) = self.packed else {
            let w = gpu.upload_weights(&src.name, &data, self.dtype)?;
            return Ok(DeviceMatrix::Dense(w));
        };
        let rows = data.len() / cols.max(1);
        PackedMatrix::upload(gpu, &src.name, t, &quantize(t, &data), (rows, cols))
            .map(DeviceMatrix::Packed)
    }
}

pub(super) fn upload_opt(gpu: &Gpu, what: &str, v: Option<&Vec<f32>>) -> Result<Option<Tensor>> {
    v.map(|v| gpu.upload_f32(what, v)).transpose()
}

pub(super) fn norm<'a>(gamma: &'a Tensor, beta: &'a Option<Tensor>) -> Norm<'a> {
    match beta {
        Some(beta) => Norm::Layer { gamma, beta },
        None => Norm::Rms { gamma },
    }
}

/// What binding a layer's ops needs beside its weights and the activation buffers.
pub(super) struct BindContext<'a> {
    pub config: &'a ModelConfig,
    /// Tokens and sequences the activation set holds.
    pub tokens: usize,
    pub batch: usize,
    pub rope: Option<RopeTables<'a>>,
    /// The sliding layers' own RoPE tables (Gemma 3), where the part holds such a layer.
    pub rope_local: Option<RopeTables<'a>>,
}

/// Most params slots one layer's ops take (see [`GpuLayer::bind`]).
pub(super) const PARAM_SLOTS: usize = 20;

/// A layer's ops bound to one activation set (the KV cache's ops are bound per cache, see
/// `kv::KvLayer`).
pub(super) struct LayerOps {
    attn_norm: Option<NormOp>,
    q: Projection,
    k: Projection,
    v: Projection,
    qk_norm: Option<(HeadNormOp, HeadNormOp)>,
    rope: Option<(Rope, Rope)>,
    o: Projection,
    attn_bias: Option<ElementwiseOp>,
    attn_add: ElementwiseOp,
    attn_post_norm: Option<NormOp>,
    /// Gemma's norms of the block outputs before their residual adds (`attn_out` and
    /// `mlp_out` into `h`, which the adds then read).
    out_norms: Option<(NormOp, NormOp)>,
    mlp_norm: Option<NormOp>,
    up: Projection,
    gate: Option<Projection>,
    activation: ElementwiseOp,
    down: Projection,
    mlp_bias: Option<ElementwiseOp>,
    mlp_add: ElementwiseOp,
    mlp_post_norm: Option<NormOp>,
}

/// What binding one layer's ops reads: the device, the activation buffers and the context.
struct Binder<'a> {
    gpu: &'a Gpu,
    a: &'a Buffers,
    cx: &'a BindContext<'a>,
}

impl Binder<'_> {
    /// `y = x w^T (+ bias)` over the activation set's tokens, dense or on packed blocks.
    fn matmul(
        &self,
        params: &mut Params,
        (x, w, bias, y): (&Tensor, &DeviceMatrix, Option<&Tensor>, &Tensor),
        (n, k): (usize, usize),
    ) -> Result<Projection> {
        Projection::bind(self.gpu, params, (x, w, bias, y), (self.cx.tokens, n, k))
    }

    /// A norm of the stream `x` into `h`.
    fn norm(&self, params: &mut Params, gamma: &Tensor, beta: &Option<Tensor>) -> Result<NormOp> {
        let (t, h, eps) = (
            self.cx.tokens,
            self.cx.config.hidden,
            self.cx.config.norm_eps,
        );
        NormOp::bind(
            self.gpu,
            params,
            norm(gamma, beta),
            (&self.a.x, &self.a.h),
            (t, h),
            eps,
        )
    }

    /// RMSNorm of a block's (all-reduced) output `out` into `h` (Gemma's output norms).
    fn out_norm(&self, params: &mut Params, gamma: &Tensor, out: &Tensor) -> Result<NormOp> {
        let (t, h, eps) = (
            self.cx.tokens,
            self.cx.config.hidden,
            self.cx.config.norm_eps,
        );
        NormOp::bind(
            self.gpu,
            params,
            Norm::Rms { gamma },
            (out, &self.a.h),
            (t, h),
            eps,
        )
    }

    /// The per-head norms of the shard's queries and keys, in place, where the model has them.
    fn qk_norm(
        &self,
        params: &mut Params,
        s: &ShardSpec,
        scales: Option<&(Tensor, Tensor)>,
    ) -> Result<Option<(HeadNormOp, HeadNormOp)>> {
        let Some((q_scale, k_scale)) = scales else {
            return Ok(None);
        };
        let (a, c) = (self.a, self.cx.config);
        let mut bind = |scale: &Tensor, y: &Tensor, heads: usize| {
            let shape = (self.cx.tokens, heads, c.head_dim);
            HeadNormOp::bind(self.gpu, params, (scale, y), shape, c.norm_eps)
        };
        Ok(Some((
            bind(q_scale, &a.q, s.local_heads())?,
            bind(k_scale, &a.k, s.local_kv_heads())?,
        )))
    }

    /// RoPE on the shard's queries and keys, where the family rotates them: a sliding
    /// layer's with the sliding layers' tables.
    fn rope(
        &self,
        params: &mut Params,
        s: &ShardSpec,
        sliding: bool,
    ) -> Result<Option<(Rope, Rope)>> {
        let tables = match sliding {
            true => self.cx.rope_local,
            false => self.cx.rope,
        };
        let Some(tables) = tables else {
            if sliding && self.cx.rope.is_some() {
                // The upload makes the local tables whenever the model has sliding layers.
                return Err(WgparError::Internal(
                    "a sliding layer without the sliding layers' RoPE tables".into(),
                ));
            }
            return Ok(None);
        };
        let (a, c) = (self.a, self.cx.config);
        let mut rope = |x: &Tensor, n_heads: usize| {
            let shape = (self.cx.batch, self.cx.tokens);
            let heads = RopeHeads {
                n_heads,
                head_dim: c.head_dim,
                rot_dim: c.rope_dim(),
            };
            Rope::bind(self.gpu, params, (x, tables, &a.seqs), shape, heads)
        };
        Ok(Some((
            rope(&a.q, s.local_heads())?,
            rope(&a.k, s.local_kv_heads())?,
        )))
    }
}

/// A layer's projections, bound.
struct Projections {
    q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    up: Projection,
    gate: Option<Projection>,
    down: Projection,
}

/// A layer's norms, bound: before the blocks (pre-norm) or after them (post-norm).
struct Norms {
    attn: Option<NormOp>,
    attn_post: Option<NormOp>,
    mlp: Option<NormOp>,
    mlp_post: Option<NormOp>,
}

/// A layer's biases, residual adds and activation, bound.
struct Elementwises {
    attn_bias: Option<ElementwiseOp>,
    mlp_bias: Option<ElementwiseOp>,
    attn_add: ElementwiseOp,
    mlp_add: ElementwiseOp,
    activation: ElementwiseOp,
}

impl GpuLayer {
    pub(super) fn upload<'a>(
        gpu: &Gpu,
        config: &ModelConfig,
        index: usize,
        w: &'a LayerWeights,
        shard: &ShardSpec,
        (dtype, packed): (DType, Option<QuantType>),
    ) -> Result<Self> {
        let h = config.hidden;
        let d = config.head_dim;
        let q_rows = shard.q_heads.start * d..shard.q_heads.end * d;
        let kv_rows = shard.kv_heads.start * d..shard.kv_heads.end * d;
        let f = shard.ffn.clone();
        let name = |part: &str| format!("layer{index}.{part}");
        let storage = Storage { dtype, packed };
        let b = &w.blocks;
        let src = |part: &str,
                   dense: &'a [f32],
                   blocks: Option<&'a BlockMatrix>,
                   (cols, part_of): (usize, Part)| MatrixSource {
            name: name(part),
            dense,
            blocks,
            cols,
            part: part_of,
        };
        let [q, k, v, o, up, down] = [
            src("wq", &w.wq, b.wq.as_ref(), (h, Part::Rows(q_rows.clone()))),
            src("wk", &w.wk, b.wk.as_ref(), (h, Part::Rows(kv_rows.clone()))),
            src("wv", &w.wv, b.wv.as_ref(), (h, Part::Rows(kv_rows.clone()))),
            src(
                "wo",
                &w.wo,
                b.wo.as_ref(),
                (config.q_dim(), Part::Cols(q_rows.clone())),
            ),
            src("w_up", &w.w_up, b.w_up.as_ref(), (h, Part::Rows(f.clone()))),
            src(
                "w_down",
                &w.w_down,
                b.w_down.as_ref(),
                (config.ffn, Part::Cols(f.clone())),
            ),
        ];
        let gate = (w.w_gate.as_ref())
            .map(|g| src("w_gate", g, b.w_gate.as_ref(), (h, Part::Rows(f.clone()))));
        // Every split is checked before anything is uploaded.
        for m in [&q, &k, &v, &o, &up, &down]
            .into_iter()
            .chain(gate.as_ref())
        {
            storage.check_split(m)?;
        }
        let vector = |part: &str, data: &[f32]| gpu.upload_f32(&name(part), data);
        let opt_slice = |part: &str, v: &Option<Vec<f32>>, r: Range<usize>| {
            v.as_ref()
                .map(|v| gpu.upload_f32(&name(part), &v[r]))
                .transpose()
        };
        Ok(Self {
            attn_norm: vector("attn_norm", &w.attn_norm)?,
            attn_norm_bias: upload_opt(gpu, &name("attn_norm_bias"), w.attn_norm_bias.as_ref())?,
            wq: storage.upload(gpu, &q)?,
            wk: storage.upload(gpu, &k)?,
            wv: storage.upload(gpu, &v)?,
            bq: opt_slice("bq", &w.bq, q_rows.clone())?,
            bk: opt_slice("bk", &w.bk, kv_rows.clone())?,
            bv: opt_slice("bv", &w.bv, kv_rows)?,
            qk_norm: qk_norm_scales(gpu, config, index, w)?,
            out_norms: out_norm_scales(gpu, config, index, w)?,
            sliding: config.layer_window(index).is_some(),
            wo: storage.upload(gpu, &o)?,
            bo: upload_opt(gpu, &name("bo"), w.bo.as_ref())?,
            mlp_norm: vector("mlp_norm", &w.mlp_norm)?,
            mlp_norm_bias: upload_opt(gpu, &name("mlp_norm_bias"), w.mlp_norm_bias.as_ref())?,
            w_gate: gate.map(|g| storage.upload(gpu, &g)).transpose()?,
            w_up: storage.upload(gpu, &up)?,
            b_up: opt_slice("b_up", &w.b_up, f.clone())?,
            w_down: storage.upload(gpu, &down)?,
            b_down: upload_opt(gpu, &name("b_down"), w.b_down.as_ref())?,
            shard: shard.clone(),
        })
    }

    /// Binds this layer's ops over the activation buffers `a`: what the layer computes, in
    /// order, written once. Takes at most [`PARAM_SLOTS`] slots of `params`.
    pub(super) fn bind(
        &self,
        gpu: &Gpu,
        params: &mut Params,
        a: &Buffers,
        cx: &BindContext<'_>,
    ) -> Result<LayerOps> {
        let b = Binder { gpu, a, cx };
        let p = self.bind_projections(&b, params)?;
        let norms = self.bind_norms(&b, params)?;
        let qk_norm = b.qk_norm(params, &self.shard, self.qk_norm.as_ref())?;
        let rope = b.rope(params, &self.shard, self.sliding)?;
        let out_norms = match &self.out_norms {
            Some((attn, mlp)) => Some((
                b.out_norm(params, attn, &a.attn_out)?,
                b.out_norm(params, mlp, &a.mlp_out)?,
            )),
            None => None,
        };
        let tail = self.bind_elementwise(&b, params, p.gate.is_some())?;
        Ok(LayerOps {
            attn_norm: norms.attn,
            q: p.q,
            k: p.k,
            v: p.v,
            qk_norm,
            rope,
            o: p.o,
            attn_bias: tail.attn_bias,
            attn_add: tail.attn_add,
            attn_post_norm: norms.attn_post,
            out_norms,
            mlp_norm: norms.mlp,
            up: p.up,
            gate: p.gate,
            activation: tail.activation,
            down: p.down,
            mlp_bias: tail.mlp_bias,
            mlp_add: tail.mlp_add,
            mlp_post_norm: norms.mlp_post,
        })
    }

    /// The seven projections (the gate where the family has one), in upload order.
    fn bind_projections(&self, b: &Binder<'_>, params: &mut Params) -> Result<Projections> {
        let (c, s, a) = (b.cx.config, &self.shard, b.a);
        let h = c.hidden;
        let (q_dim, kv_dim, f) = (
            s.local_heads() * c.head_dim,
            s.local_kv_heads() * c.head_dim,
            s.local_ffn(),
        );
        // Pre-norm layers project the normed stream `h`; post-norm ones the stream itself.
        let input = if c.post_norm() { &a.x } else { &a.h };
        let mut mm = |x, w, bias, y, nk| b.matmul(params, (x, w, bias, y), nk);
        let q = mm(input, &self.wq, self.bq.as_ref(), &a.q, (q_dim, h))?;
        let k = mm(input, &self.wk, self.bk.as_ref(), &a.k, (kv_dim, h))?;
        let v = mm(input, &self.wv, self.bv.as_ref(), &a.v, (kv_dim, h))?;
        let o = mm(&a.attn, &self.wo, None, &a.attn_out, (h, q_dim))?;
        let up = mm(input, &self.w_up, self.b_up.as_ref(), &a.up, (f, h))?;
        let gate = match &self.w_gate {
            Some(w) => Some(mm(input, w, None, &a.gate, (f, h))?),
            None => None,
        };
        // SwiGLU leaves its result in `gate`; GELU works on `up` in place.
        let hidden_act = if gate.is_some() { &a.gate } else { &a.up };
        let down = mm(hidden_act, &self.w_down, None, &a.mlp_out, (h, f))?;
        Ok(Projections {
            q,
            k,
            v,
            o,
            up,
            gate,
            down,
        })
    }

    /// The two norms: before each block (pre-norm), or after its residual add (post-norm).
    fn bind_norms(&self, b: &Binder<'_>, params: &mut Params) -> Result<Norms> {
        let post = b.cx.config.post_norm();
        let attn = b.norm(params, &self.attn_norm, &self.attn_norm_bias)?;
        let mlp = b.norm(params, &self.mlp_norm, &self.mlp_norm_bias)?;
        Ok(match post {
            true => Norms {
                attn: None,
                attn_post: Some(attn),
                mlp: None,
                mlp_post: Some(mlp),
            },
            false => Norms {
                attn: Some(attn),
                attn_post: None,
                mlp: Some(mlp),
                mlp_post: None,
            },
        })
    }

    /// The output biases, residual adds and the MLP's activation (SwiGLU with a gate).
    fn bind_elementwise(
        &self,
        b: &Binder<'_>,
        params: &mut Params,
        gated: bool,
    ) -> Result<Elementwises> {
        let (a, h, f) = (b.a, b.cx.config.hidden, self.shard.local_ffn());
        let mut ew = |kind, x: &Tensor, operand: Operand<'_>, cols| {
            ElementwiseOp::bind(b.gpu, params, kind, (x, operand), (b.cx.tokens, cols))
        };
        let attn_bias = (self.bo.as_ref())
            .map(|bo| ew(Elementwise::BiasAdd, &a.attn_out, Operand::Tensor(bo), h))
            .transpose()?;
        let mlp_bias = (self.b_down.as_ref())
            .map(|bd| ew(Elementwise::BiasAdd, &a.mlp_out, Operand::Tensor(bd), h))
            .transpose()?;
        // With output norms the adds read the normed outputs, which the norms leave in `h`.
        let (attn_sum, mlp_sum) = match self.out_norms {
            Some(_) => (&a.h, &a.h),
            None => (&a.attn_out, &a.mlp_out),
        };
        let attn_add = ew(Elementwise::Add, &a.x, Operand::Tensor(attn_sum), h)?;
        let mlp_add = ew(Elementwise::Add, &a.x, Operand::Tensor(mlp_sum), h)?;
        let activation = if gated {
            let kind = match b.cx.config.activation {
                Activation::GeluTanhGated => Elementwise::GeGlu,
                _ => Elementwise::SwiGlu,
            };
            ew(kind, &a.gate, Operand::Tensor(&a.up), f)?
        } else {
            let kind = match b.cx.config.activation {
                Activation::GeluErf => Elementwise::GeluErf,
                _ => Elementwise::Gelu,
            };
            ew(kind, &a.up, Operand::Unused(&a.unused), f)?
        };
        Ok(Elementwises {
            attn_bias,
            mlp_bias,
            attn_add,
            mlp_add,
            activation,
        })
    }
}

impl LayerOps {
    /// Configures every op for `batch` rows of `seq` tokens.
    pub(super) fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        (batch, seq): (usize, usize),
    ) -> Result<()> {
        let t = batch * seq;
        for m in [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.up,
        ]
        .into_iter()
        .chain(self.gate.as_mut())
        .chain([&mut self.down])
        {
            m.configure(gpu, params, t)?;
        }
        for n in [
            &mut self.attn_norm,
            &mut self.attn_post_norm,
            &mut self.mlp_norm,
            &mut self.mlp_post_norm,
        ]
        .into_iter()
        .flatten()
        {
            n.configure(gpu, params, t)?;
        }
        if let Some((attn, mlp)) = &mut self.out_norms {
            attn.configure(gpu, params, t)?;
            mlp.configure(gpu, params, t)?;
        }
        for e in [&mut self.attn_bias, &mut self.mlp_bias]
            .into_iter()
            .flatten()
            .chain([&mut self.attn_add, &mut self.mlp_add, &mut self.activation])
        {
            e.configure(gpu, params, t)?;
        }
        if let Some((q, k)) = &mut self.qk_norm {
            q.configure(gpu, params, t)?;
            k.configure(gpu, params, t)?;
        }
        if let Some((q, k)) = &mut self.rope {
            q.configure(gpu, params, (batch, seq))?;
            k.configure(gpu, params, (batch, seq))?;
        }
        Ok(())
    }

    /// Attention half up to the output projection: norm, Q/K/V, per-head Q/K norms (Qwen3),
    /// RoPE, KV append, attention, output projection into `attn_out` (partial under tensor
    /// parallelism, no bias).
    pub(super) fn attention(&self, pass: &mut Pass<'_>, kv: &KvLayer) -> Result<()> {
        if let Some(n) = &self.attn_norm {
            pass.run(n)?;
        }
        pass.run(&self.q)?;
        pass.run(&self.k)?;
        pass.run(&self.v)?;
        if let Some((q, k)) = &self.qk_norm {
            pass.run(q)?;
            pass.run(k)?;
        }
        if let Some((q, k)) = &self.rope {
            pass.run(q)?;
            pass.run(k)?;
        }
        pass.run(&kv.store)?;
        pass.run(&kv.attend)?;
        pass.run(&self.o)
    }

    /// Adds the (all-reduced) attention output and its bias to the residual stream, then the
    /// post-norm where the model has one.
    pub(super) fn attention_residual(
        &self,
        pass: &mut Pass<'_>,
        a: &Buffers,
        t: usize,
    ) -> Result<()> {
        if let Some((n, _)) = &self.out_norms {
            pass.run(n)?;
        }
        residual(
            pass,
            a,
            t,
            (&self.attn_bias, &self.attn_add, &self.attn_post_norm),
        )
    }

    /// MLP half: norm, up (and gate), activation, down projection into `mlp_out` (partial
    /// under tensor parallelism, no bias).
    pub(super) fn mlp(&self, pass: &mut Pass<'_>) -> Result<()> {
        if let Some(n) = &self.mlp_norm {
            pass.run(n)?;
        }
        pass.run(&self.up)?;
        if let Some(g) = &self.gate {
            pass.run(g)?;
        }
        pass.run(&self.activation)?;
        pass.run(&self.down)
    }

    /// Adds the (all-reduced) MLP output and its bias to the residual stream, then the
    /// post-norm where the model has one.
    pub(super) fn mlp_residual(&self, pass: &mut Pass<'_>, a: &Buffers, t: usize) -> Result<()> {
        if let Some((_, n)) = &self.out_norms {
            pass.run(n)?;
        }
        residual(
            pass,
            a,
            t,
            (&self.mlp_bias, &self.mlp_add, &self.mlp_post_norm),
        )
    }
}

/// Layer `index`'s query and key norm scales on the device, where the config asks for them;
/// weights that do not match the config (scales missing, extra or of another width) are
/// refused rather than run without them.
fn qk_norm_scales(
    gpu: &Gpu,
    config: &ModelConfig,
    index: usize,
    w: &LayerWeights,
) -> Result<Option<(Tensor, Tensor)>> {
    let pair = NormPair {
        feature: "qk_norm",
        what: "query/key",
        names: ["q_norm", "k_norm"],
        scales: [&w.q_norm, &w.k_norm],
        want: config.qk_norm.then_some(config.head_dim),
        basis: format!(
            "head_dim {} with qk_norm {}",
            config.head_dim, config.qk_norm
        ),
    };
    pair.upload(gpu, config, index)
}

/// Layer `index`'s output norm scales on the device, where the config asks for them
/// (`sandwich_norms`); weights that do not match the config are refused.
fn out_norm_scales(
    gpu: &Gpu,
    config: &ModelConfig,
    index: usize,
    w: &LayerWeights,
) -> Result<Option<(Tensor, Tensor)>> {
    let pair = NormPair {
        feature: "sandwich_norms",
        what: "attention/MLP output",
        names: ["attn_out_norm", "mlp_out_norm"],
        scales: [&w.attn_out_norm, &w.mlp_out_norm],
        want: config.sandwich_norms.then_some(config.hidden),
        basis: format!(
            "hidden {} with sandwich_norms {}",
            config.hidden, config.sandwich_norms
        ),
    };
    pair.upload(gpu, config, index)
}

/// Two optional norm scale vectors a config feature asks for together.
struct NormPair<'a> {
    /// The config feature, for the error.
    feature: &'static str,
    /// What the two scales belong to, for the error.
    what: &'static str,
    /// Their tensor names within the layer.
    names: [&'static str; 2],
    scales: [&'a Option<Vec<f32>>; 2],
    /// The width each must have, `None` where the config asks for neither.
    want: Option<usize>,
    /// The config values the width comes from, for the error.
    basis: String,
}

impl NormPair<'_> {
    /// Both scales on the device, or `None` where the config asks for neither; a pair that
    /// does not match the config is refused.
    fn upload(
        &self,
        gpu: &Gpu,
        config: &ModelConfig,
        index: usize,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let width = |v: &Option<Vec<f32>>| v.as_ref().map(Vec::len);
        let [a, b] = self.scales;
        let want = self.want;
        if width(a) != want || width(b) != want {
            return Err(WgparError::model(
                config.name.clone(),
                self.feature,
                format!(
                    "layer {index}: {} norm scales of {:?} / {:?} values, but the config asks \
                     for {want:?} ({})",
                    self.what,
                    width(a),
                    width(b),
                    self.basis
                ),
            ));
        }
        let (Some(a), Some(b)) = (a, b) else {
            return Ok(None);
        };
        let name = |part: &str| format!("layer{index}.{part}");
        Ok(Some((
            gpu.upload_f32(&name(self.names[0]), a)?,
            gpu.upload_f32(&name(self.names[1]), b)?,
        )))
    }
}

/// `x += out (+ bias)`, then `x = norm(x)` through the scratch `h` for a post-norm model (a
/// kernel may not read and write one buffer).
fn residual(
    pass: &mut Pass<'_>,
    a: &Buffers,
    tokens: usize,
    (bias, add, post_norm): (&Option<ElementwiseOp>, &ElementwiseOp, &Option<NormOp>),
) -> Result<()> {
    if let Some(b) = bias {
        pass.run(b)?;
    }
    pass.run(add)?;
    if let Some(n) = post_norm {
        pass.run(n)?;
        a.copy_h_to_x(pass, tokens);
    }
    Ok(())
}
