//! Kernel benchmark: every matmul variant that applies to each shape timed against the others
//! (the winner is what autotuning picks; today's kernel and the naive one are shown beside it),
//! the packed-weight variants of the types asked for, and the other kernels' GB/s, on one
//! device. Warm-up first, then the median of timed samples. With any matmul shape, a copy
//! kernel measures the attainable bandwidth first and every matmul row gets its weight
//! bandwidth's ratio to it (the roofline, `super::roofline`).

use std::time::Instant;

use serde::Serialize;

use super::ops::{self, AttnShape, Elementwise, Norm};
use super::roofline;
use super::tune::{self, Effort};
use super::variants::{self, Class, MatmulClass};
use super::WeightType;
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::model::quant::QuantType;

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct KernelBenchOptions {
    /// Square matmul sizes (M = N = K).
    pub sizes: Vec<usize>,
    /// Further matmul shapes `(m, n, k)` (e.g. decode GEMV `1 x 4096 x 14336`).
    pub shapes: Vec<(usize, usize, usize)>,
    /// Timed samples per kernel (the median is reported).
    pub iters: usize,
    /// Untimed samples first (the memory-bound kernels).
    pub warmup: usize,
    /// Dispatches recorded per timed submit (the memory-bound kernels; matmul variants size
    /// their own so a sample lasts ~10 ms).
    pub reps: usize,
    /// Also measure matmul with f16 weights (when the adapter allows).
    pub f16: bool,
    /// Also measure with f32 weights.
    pub f32: bool,
    /// Also time the naive one-invocation-per-output matmul (slow: seconds at 2048 on a CPU
    /// driver).
    pub naive: bool,
    /// Only these variants (empty: every one that applies).
    pub only: Vec<String>,
    /// Run the memory-bound kernels too.
    pub others: bool,
    /// Attention prefill lengths to time (tokens, one sequence, 32 heads of 128).
    pub attention_prefill: Vec<usize>,
    /// Store each shape's winner as the tuned choice (as first-use tuning would).
    pub save: bool,
    /// Packed weight types whose matmul variants run at every matmul shape (each shape's
    /// inner dimension a whole number of the type's blocks).
    pub qtypes: Vec<QuantType>,
    /// Bytes the bandwidth probe copies (`None`: [`roofline::DEFAULT_COPY_BYTES`], capped at
    /// the adapter's binding limit).
    pub copy_bytes: Option<u64>,
}

impl Default for KernelBenchOptions {
    fn default() -> Self {
        Self {
            sizes: vec![256, 512, 1024],
            shapes: Vec::new(),
            iters: 3,
            warmup: 1,
            reps: 4,
            f16: true,
            f32: true,
            naive: false,
            only: Vec::new(),
            others: true,
            attention_prefill: Vec::new(),
            save: true,
            qtypes: Vec::new(),
            copy_bytes: None,
        }
    }
}

/// One measured kernel.
#[derive(Debug, Clone, Serialize)]
pub struct KernelBenchRow {
    /// Kernel (variant) name.
    pub kernel: String,
    /// Shape, e.g. `512x512x512`.
    pub shape: String,
    /// Weight storage type.
    pub dtype: String,
    /// Median time per dispatch, milliseconds.
    pub median_ms: f64,
    /// Arithmetic rate (matmul, attention).
    pub gflops: Option<f64>,
    /// Memory traffic rate (bytes read + written / time).
    pub gbps: Option<f64>,
    /// Matmuls: bytes of the weights as stored (a packed type's blocks).
    pub weight_bytes: Option<u64>,
    /// Matmuls: bytes of the activations read and the outputs written (beside `weight_bytes`
    /// in `gbps`, not in `weight_gbps`).
    pub xy_bytes: Option<u64>,
    /// Matmuls: effective weight bandwidth, `weight_bytes` per second, GB/s.
    pub weight_gbps: Option<f64>,
    /// Matmuls: distinct weight buffers the timed dispatches rotate through (1: every
    /// dispatch reads the same weights, which a cache as large as them can serve; packed
    /// variants rotate through copies, `roofline::WEIGHT_WORKING_SET`).
    pub weight_buffers: Option<usize>,
    /// Matmuls: `weight_gbps` over the copy kernel's GB/s in the same run (the roofline
    /// fraction); `None` where no copy was measured.
    pub of_copy: Option<f64>,
    /// For matmul variants: speed-up over the naive kernel at the same shape (when timed).
    pub speedup_vs_naive: Option<f64>,
    /// For matmul variants: speed-up over today's kernel (the one wgpar ran before variants
    /// existed, for this shape) at the same shape, in the same run.
    pub speedup_vs_legacy: Option<f64>,
    /// The fastest variant for this shape and weight type (what tuning picks).
    pub winner: bool,
    /// Today's kernel for this shape.
    pub legacy: bool,
}

