//! Kernel benchmark: matmul GFLOP/s against the naive baseline, and the other kernels' GB/s,
//! on one device. Warm-up first, then the median of timed repetitions.

use std::time::Instant;

use serde::Serialize;

use super::ops::{self, AttnShape, Elementwise, MatmulIo, MatmulKernel, Norm};
use crate::device::{DType, Gpu, Tensor};
use crate::error::Result;

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct KernelBenchOptions {
    /// Square matmul sizes (M = N = K).
    pub sizes: Vec<usize>,
    /// Timed samples per kernel (the median is reported).
    pub iters: usize,
    /// Untimed samples first.
    pub warmup: usize,
    /// Dispatches recorded per timed submit, so submit latency is amortised.
    pub reps: usize,
    /// Also measure matmul with f16 weights (when the adapter allows).
    pub f16: bool,
}

impl Default for KernelBenchOptions {
    fn default() -> Self {
        Self {
            sizes: vec![256, 512, 1024, 2048],
            iters: 5,
            warmup: 1,
            reps: 4,
            f16: true,
        }
    }
}

/// One measured kernel.
#[derive(Debug, Clone, Serialize)]
pub struct KernelBenchRow {
    /// Kernel name.
    pub kernel: String,
    /// Shape, e.g. `512x512x512`.
    pub shape: String,
    /// Weight storage type.
    pub dtype: String,
    /// Median time per dispatch, milliseconds.
    pub median_ms: f64,
    /// Arithmetic rate (matmul).
    pub gflops: Option<f64>,
    /// Memory traffic rate (bytes read + written / time).
    pub gbps: Option<f64>,
    /// For the production matmul: speed-up over the naive kernel at the same shape.
    pub speedup_vs_naive: Option<f64>,
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
    crate::stats::median(samples).ok_or_else(|| {
        crate::error::WgparError::Measurement("kernel benchmark needs at least one sample".into())
    })
}

fn random(len: usize, seed: u32) -> Vec<f32> {
    // A cheap deterministic hash: benchmark inputs only need to be non-trivial.
    (0..len as u32)
        .map(|i| {
            let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 9;
            (h % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn row(kernel: &str, shape: String, dtype: &str, secs: f64) -> KernelBenchRow {
    KernelBenchRow {
        kernel: kernel.into(),
        shape,
        dtype: dtype.into(),
        median_ms: secs * 1e3,
        gflops: None,
        gbps: None,
        speedup_vs_naive: None,
    }
}

/// Runs the benchmark on `gpu`. Matmul sizes the adapter cannot hold are skipped.
pub fn bench_kernels(gpu: &Gpu, opts: &KernelBenchOptions) -> Result<Vec<KernelBenchRow>> {
    let mut rows = Vec::new();
    for &n in &opts.sizes {
        if gpu.check_size("bench", (n * n * 4) as u64).is_err() {
            continue;
        }
        let x = gpu.upload_f32("x", &random(n * n, 1))?;
        let y = gpu.empty("y", DType::F32, n * n)?;
        let flops = 2.0 * (n as f64).powi(3);
        let shape = format!("{n}x{n}x{n}");
        let mut dtypes = vec![DType::F32];
        if opts.f16 && gpu.supports_f16_weights() {
            dtypes.push(DType::F16);
        }
        for dtype in dtypes {
            let w = gpu.upload_weights("w", &random(n * n, 2), dtype)?;
            let dname = if dtype == DType::F16 { "f16" } else { "f32" };
            let mut naive_s = None;
            for kernel in [MatmulKernel::Naive, MatmulKernel::Tiled] {
                // The naive kernel at 2048 takes seconds per call on a CPU driver; one sample
                // is enough there.
                let s = time(gpu, opts, &|e| {
                    let io = MatmulIo {
                        x: &x,
                        w: &w,
                        bias: None,
                        y: &y,
                    };
                    ops::matmul(gpu, e, io, (n, n, n), kernel)
                })?;
                let name = match kernel {
                    MatmulKernel::Naive => "matmul_naive",
                    MatmulKernel::Tiled => "matmul",
                };
                let mut r = row(name, shape.clone(), dname, s);
                r.gflops = Some(flops / s / 1e9);
                match kernel {
                    MatmulKernel::Naive => naive_s = Some(s),
                    MatmulKernel::Tiled => r.speedup_vs_naive = naive_s.map(|ns| ns / s),
                }
                rows.push(r);
            }
        }
    }
    rows.extend(bandwidth_kernels(gpu, opts)?);
    Ok(rows)
}

/// The memory-bound kernels at a transformer-like shape (512 tokens, hidden 1024).
fn bandwidth_kernels(gpu: &Gpu, opts: &KernelBenchOptions) -> Result<Vec<KernelBenchRow>> {
    let (rows, cols) = (512usize, 1024usize);
    let len = rows * cols;
    let bytes = (len * 4) as f64;
    let a = gpu.upload_f32("a", &random(len, 3))?;
    let b = gpu.upload_f32("b", &random(len, 4))?;
    let out = gpu.empty("out", DType::F32, len)?;
    let gamma = gpu.upload_f32("gamma", &random(cols, 5))?;
    let shape = format!("{rows}x{cols}");
    let mut out_rows = Vec::new();
    let mut push = |name: &str, traffic: f64, s: f64, shape: String| {
        let mut r = row(name, shape, "f32", s);
        r.gbps = Some(traffic / s / 1e9);
        out_rows.push(r);
    };
    let s = time(gpu, opts, &|e| {
        ops::norm(
            gpu,
            e,
            Norm::Layer {
                gamma: &gamma,
                beta: &gamma,
            },
            (&a, &out),
            (rows, cols),
            1e-5,
        )
    })?;
    push("layernorm", 2.0 * bytes, s, shape.clone());
    let s = time(gpu, opts, &|e| {
        ops::norm(
            gpu,
            e,
            Norm::Rms { gamma: &gamma },
            (&a, &out),
            (rows, cols),
            1e-5,
        )
    })?;
    push("rmsnorm", 2.0 * bytes, s, shape.clone());
    let s = time(gpu, opts, &|e| ops::softmax(gpu, e, &out, rows, cols))?;
    push("softmax", 2.0 * bytes, s, shape.clone());
    for (name, op, traffic) in [
        ("add", Elementwise::Add, 3.0),
        ("gelu", Elementwise::Gelu, 2.0),
        ("swiglu", Elementwise::SwiGlu, 3.0),
    ] {
        let s = time(gpu, opts, &|e| {
            ops::elementwise(gpu, e, op, &out, Some(&b), (rows, cols))
        })?;
        push(name, traffic * bytes, s, shape.clone());
    }
    let vocab = 8192;
    let wte = gpu.upload_f32("wte", &random(vocab * cols, 6))?;
    let ids: Vec<u32> = (0..rows as u32).map(|i| i * 31 % vocab as u32).collect();
    let ids = gpu.upload_u32("ids", &ids)?;
    let s = time(gpu, opts, &|e| {
        ops::embed(gpu, e, (&ids, &wte, None), &out, (1, rows, cols))
    })?;
    push("embed", 2.0 * bytes, s, shape.clone());
    // Attention: decode against a 512-token cache, and a 128-token prefill, 16 heads of 64.
    let (heads, dim, max_seq) = (16usize, 64usize, 640usize);
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
        push(
            name,
            traffic,
            s,
            format!("s{seq} ctx{} h{heads}x{dim}", past + seq),
        );
    }
    Ok(out_rows)
}
