//! Bare kernels at the model's shapes: matmul, attention and element-wise rates.

use std::io::Write;

use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{self, AttnShape, Elementwise, MatmulIo, MatmulKernel, Norm};
use crate::model::ModelConfig;
use crate::parallel::cost;

use super::{median_time, random};
use crate::stats::median;

/// Times `record` (one dispatch) `reps` times per submit; seconds per dispatch.
pub(super) fn per_dispatch(
    gpu: &Gpu,
    iters: usize,
    reps: usize,
    record: impl Fn(&mut wgpu::CommandEncoder) -> Result<()>,
) -> Result<f64> {
    let t = median_time(iters, || {
        let mut e = gpu.encoder();
        for _ in 0..reps {
            record(&mut e)?;
        }
        gpu.submit(e);
        gpu.wait()
    })?;
    Ok(t / reps as f64)
}

/// Bare kernels at the model's shapes for `tokens` rows: prints matmul GFLOP/s and attention
/// and element-wise GB/s; returns the element-wise rate (median of the streaming kernels).
pub(super) fn kernel_rates(
    gpu: &Gpu,
    c: &ModelConfig,
    tokens: &[usize],
    context: usize,
    iters: usize,
    log: &mut dyn Write,
) -> Result<f64> {
    let t_max = tokens.iter().copied().max().unwrap_or(1);
    matmul_rates(gpu, c, tokens, iters, log)?;
    let gbps = elementwise_rates(gpu, c, iters, log)?;
    attention_rates(gpu, c, (context, t_max), iters, log)?;
    median(gbps.iter().map(|g| g.1).collect())
        .ok_or_else(|| WgparError::Measurement("no element-wise kernel was timed".into()))
}

/// Prints the tiled matmul's GFLOP/s at the model's projection shapes, one row per token count.
fn matmul_rates(
    gpu: &Gpu,
    c: &ModelConfig,
    tokens: &[usize],
    iters: usize,
    log: &mut dyn Write,
) -> Result<()> {
    let (h, f, d) = (c.hidden, c.ffn, c.head_dim);
    let qkv = (c.heads + 2 * c.kv_heads) * d;
    say!(
        log,
        "  matmul (tiled) at the model's projection shapes, GFLOP/s:"
    );
    let shapes = [(qkv, h), (h, c.heads * d), (f, h), (h, f), (c.vocab, h)];
    let maxk = shapes.iter().map(|s| s.0.max(s.1)).max().unwrap_or(h);
    let t_max = tokens.iter().copied().max().unwrap_or(1);
    let x = gpu.upload_f32("calibrate.x", &random(t_max * maxk, 3))?;
    let y = gpu.empty("calibrate.y", DType::F32, t_max * c.vocab.max(maxk))?;
    say_part!(log, "    {:>8}", "tokens");
    for (n, k) in shapes {
        say_part!(log, " {:>12}", format!("{n}x{k}"));
    }
    say!(log);
    let weights: Vec<Tensor> = shapes
        .iter()
        .map(|&(n, k)| gpu.upload_weights("calibrate.w", &random(n * k, 4), DType::F32))
        .collect::<Result<_>>()?;
    for &t in tokens {
        say_part!(log, "    {t:>8}");
        for (&(n, k), w) in shapes.iter().zip(&weights) {
            let s = per_dispatch(gpu, iters, 2, |e| {
                let io = MatmulIo {
                    x: &x,
                    w,
                    bias: None,
                    y: &y,
                };
                ops::matmul(gpu, e, io, (t, n, k), MatmulKernel::Tiled)
            })?;
            say_part!(log, " {:>12.2}", 2.0 * (t * n * k) as f64 / s / 1e9);
        }
        say!(log);
    }
    Ok(())
}