/// Times `record` (one dispatch) as the median over samples of `reps` dispatches per submit.
fn time(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    record: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>,
) -> Result<f64> {
    let mut samples = Vec::with_capacity(opts.iters);
    for i in 0..opts.warmup + opts.iters {
        let mut enc = gpu.encoder();
        for _ in 0..opts.reps {
            record(&mut enc)?;
        }
        let start = Instant::now();
        gpu.submit(enc);
        gpu.wait()?;
        let dt = start.elapsed().as_secs_f64() / opts.reps as f64;
        if i >= opts.warmup {
            samples.push(dt);
        }
    }
    crate::stats::median(samples)
        .ok_or_else(|| WgparError::Measurement("kernel benchmark needs at least one sample".into()))
}

fn random(len: usize, seed: u32) -> Vec<f32> {
    tune::pattern(len, seed)
}

/// A row of `kernel` at `shape` timed at `secs`, every rate unset.
pub(crate) fn row(kernel: &str, shape: String, dtype: &str, secs: f64) -> KernelBenchRow {
    KernelBenchRow {
        kernel: kernel.into(),
        shape,
        dtype: dtype.into(),
        median_ms: secs * 1e3,
        gflops: None,
        gbps: None,
        weight_bytes: None,
        xy_bytes: None,
        weight_gbps: None,
        weight_buffers: None,
        of_copy: None,
        speedup_vs_naive: None,
        speedup_vs_legacy: None,
        winner: false,
        legacy: false,
    }
}

/// Runs the benchmark on `gpu`. Matmul shapes the adapter cannot hold are skipped.
pub fn bench_kernels(gpu: &Gpu, opts: &KernelBenchOptions) -> Result<Vec<KernelBenchRow>> {
    let mut rows = Vec::new();
    let mut shapes: Vec<(usize, usize, usize)> = opts.sizes.iter().map(|&n| (n, n, n)).collect();
    shapes.extend(opts.shapes.iter().copied());
    let mut dtypes = Vec::new();
    if opts.f32 {
        dtypes.push(DType::F32);
    }
    if opts.f16 && gpu.supports_f16_weights() {
        dtypes.push(DType::F16);
    }
    let copy_gbps = if shapes.is_empty() {
        None
    } else {
        let copy = roofline::measure_copy(gpu, opts, opts.copy_bytes)?;
        let gbps = copy.gbps;
        rows.push(copy);
        gbps
    };
    let first_matmul = rows.len();
    for (m, n, k) in shapes {
        for &dtype in &dtypes {
            check_shape_fits(gpu, (m, n, k), dtype)?;
            rows.extend(bench_matmul(gpu, opts, (m, n, k), dtype)?);
        }
        for &qtype in &opts.qtypes {
            rows.extend(roofline::bench_packed(gpu, opts, (m, n, k), qtype)?);
        }
    }
    roofline::apply_copy_ratio(&mut rows[first_matmul..], copy_gbps);
    for &tokens in &opts.attention_prefill {
        rows.extend(bench_attention_prefill(gpu, opts, tokens)?);
    }
    if opts.others {
        rows.extend(bandwidth_kernels(gpu, opts)?);
    }
    Ok(rows)
}

