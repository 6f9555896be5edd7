//! Typed kernel calls. Each checks its operands against the shape it is given (a wrong length is
//! an error, never an out-of-bounds GPU access) and records one dispatch into an encoder.

use bytemuck::{Pod, Zeroable};

use super::{Family, WeightType};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};

/// Largest workgroup count per dimension that every adapter accepts.
const MAX_GROUPS: u32 = 65_535;
/// Most rows (tokens of one step) a row-per-workgroup kernel takes in one dispatch; the CLI
/// checks a run's shapes against it before opening devices. Lift both together.
pub const MAX_ROWS_PER_DISPATCH: usize = MAX_GROUPS as usize;
/// Matmul rows per workgroup, columns per invocation and workgroup size; must match
/// `shaders/matmul.wgsl`.
const MATMUL_TM: u32 = 4;
const MATMUL_TN: u32 = 4;
const MATMUL_WG: u32 = 8;

fn weight_type(t: &Tensor) -> WeightType {
    match t.dtype() {
        DType::F16 => WeightType::F16,
        _ => WeightType::F32,
    }
}

fn need(op: &str, name: &str, t: &Tensor, len: usize, dtype: Option<DType>) -> Result<()> {
    if t.len() < len {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{name} has {} elements, needs {len}", t.len()),
        });
    }
    if let Some(d) = dtype {
        if t.dtype() != d {
            return Err(WgparError::Shape {
                op: op.into(),
                detail: format!("{name} is {:?}, needs {d:?}", t.dtype()),
            });
        }
    }
    Ok(())
}

fn to_u32(op: &str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| WgparError::Shape {
        op: op.into(),
        detail: format!("{what} = {v} exceeds u32"),
    })
}

/// Workgroups for `items` invocations in groups of `wg`, folded into two dimensions when one
/// would exceed the per-dimension limit (the shaders linearise `wid.y * nwg.x + wid.x`).
fn grid_1d(op: &str, items: usize, wg: u32) -> Result<[u32; 3]> {
    let groups = items.div_ceil(wg as usize).max(1);
    let x = groups.min(MAX_GROUPS as usize);
    let y = groups.div_ceil(x);
    if y > MAX_GROUPS as usize {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{items} invocations exceed the dispatch limit"),
        });
    }
    Ok([x as u32, y as u32, 1])
}

fn rows_grid(op: &str, rows: usize) -> Result<[u32; 3]> {
    if rows > MAX_GROUPS as usize {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{rows} rows exceed {MAX_GROUPS} (one workgroup per row)"),
        });
    }
    Ok([rows.max(1) as u32, 1, 1])
}

/// Records one dispatch: binds `buffers` in the family's binding order, then `params` as the
/// final uniform binding.
#[allow(clippy::too_many_arguments)]
fn dispatch<P: Pod>(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    family: Family,
    entry: &'static str,
    weights: WeightType,
    buffers: &[&wgpu::Buffer],
    params: &P,
    groups: [u32; 3],
) {
    let kernel = gpu.kernels().get(gpu.device(), family, entry, weights);
    let uniform = gpu.uniform(params);
    let mut entries: Vec<wgpu::BindGroupEntry> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: b.as_entire_binding(),
        })
        .collect();
    entries.push(wgpu::BindGroupEntry {
        binding: buffers.len() as u32,
        resource: uniform.as_entire_binding(),
    });
    let bind_group = gpu.device().create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(entry),
        layout: &kernel.layout,
        entries: &entries,
    });
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some(entry),
        timestamp_writes: None,
    });
    pass.set_pipeline(&kernel.pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

/// Which matmul kernel to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// The production kernel (register-tiled).
    Tiled,
    /// One invocation per output: the benchmark baseline.
    Naive,
}