/// Element-wise streaming rate: norm, residual add and SwiGLU rows of the model's widths over
/// 16 MiB per operand, so that the dispatch cost (measured apart) does not count. Prints and
/// returns GB/s per kernel.
fn elementwise_rates(
    gpu: &Gpu,
    c: &ModelConfig,
    iters: usize,
    log: &mut dyn Write,
) -> Result<Vec<(&'static str, f64)>> {
    let (h, f) = (c.hidden, c.ffn);
    let len = 4usize << 20;
    let a = gpu.upload_f32("calibrate.ea", &random(len, 5))?;
    let b = gpu.upload_f32("calibrate.eb", &random(len, 6))?;
    let gamma = gpu.upload_f32("calibrate.gamma", &random(h, 7))?;
    let out = gpu.empty("calibrate.eo", DType::F32, len)?;
    let (hr, fr) = (len / h, len / f);
    let mut gbps = Vec::new();
    let s = per_dispatch(gpu, iters, 2, |e| {
        ops::norm(
            gpu,
            e,
            Norm::Rms { gamma: &gamma },
            (&a, &out),
            (hr, h),
            1e-5,
        )
    })?;
    gbps.push(("rmsnorm", 2.0 * (hr * h * 4) as f64 / s / 1e9));
    let s = per_dispatch(gpu, iters, 2, |e| {
        ops::elementwise(gpu, e, Elementwise::Add, &a, Some(&b), (hr, h))
    })?;
    gbps.push(("add", 3.0 * (hr * h * 4) as f64 / s / 1e9));
    let s = per_dispatch(gpu, iters, 2, |e| {
        ops::elementwise(gpu, e, Elementwise::SwiGlu, &a, Some(&b), (fr, f))
    })?;
    gbps.push(("swiglu", 3.0 * (fr * f * 4) as f64 / s / 1e9));
    say_part!(
        log,
        "  element-wise over 16 MiB operands, GB/s (bytes read plus written):"
    );
    for (name, v) in &gbps {
        say_part!(log, " {name} {v:.2}");
    }
    say!(log);
    Ok(gbps)
}

/// Attention over the model's heads: a decode step against the prompt, and the prefill
/// (`context` positions, `t_max` tokens in all), over the whole context and, for a model with
/// sliding-window layers whose window is shorter than the context, over that window (the
/// kernel skips the keys before it). Prints time and GB/s of each.
fn attention_rates(
    gpu: &Gpu,
    c: &ModelConfig,
    (context, t_max): (usize, usize),
    iters: usize,
    log: &mut dyn Write,
) -> Result<()> {
    let slides = (c.sliding.as_ref().map(|s| s.window)).filter(|&w| w < context);
    let windows = std::iter::once(None).chain(slides.map(Some));
    for window in windows {
        for (seq, past, batch) in [
            (1usize, context, t_max),
            (context, 0, (t_max / context).max(1)),
        ] {
            if past + seq > c.max_seq {
                continue;
            }
            let s = time_attention(gpu, c, (batch, seq, past), window, iters)?;
            // Keys and values read once per query head and key attended: the traffic it issues.
            let ctx = cost::keys_attended(past, seq, window) as f64 * batch as f64;
            let traffic = ctx * c.heads as f64 * c.head_dim as f64 * 2.0 * 4.0;
            let over = window.map_or(String::new(), |w| format!(", sliding window {w}"));
            say!(
                log,
                "  attention {batch}x{seq} tokens over {} positions{over}: {:.3} ms, {:.2} GB/s",
                past + seq,
                s * 1e3,
                traffic / s / 1e9
            );
        }
    }
    Ok(())
}

/// Seconds per attention dispatch for `batch` sequences of `seq` new tokens after `past`,
/// each query seeing at most `window` keys where one is given.
fn time_attention(
    gpu: &Gpu,
    c: &ModelConfig,
    (batch, seq, past): (usize, usize, usize),
    window: Option<usize>,
    iters: usize,
) -> Result<f64> {
    let d = c.head_dim;
    let shape = AttnShape {
        batch,
        seq,
        slots: batch,
        n_heads: c.heads,
        n_kv_heads: c.kv_heads,
        head_dim: d,
        max_seq: c.max_seq,
        group: c.heads / c.kv_heads.max(1),
        q_head_offset: 0,
        kv_head_offset: 0,
    };
    let cache = gpu.upload_f32("calibrate.kv", &random(shape.cache_len(), 8))?;
    let q = gpu.upload_f32("calibrate.q", &random(batch * seq * c.heads * d, 9))?;
    let o = gpu.empty("calibrate.o", DType::F32, batch * seq * c.heads * d)?;
    let table: Vec<u32> = (0..batch as u32).flat_map(|b| [b, past as u32]).collect();
    let seqs = gpu.upload_u32("calibrate.seqs", &table)?;
    let cache = ops::KvCache {
        k: &cache,
        v: &cache,
        seqs: &seqs,
    };
    per_dispatch(gpu, iters, 4, |e| match window {
        None => ops::attention(gpu, e, &q, cache, &o, &shape),
        Some(w) => ops::attention_window(gpu, e, (&q, cache, &o), &shape, (None, w), None),
    })
}