/// A shape's operands must each fit one binding on `gpu`: one that does not is refused, naming
/// the shape and the limit, rather than left out of the table.
fn check_shape_fits(gpu: &Gpu, (m, n, k): (usize, usize, usize), dtype: DType) -> Result<()> {
    let wbytes = if dtype == DType::F16 { 2 } else { 4 };
    // In u128: shapes come from the command line and their products can overflow u64.
    let bytes = |a: usize, b: usize, size: u128| {
        u64::try_from(a as u128 * b as u128 * size).unwrap_or(u64::MAX)
    };
    let operands = [
        ("x", bytes(m, k, 4)),
        ("w", bytes(n, k, wbytes)),
        ("y", bytes(m, n, 4)),
    ];
    for (name, bytes) in operands {
        gpu.check_size(&format!("shape {m}x{n}x{k} ({dtype:?}): {name}"), bytes)
            .map_err(|e| WgparError::option("--shapes", e.to_string()))?;
    }
    Ok(())
}

fn bench_matmul(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    (m, n, k): (usize, usize, usize),
    dtype: DType,
) -> Result<Vec<KernelBenchRow>> {
    let shape = (m, n, k);
    let wt = if dtype == DType::F16 {
        WeightType::F16
    } else {
        WeightType::F32
    };
    let dname = if dtype == DType::F16 { "f16" } else { "f32" };
    let x = gpu.upload_f32("x", &random(m * k, 1))?;
    let w = gpu.upload_weights("w", &random(n * k, 2), dtype)?;
    let operands = Some(tune::MatmulOperands {
        x: x.buffer(),
        w: w.buffer(),
    });
    let effort = Effort::Bench {
        samples: opts.iters,
    };
    let legacy = variants::MATMUL
        .iter()
        .find(|v| v.legacy && v.applies(gpu, shape) && (v.k_multiple_of_4 || k % 4 != 0));
    let mut candidates: Vec<&'static variants::Variant> = variants::MATMUL
        .iter()
        .filter(|v| v.candidate && v.applies(gpu, shape))
        .filter(|v| {
            opts.only.is_empty()
                || opts.only.iter().any(|o| o == v.name)
                || legacy.is_some_and(|l| l.name == v.name)
        })
        .collect();
    if opts.naive {
        candidates.insert(
            0,
            variants::by_name("matmul_naive").ok_or_else(|| WgparError::Shape {
                op: "bench".into(),
                detail: "no naive matmul".into(),
            })?,
        );
    }
    let timings = tune::measure_matmul_variants(gpu, shape, wt, operands, effort, &candidates)?;
    let flops = 2.0 * m as f64 * n as f64 * k as f64;
    let secs_of = |name: &str| {
        timings
            .iter()
            .find(|t| t.variant.name == name)
            .and_then(|t| t.seconds)
    };
    let naive_s = secs_of("matmul_naive");
    let legacy_s = legacy.and_then(|l| secs_of(l.name));
    let winner = tune::fastest(&timings);
    let mut out = Vec::new();
    for t in &timings {
        let Some(s) = t.seconds else { continue };
        let mut r = row(t.variant.name, format!("{m}x{n}x{k}"), dname, s);
        r.gflops = Some(flops / s / 1e9);
        let w_bytes = (n * k * dtype.size()) as u64;
        roofline::fill_weight_bytes(&mut r, w_bytes, (m * k * 4 + m * n * 4) as u64);
        r.weight_buffers = Some(1);
        if t.variant.name != "matmul_naive" {
            r.speedup_vs_naive = naive_s.map(|ns| ns / s);
            r.speedup_vs_legacy = legacy_s.map(|ls| ls / s);
        }
        r.winner = winner.is_some_and(|v| v.name == t.variant.name);
        r.legacy = legacy.is_some_and(|l| l.name == t.variant.name);
        out.push(r);
    }
    if opts.save && opts.only.is_empty() {
        if let Some(v) = winner {
            tune::record_choice(gpu, Class::Matmul(MatmulClass::of(shape, wt)), v, &timings)?;
        }
    }
    Ok(out)
}