/// `y[m][n] = x[m][k] . w[n][k] (+ bias[n])`, with `w` stored transposed (f32 or f16).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    y: &Tensor,
    (m, n, k): (usize, usize, usize),
    kernel: MatmulKernel,
) -> Result<()> {
    const OP: &str = "matmul";
    need(OP, "x", x, m * k, Some(DType::F32))?;
    need(OP, "w", w, n * k, None)?;
    need(OP, "y", y, m * n, Some(DType::F32))?;
    if let Some(b) = bias {
        need(OP, "bias", b, n, Some(DType::F32))?;
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let params = MatmulParams {
        m: to_u32(OP, "m", m)?,
        n: to_u32(OP, "n", n)?,
        k: to_u32(OP, "k", k)?,
        has_bias: bias.is_some() as u32,
    };
    let (entry, groups) = match kernel {
        MatmulKernel::Tiled => (
            "matmul",
            [
                (n as u32).div_ceil(MATMUL_WG * MATMUL_TN),
                (m as u32).div_ceil(MATMUL_TM),
                1,
            ],
        ),
        MatmulKernel::Naive => (
            "matmul_naive",
            [(n as u32).div_ceil(8), (m as u32).div_ceil(8), 1],
        ),
    };
    if groups[0] > MAX_GROUPS || groups[1] > MAX_GROUPS {
        return Err(WgparError::Shape {
            op: OP.into(),
            detail: format!("{m}x{n} output exceeds the dispatch limit"),
        });
    }
    let bias_buf = bias.unwrap_or(x).buffer();
    // Inner dimensions divisible by 4 (every real model's) take the vec4-load kernel.
    let (family, entry) = if kernel == MatmulKernel::Tiled && k.is_multiple_of(4) {
        (Family::MatmulVec4, "matmul_vec4")
    } else {
        (Family::Matmul, entry)
    };
    dispatch(
        gpu,
        encoder,
        family,
        entry,
        weight_type(w),
        &[x.buffer(), w.buffer(), bias_buf, y.buffer()],
        &params,
        groups,
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct NormParams {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

/// Row normalisation kind.
#[derive(Debug, Clone, Copy)]
pub enum Norm<'a> {
    /// LayerNorm with scale and shift.
    Layer {
        /// Scale.
        gamma: &'a Tensor,
        /// Shift.
        beta: &'a Tensor,
    },
    /// RMSNorm with scale.
    Rms {
        /// Scale.
        gamma: &'a Tensor,
    },
}

/// `y = norm(x)` over rows of `cols`.
#[allow(clippy::too_many_arguments)]
pub fn norm(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    kind: Norm<'_>,
    x: &Tensor,
    y: &Tensor,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "norm";
    need(OP, "x", x, rows * cols, Some(DType::F32))?;
    need(OP, "y", y, rows * cols, Some(DType::F32))?;
    let (entry, gamma, beta) = match kind {
        Norm::Layer { gamma, beta } => ("layernorm", gamma, beta),
        Norm::Rms { gamma } => ("rmsnorm", gamma, gamma),
    };
    need(OP, "gamma", gamma, cols, Some(DType::F32))?;
    need(OP, "beta", beta, cols, Some(DType::F32))?;
    let params = NormParams {
        rows: to_u32(OP, "rows", rows)?,
        cols: to_u32(OP, "cols", cols)?,
        eps,
        _pad: 0,
    };
    dispatch(
        gpu,
        encoder,
        Family::Norm,
        entry,
        WeightType::F32,
        &[x.buffer(), y.buffer(), gamma.buffer(), beta.buffer()],
        &params,
        rows_grid(OP, rows)?,
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RowsParams {
    rows: u32,
    cols: u32,
    _pad: [u32; 2],
}

/// Softmax over each row of `x`, in place.
pub fn softmax(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    x: &Tensor,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "softmax";
    need(OP, "x", x, rows * cols, Some(DType::F32))?;
    let params = RowsParams {
        rows: to_u32(OP, "rows", rows)?,
        cols: to_u32(OP, "cols", cols)?,
        _pad: [0; 2],
    };
    dispatch(
        gpu,
        encoder,
        Family::Softmax,
        "softmax",
        WeightType::F32,
        &[x.buffer()],
        &params,
        rows_grid(OP, rows)?,
    );
    Ok(())
}

/// Shape of one attention call: which tokens and which cache. Where each sequence row's
/// tokens go (its KV slot and past length) comes from the step's sequence table ([`KvCache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Sequence rows in this call.
    pub batch: usize,
    /// New tokens per sequence in this call.
    pub seq: usize,
    /// Sequences the cache holds (its slots).
    pub slots: usize,
    /// Query heads (local to this device).
    pub n_heads: usize,
    /// Key/value heads (local to this device).
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// Cache capacity per sequence.
    pub max_seq: usize,
    /// Query heads per KV head in the whole model.
    pub group: usize,
    /// Global index of this device's first query head.
    pub q_head_offset: usize,
    /// Global index of this device's first KV head.
    pub kv_head_offset: usize,
}

impl AttnShape {
    /// Tokens in this call.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Elements in one layer's K (or V) cache.
    pub fn cache_len(&self) -> usize {
        self.slots * self.n_kv_heads * self.max_seq * self.head_dim
    }

    fn validate(&self, op: &str) -> Result<()> {
        let bad = |detail: String| {
            Err(WgparError::Shape {
                op: op.into(),
                detail,
            })
        };
        // Every local query head must map onto a local KV head.
        let first = self.q_head_offset / self.group.max(1);
        let last = (self.q_head_offset + self.n_heads.max(1) - 1) / self.group.max(1);
        if self.group == 0
            || self.n_heads == 0
            || first < self.kv_head_offset
            || last >= self.kv_head_offset + self.n_kv_heads
        {
            return bad(format!(
                "query heads {}..{} (group {}) do not map onto KV heads {}..{}",
                self.q_head_offset,
                self.q_head_offset + self.n_heads,
                self.group,
                self.kv_head_offset,
                self.kv_head_offset + self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || self.head_dim > 256 {
            return bad(format!("head_dim {} outside 1..=256", self.head_dim));
        }
        if self.slots == 0 || self.seq > self.max_seq {
            return bad(format!(
                "{} new tokens per sequence in a cache of {} slots x {} positions",
                self.seq, self.slots, self.max_seq
            ));
        }
        Ok(())
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AttnParams {
    batch: u32,
    seq: u32,
    slots: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    group: u32,
    q_offset: u32,
    kv_offset: u32,
    /// 1: causal; 0: bidirectional over each sequence's real keys (attention only; the KV
    /// store kernel ignores it).
    causal: u32,
}

impl AttnParams {
    fn new(op: &str, s: &AttnShape) -> Result<Self> {
        Ok(Self {
            batch: to_u32(op, "batch", s.batch)?,
            seq: to_u32(op, "seq", s.seq)?,
            slots: to_u32(op, "slots", s.slots)?,
            n_heads: to_u32(op, "n_heads", s.n_heads)?,
            n_kv_heads: to_u32(op, "n_kv_heads", s.n_kv_heads)?,
            head_dim: to_u32(op, "head_dim", s.head_dim)?,
            max_seq: to_u32(op, "max_seq", s.max_seq)?,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            group: to_u32(op, "group", s.group)?,
            q_offset: to_u32(op, "q_head_offset", s.q_head_offset)?,
            kv_offset: to_u32(op, "kv_head_offset", s.kv_head_offset)?,
            causal: 1,
        })
    }
}

/// Which keys a query sees.
#[derive(Debug, Clone, Copy)]
pub enum AttnMask<'a> {
    /// Positions up to the query's own (decoders).
    Causal,
    /// Every position of the sequence that is not padding (encoders): sequence `b` has
    /// `lens[b]` real tokens, `1 <= lens[b]`, values above `past + seq` meaning all of them.
    Bidirectional {
        /// `[batch]` u32 real-token counts.
        lens: &'a Tensor,
    },
}

/// One layer's KV cache (`[slots][kv_heads][max_seq][head_dim]` each) and the step's sequence
/// table that addresses it: `seqs[2b]` = the KV slot of sequence row `b`, `seqs[2b + 1]` = its
/// past length (u32). The table's values are validated on the host before it is written
/// (slots below the cache's, `past + seq <= max_seq`); kernels clamp them regardless.
#[derive(Debug, Clone, Copy)]
pub struct KvCache<'a> {
    /// Keys.
    pub k: &'a Tensor,
    /// Values.
    pub v: &'a Tensor,
    /// `[batch][2]` u32 sequence table of the step.
    pub seqs: &'a Tensor,
}

impl KvCache<'_> {
    fn check(&self, op: &str, shape: &AttnShape) -> Result<()> {
        need(op, "k_cache", self.k, shape.cache_len(), Some(DType::F32))?;
        need(op, "v_cache", self.v, shape.cache_len(), Some(DType::F32))?;
        need(op, "seqs", self.seqs, 2 * shape.batch, Some(DType::U32))
    }
}

/// Causal attention of `q` over the cache (which must already hold the new keys and values).
pub fn attention(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    q: &Tensor,
    cache: KvCache<'_>,
    out: &Tensor,
    shape: &AttnShape,
) -> Result<()> {
    attention_masked(gpu, encoder, q, cache, out, shape, AttnMask::Causal)
}

/// Attention of `q` over the cache (which must already hold the new keys and values), causal
/// or bidirectional as `mask` says.
pub fn attention_masked(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    q: &Tensor,
    cache: KvCache<'_>,
    out: &Tensor,
    shape: &AttnShape,
    mask: AttnMask<'_>,
) -> Result<()> {
    const OP: &str = "attention";
    shape.validate(OP)?;
    let q_len = shape.tokens() * shape.n_heads * shape.head_dim;
    need(OP, "q", q, q_len, Some(DType::F32))?;
    need(OP, "out", out, q_len, Some(DType::F32))?;
    cache.check(OP, shape)?;
    let mut params = AttnParams::new(OP, shape)?;
    // A causal call never reads `lens`; bind `q` there (read-only, so aliasing is allowed).
    let lens = match mask {
        AttnMask::Causal => q,
        AttnMask::Bidirectional { lens } => {
            need(OP, "lens", lens, shape.batch, Some(DType::U32))?;
            params.causal = 0;
            lens
        }
    };
    dispatch(
        gpu,
        encoder,
        Family::Attention,
        "attend",
        WeightType::F32,
        &[
            q.buffer(),
            cache.k.buffer(),
            cache.v.buffer(),
            lens.buffer(),
            out.buffer(),
            cache.seqs.buffer(),
        ],
        &params,
        grid_1d(OP, shape.tokens() * shape.n_heads, 64)?,
    );
    Ok(())
}

/// Appends `k`, `v` ([tokens][n_kv_heads * head_dim]) to the cache: row `b`'s tokens go to
/// its slot at positions `past ..` as the sequence table says.
pub fn kv_store(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    k: &Tensor,
    v: &Tensor,
    cache: KvCache<'_>,
    shape: &AttnShape,
) -> Result<()> {
    const OP: &str = "kv_store";
    shape.validate(OP)?;
    let len = shape.tokens() * shape.n_kv_heads * shape.head_dim;
    need(OP, "k", k, len, Some(DType::F32))?;
    need(OP, "v", v, len, Some(DType::F32))?;
    cache.check(OP, shape)?;
    dispatch(
        gpu,
        encoder,
        Family::KvCache,
        "kv_store",
        WeightType::F32,
        &[
            k.buffer(),
            v.buffer(),
            cache.k.buffer(),
            cache.v.buffer(),
            cache.seqs.buffer(),
        ],
        &AttnParams::new(OP, shape)?,
        grid_1d(OP, len, 256)?,
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RopeParams {
    tokens: u32,
    seq: u32,
    positions: u32,
    n_heads: u32,
    head_dim: u32,
    _pad: [u32; 3],
}

/// Host-built rotary tables `cos`, `sin` (`[positions][head_dim / 2]` each).
#[derive(Debug, Clone, Copy)]
pub struct RopeTables<'a> {
    /// Cosines.
    pub cos: &'a Tensor,
    /// Sines.
    pub sin: &'a Tensor,
    /// Positions the tables cover.
    pub positions: usize,
}

/// Rotary embedding in place on `x` ([batch * seq][n_heads * head_dim]): row `b`'s token `i`
/// is rotated by position `past + i`, `past` from the sequence table `seqs` (`[batch][2]`,
/// validated on the host against the tables).
pub fn rope(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    x: &Tensor,
    tables: RopeTables<'_>,
    seqs: &Tensor,
    (batch, seq): (usize, usize),
    (n_heads, head_dim): (usize, usize),
) -> Result<()> {
    const OP: &str = "rope";
    if !head_dim.is_multiple_of(2) {
        return Err(WgparError::Shape {
            op: OP.into(),
            detail: format!("head_dim {head_dim} must be even"),
        });
    }
    let tokens = batch * seq;
    need(OP, "x", x, tokens * n_heads * head_dim, Some(DType::F32))?;
    need(OP, "seqs", seqs, 2 * batch, Some(DType::U32))?;
    let table = tables.positions * head_dim / 2;
    if tables.positions == 0 {
        return Err(WgparError::Shape {
            op: OP.into(),
            detail: "rotary tables cover no positions".into(),
        });
    }
    need(OP, "cos", tables.cos, table, Some(DType::F32))?;
    need(OP, "sin", tables.sin, table, Some(DType::F32))?;
    if tokens == 0 {
        return Ok(());
    }
    let params = RopeParams {
        tokens: to_u32(OP, "tokens", tokens)?,
        seq: to_u32(OP, "seq", seq)?,
        positions: to_u32(OP, "positions", tables.positions)?,
        n_heads: to_u32(OP, "n_heads", n_heads)?,
        head_dim: to_u32(OP, "head_dim", head_dim)?,
        _pad: [0; 3],
    };
    dispatch(
        gpu,
        encoder,
        Family::Rope,
        "rope",
        WeightType::F32,
        &[
            x.buffer(),
            tables.cos.buffer(),
            tables.sin.buffer(),
            seqs.buffer(),
        ],
        &params,
        grid_1d(OP, tokens * n_heads * head_dim / 2, 256)?,
    );
    Ok(())
}

/// Element-wise operation, in place on the first operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elementwise {
    /// `a += b` (residual).
    Add,
    /// `a[r][c] += b[c]`.
    BiasAdd,
    /// `a = gelu_tanh(a)`.
    Gelu,
    /// `a = gelu_erf(a)`.
    GeluErf,
    /// `a = silu(a) * b`.
    SwiGlu,
}

/// Applies `op` to `a` (`rows x cols` elements), with `b` where the op takes one.
pub fn elementwise(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    op: Elementwise,
    a: &Tensor,
    b: Option<&Tensor>,
    (rows, cols): (usize, usize),
) -> Result<()> {
    const OP: &str = "elementwise";
    let len = rows * cols;
    need(OP, "a", a, len, Some(DType::F32))?;
    let (entry, b_len) = match op {
        Elementwise::Add => ("add", Some(len)),
        Elementwise::BiasAdd => ("bias_add", Some(cols)),
        Elementwise::Gelu => ("gelu", None),
        Elementwise::GeluErf => ("gelu_erf", None),
        Elementwise::SwiGlu => ("swiglu", Some(len)),
    };
    let b = match (b_len, b) {
        (Some(n), Some(b)) => {
            need(OP, "b", b, n, Some(DType::F32))?;
            b
        }
        (Some(_), None) => {
            return Err(WgparError::Shape {
                op: OP.into(),
                detail: format!("{op:?} needs a second operand"),
            })
        }
        (None, _) => a,
    };
    if len == 0 {
        return Ok(());
    }
    let params = RowsParams {
        rows: to_u32(OP, "len", len)?,
        cols: to_u32(OP, "cols", cols)?,
        _pad: [0; 2],
    };
    // `a` is bound read-write; when the op has no second operand a dummy read binding is
    // needed, and it must not alias `a`, so bind the params-sized scratch instead.
    let dummy;
    let b_buf = if std::ptr::eq(b, a) {
        dummy = gpu.empty("elementwise.dummy", DType::F32, 1)?;
        dummy.buffer()
    } else {
        b.buffer()
    };
    dispatch(
        gpu,
        encoder,
        Family::Elementwise,
        entry,
        WeightType::F32,
        &[a.buffer(), b_buf],
        &params,
        grid_1d(OP, len, 256)?,
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct EmbedParams {
    tokens: u32,
    hidden: u32,
    seq: u32,
    positions: u32,
    has_positions: u32,
    has_types: u32,
    _pad: [u32; 2],
}

/// Token type (segment) embeddings for [`embed_with_types`].
#[derive(Debug, Clone, Copy)]
pub struct TokenTypes<'a> {
    /// `[tokens]` u32 type per token, each < `count` (checked on the host).
    pub ids: &'a Tensor,
    /// `[count][hidden]` f32 table.
    pub table: &'a Tensor,
    /// Number of token types.
    pub count: usize,
}

/// Learned position embeddings (`[positions][hidden]` f32) and the step's sequence table
/// (`[batch][2]` u32, (KV slot, past) per row) that places each row's tokens: row `b`'s token
/// `i` takes position `past + i` (validated on the host against `positions`).
#[derive(Debug, Clone, Copy)]
pub struct Positions<'a> {
    /// The table.
    pub wpe: &'a Tensor,
    /// Rows of the table.
    pub positions: usize,
    /// The sequence table.
    pub seqs: &'a Tensor,
}

/// `out[t] = wte[ids[t]] (+ wpe[past + i])` for token `t = b * seq + i`. Token ids must be
/// < vocab (the caller checks them on the host, where the error can name the bad id).
pub fn embed(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    ids: &Tensor,
    wte: &Tensor,
    positions: Option<Positions<'_>>,
    out: &Tensor,
    (batch, seq, hidden): (usize, usize, usize),
) -> Result<()> {
    embed_with_types(
        gpu,
        encoder,
        Embedding {
            ids,
            wte,
            positions,
            types: None,
        },
        out,
        (batch, seq, hidden),
    )
}

/// The inputs of an embedding lookup.
#[derive(Debug, Clone, Copy)]
pub struct Embedding<'a> {
    /// `[tokens]` u32 token ids.
    pub ids: &'a Tensor,
    /// `[vocab][hidden]` token table (f32 or f16).
    pub wte: &'a Tensor,
    /// Learned positions, when the model has them.
    pub positions: Option<Positions<'a>>,
    /// Token types, when the model has them (BERT).
    pub types: Option<TokenTypes<'a>>,
}

/// [`embed`] plus, when `types` is given, `wtt[types[t]]` (BERT's segment embeddings).
pub fn embed_with_types(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    input: Embedding<'_>,
    out: &Tensor,
    (batch, seq, hidden): (usize, usize, usize),
) -> Result<()> {
    const OP: &str = "embed";
    let Embedding {
        ids,
        wte,
        positions,
        types,
    } = input;
    let tokens = batch * seq;
    need(OP, "ids", ids, tokens, Some(DType::U32))?;
    need(OP, "out", out, tokens * hidden, Some(DType::F32))?;
    if let Some(p) = &positions {
        need(OP, "wpe", p.wpe, p.positions * hidden, Some(DType::F32))?;
        need(OP, "seqs", p.seqs, 2 * batch, Some(DType::U32))?;
        if p.positions == 0 {
            return Err(WgparError::Shape {
                op: OP.into(),
                detail: "the position table is empty".into(),
            });
        }
    }
    if let Some(t) = &types {
        need(OP, "token types", t.ids, tokens, Some(DType::U32))?;
        need(
            OP,
            "token type table",
            t.table,
            t.count * hidden,
            Some(DType::F32),
        )?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let params = EmbedParams {
        tokens: to_u32(OP, "tokens", tokens)?,
        hidden: to_u32(OP, "hidden", hidden)?,
        seq: to_u32(OP, "seq", seq)?,
        positions: to_u32(OP, "positions", positions.map_or(0, |p| p.positions))?,
        has_positions: positions.is_some() as u32,
        has_types: types.is_some() as u32,
        _pad: [0; 2],
    };
    // Tables a call lacks are read bindings that are never read: bind the ids buffer there
    // rather than `out`, which is bound read-write.
    let (wpe_buf, seqs_buf) = positions.map_or((ids, ids), |p| (p.wpe, p.seqs));
    let (type_ids, type_table) = types.map_or((ids, ids), |t| (t.ids, t.table));
    dispatch(
        gpu,
        encoder,
        Family::Embedding,
        "embed",
        weight_type(wte),
        &[
            ids.buffer(),
            wte.buffer(),
            wpe_buf.buffer(),
            out.buffer(),
            type_ids.buffer(),
            type_table.buffer(),
            seqs_buf.buffer(),
        ],
        &params,
        grid_1d(OP, tokens * hidden, 256)?,
    );
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PoolParams {
    batch: u32,
    seq: u32,
    hidden: u32,
    mode: u32,
    normalize: u32,
    _pad: [u32; 3],
}

/// Encoder pooling: `out[b] = mean(x[b * seq .. b * seq + lens[b]])` (or `x[b * seq]` when
/// `first_token`), scaled to unit L2 norm when `normalize`. `lens` values must lie in
/// `1..=seq` (the caller checks them on the host).
#[allow(clippy::too_many_arguments)]
pub fn pool(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    x: &Tensor,
    lens: &Tensor,
    out: &Tensor,
    (batch, seq, hidden): (usize, usize, usize),
    first_token: bool,
    normalize: bool,
) -> Result<()> {
    const OP: &str = "pool";
    need(OP, "x", x, batch * seq * hidden, Some(DType::F32))?;
    need(OP, "lens", lens, batch, Some(DType::U32))?;
    need(OP, "out", out, batch * hidden, Some(DType::F32))?;
    let params = PoolParams {
        batch: to_u32(OP, "batch", batch)?,
        seq: to_u32(OP, "seq", seq)?,
        hidden: to_u32(OP, "hidden", hidden)?,
        mode: first_token as u32,
        normalize: normalize as u32,
        _pad: [0; 3],
    };
    dispatch(
        gpu,
        encoder,
        Family::Pool,
        "pool",
        WeightType::F32,
        &[x.buffer(), lens.buffer(), out.buffer()],
        &params,
        rows_grid(OP, batch)?,
    );
    Ok(())
}