/// Causal attention prefill of `tokens` tokens (one sequence, 32 heads of 128), every variant
/// that applies: time and the rate of its 2 x 2 x d multiply-adds per (query, key) pair.
fn bench_attention_prefill(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    tokens: usize,
) -> Result<Vec<KernelBenchRow>> {
    let (heads, dim) = (32usize, 128usize);
    let shape = AttnShape {
        batch: 1,
        seq: tokens,
        slots: 1,
        n_heads: heads,
        n_kv_heads: heads,
        head_dim: dim,
        max_seq: tokens,
        group: 1,
        q_head_offset: 0,
        kv_head_offset: 0,
    };
    let cache_bytes = (shape.cache_len() * 4) as u64;
    if gpu.check_size("bench", cache_bytes).is_err() {
        return Ok(Vec::new());
    }
    let kv = gpu.upload_f32("kc", &random(shape.cache_len(), 7))?;
    let q = gpu.upload_f32("q", &random(tokens * heads * dim, 8))?;
    let o = gpu.empty("o", DType::F32, tokens * heads * dim)?;
    let seqs = gpu.upload_u32("seqs", &[0, 0])?;
    let cache = ops::KvCache {
        k: &kv,
        v: &kv,
        seqs: &seqs,
    };
    let pairs = (tokens * (tokens + 1) / 2) as f64;
    let flops = pairs * heads as f64 * dim as f64 * 4.0;
    // Only the tiled kernel shares key tiles: the others read each key once per query.
    let mut rows = Vec::new();
    for v in variants::ATTENTION
        .iter()
        .filter(|v| variants::attention_applies(v, tokens, dim))
    {
        let s = time(gpu, opts, &|e| {
            ops::attention_with(
                gpu,
                e,
                (&q, cache, &o),
                &shape,
                ops::AttnMask::Causal,
                Some(v.name),
            )
        })?;
        let mut r = row(v.name, format!("s{tokens} h{heads}x{dim}"), "f32", s);
        r.gflops = Some(flops / s / 1e9);
        r.legacy = v.legacy;
        rows.push(r);
    }
    let best = rows
        .iter()
        .map(|r| r.median_ms)
        .fold(f64::INFINITY, f64::min);
    let legacy_ms = rows.iter().find(|r| r.legacy).map(|r| r.median_ms);
    for r in &mut rows {
        r.winner = r.median_ms == best;
        r.speedup_vs_legacy = legacy_ms.map(|l| l / r.median_ms);
    }
    Ok(rows)
}

/// The memory-bound kernels at a transformer-like shape (512 tokens, hidden 1024).
fn bandwidth_kernels(gpu: &Gpu, opts: &KernelBenchOptions) -> Result<Vec<KernelBenchRow>> {
    let io = Streams::upload(gpu, 512, 1024)?;
    let mut out_rows = io.row_kernels(gpu, opts)?;
    out_rows.push(io.embed(gpu, opts)?);
    out_rows.extend(attention_rows(gpu, opts)?);
    Ok(out_rows)
}

/// A row of a bandwidth kernel: `traffic` bytes moved in `s` seconds.
fn bw_row(name: &str, traffic: f64, s: f64, shape: String) -> KernelBenchRow {
    let mut r = row(name, shape, "f32", s);
    r.gbps = Some(traffic / s / 1e9);
    r
}

/// The operands of the row-wise kernels: two `rows x cols` inputs, an output and a norm's
/// scale.
struct Streams {
    rows: usize,
    cols: usize,
    a: Tensor,
    b: Tensor,
    out: Tensor,
    gamma: Tensor,
}

impl Streams {
    fn upload(gpu: &Gpu, rows: usize, cols: usize) -> Result<Self> {
        let len = rows * cols;
        Ok(Self {
            rows,
            cols,
            a: gpu.upload_f32("a", &random(len, 3))?,
            b: gpu.upload_f32("b", &random(len, 4))?,
            out: gpu.empty("out", DType::F32, len)?,
            gamma: gpu.upload_f32("gamma", &random(cols, 5))?,
        })
    }

    /// Bytes of one operand.
    fn bytes(&self) -> f64 {
        (self.rows * self.cols * 4) as f64
    }

    fn shape(&self) -> String {
        format!("{}x{}", self.rows, self.cols)
    }

    /// Norms, softmax and the element-wise ops.
    fn row_kernels(&self, gpu: &Gpu, opts: &KernelBenchOptions) -> Result<Vec<KernelBenchRow>> {
        let (rows, cols, bytes) = (self.rows, self.cols, self.bytes());
        let (a, out, gamma) = (&self.a, &self.out, &self.gamma);
        let mut out_rows = Vec::new();
        let s = time(gpu, opts, &|e| {
            let norm = Norm::Layer { gamma, beta: gamma };
            ops::norm(gpu, e, norm, (a, out), (rows, cols), 1e-5)
        })?;
        out_rows.push(bw_row("layernorm", 2.0 * bytes, s, self.shape()));
        let s = time(gpu, opts, &|e| {
            ops::norm(gpu, e, Norm::Rms { gamma }, (a, out), (rows, cols), 1e-5)
        })?;
        out_rows.push(bw_row("rmsnorm", 2.0 * bytes, s, self.shape()));
        let s = time(gpu, opts, &|e| ops::softmax(gpu, e, out, rows, cols))?;
        out_rows.push(bw_row("softmax", 2.0 * bytes, s, self.shape()));
        for (name, op, traffic) in [
            ("add", Elementwise::Add, 3.0),
            ("gelu", Elementwise::Gelu, 2.0),
            ("swiglu", Elementwise::SwiGlu, 3.0),
        ] {
            let s = time(gpu, opts, &|e| {
                ops::elementwise(gpu, e, op, out, Some(&self.b), (rows, cols))
            })?;
            out_rows.push(bw_row(name, traffic * bytes, s, self.shape()));
        }
        Ok(out_rows)
    }

    /// The embedding lookup of one token per row from an 8192-token table.
    fn embed(&self, gpu: &Gpu, opts: &KernelBenchOptions) -> Result<KernelBenchRow> {
        let (rows, cols) = (self.rows, self.cols);
        let vocab = 8192;
        let wte = gpu.upload_f32("wte", &random(vocab * cols, 6))?;
        let ids: Vec<u32> = (0..rows as u32).map(|i| i * 31 % vocab as u32).collect();
        let ids = gpu.upload_u32("ids", &ids)?;
        let s = time(gpu, opts, &|e| {
            ops::embed(gpu, e, (&ids, &wte, None), &self.out, (1, rows, cols))
        })?;
        Ok(bw_row("embed", 2.0 * self.bytes(), s, self.shape()))
    }
}

/// Attention: decode against a 512-token cache, and a 128-token prefill, 16 heads of 64.
fn attention_rows(gpu: &Gpu, opts: &KernelBenchOptions) -> Result<Vec<KernelBenchRow>> {
    let (heads, dim, max_seq) = (16usize, 64usize, 640usize);
    let mut out_rows = Vec::new();
    for (seq, past) in [(1usize, 511usize), (128, 0)] {
        let shape_a = AttnShape {
            batch: 1,
            seq,
            slots: 1,
            n_heads: heads,
            n_kv_heads: heads,
            head_dim: dim,
            max_seq,
            group: 1,
            q_head_offset: 0,
            kv_head_offset: 0,
        };
        let cache: Tensor = gpu.upload_f32("kc", &random(shape_a.cache_len(), 7))?;
        let q = gpu.upload_f32("q", &random(seq * heads * dim, 8))?;
        let o = gpu.empty("o", DType::F32, seq * heads * dim)?;
        let seqs = gpu.upload_u32("seqs", &[0, past as u32])?;
        let cache = ops::KvCache {
            k: &cache,
            v: &cache,
            seqs: &seqs,
        };
        let s = time(gpu, opts, &|e| {
            ops::attention(gpu, e, &q, cache, &o, &shape_a)
        })?;
        // Keys and values read once per query head and token: the traffic the kernel issues.
        let traffic: f64 = (0..seq).map(|i| (past + i + 1) as f64).sum::<f64>()
            * heads as f64
            * dim as f64
            * 2.0
            * 4.0;
        let name = if seq == 1 {
            "attention_decode"
        } else {
            "attention_prefill"
        };
        let shape = format!("s{seq} ctx{} h{heads}x{dim}", past + seq);
        out_rows.push(bw_row(name, traffic, s, shape));
    }
    Ok(out_rows)
}
