//! The model's blocks (attention halves, whole layers) at the run's decode and prefill steps:
//! achieved rate against arithmetic intensity.

use std::io::Write;

use crate::device::DType;
use crate::error::Result;
use crate::model::{Activations, GpuModel, KvCache, ModelConfig, ShardSpec, Step};
use crate::parallel::cost;

use super::kernels::DispatchCosts;
use super::median_time;

/// Dispatches the model's blocks encode per layer: (attention half with its residual, whole
/// layer). Mirrors `model::gpu`: norm, Q/K/V, RoPE (Llama), cache append, attention, output
/// projection, bias (GPT-2) and residual add; then norm, up, gate and SwiGLU (Llama) or GELU,
/// down, bias (GPT-2) and residual add.
pub(super) fn dispatches_per_layer(c: &ModelConfig) -> (usize, usize) {
    // The engines' own counts (`parallel::cost`), so calibration and spans agree.
    let shard = ShardSpec::full(c);
    let step = Step {
        batch: 1,
        seq: 1,
        past: 0,
    };
    let attention = crate::parallel::cost::attention(c, &shard, &step, crate::device::DType::F32)
        .kernels as usize;
    let mlp =
        crate::parallel::cost::mlp(c, &shard, &step, crate::device::DType::F32).kernels as usize;
    (attention, attention + mlp)
}

/// The steps the curves are measured at: decode and prefill with 1, 2, 4, ... sequences.
pub(super) fn block_steps(batch: usize, prompt: usize, quick: bool) -> Vec<Step> {
    let mut batches: Vec<usize> = std::iter::successors(Some(1usize), |b| Some(b * 2))
        .take_while(|&b| b <= batch)
        .collect();
    if batches.last() != Some(&batch) {
        batches.push(batch);
    }
    if quick {
        batches = vec![1, batch];
        batches.dedup();
    }
    let mut steps = Vec::new();
    for &b in &batches {
        steps.push(Step {
            batch: b,
            seq: 1,
            past: prompt,
        });
        steps.push(Step {
            batch: b,
            seq: prompt,
            past: 0,
        });
    }
    steps
}

/// One measured block: intensity (flops per byte), achieved GFLOP/s net of dispatch cost.
#[derive(Debug, Clone, Copy)]
pub(super) struct Point {
    intensity: f64,
    gflops: f64,
}

/// Buffers for running `step` on a model: activations, a KV cache and token ids written.
pub(crate) fn step_buffers(m: &GpuModel, step: &Step) -> Result<(Activations, KvCache)> {
    let mut act = m.activations(step.tokens(), step.batch)?;
    let mut kv = m.kv_cache(step.batch)?;
    let vocab = m.config().vocab as u32;
    let ids: Vec<u32> = (0..step.tokens() as u32)
        .map(|i| i * 7919 % vocab)
        .collect();
    m.write_ids(&act, &ids)?;
    m.begin_step(&mut act, &mut kv, step, &step.rows())?;
    Ok((act, kv))
}

/// Every layer's blocks of the step `act` is set up for ([`step_buffers`]) in one submit,
/// like the single and pipeline engines, and a wait; `whole` = attention and MLP halves, else
/// attention halves only.
pub(crate) fn run_blocks(m: &GpuModel, act: &Activations, kv: &KvCache, whole: bool) -> Result<()> {
    let gpu = m.gpu();
    let mut e = gpu.encoder();
    if whole {
        m.layers(&mut e, act, kv)?;
    } else {
        for i in 0..m.num_layers() {
            m.attention(&mut e, i, act, kv)?;
            m.attention_residual(&mut e, i, act)?;
        }
    }
    gpu.submit(e);
    gpu.wait()
}

/// Median time of [`run_blocks`], seconds.
pub(crate) fn time_blocks(m: &GpuModel, step: &Step, whole: bool, iters: usize) -> Result<f64> {
    let (act, kv) = step_buffers(m, step)?;
    median_time(iters, || run_blocks(m, &act, &kv, whole))
}

/// The blocks measured at each step: achieved rates of the attention halves and of whole
/// layers, and the time of the whole layers alone (seconds), which the sharing measurement
/// compares against.
pub(super) struct BlockCurves {
    pub(super) attention: Vec<Point>,
    pub(super) layers: Vec<Point>,
    pub(super) alone_s: Vec<(Step, f64)>,
}

/// Achieved rate of the model's blocks at each step.
pub(super) fn block_curves(
    m: &GpuModel,
    steps: &[Step],
    dispatch: DispatchCosts,
    iters: usize,
    log: &mut dyn Write,
) -> Result<BlockCurves> {
    let c = m.config().clone();
    let shard = ShardSpec::full(&c);
    let layers = m.num_layers() as f64;
    let (attn_k, layer_k) = dispatches_per_layer(&c);
    let (mut attn, mut whole, mut alone_s) = (Vec::new(), Vec::new(), Vec::new());
    say!(
        log,
        "  model blocks ({} layers, one submit), net of {:.1} us per dispatch and {:.1} us per submit:",
        m.num_layers(),
        dispatch.launch_us,
        dispatch.submit_us
    );
    say!(
        log,
        "    {:<22} {:>10} {:>10} {:>9} {:>10} {:>10} {:>9}",
        "step",
        "attn ms",
        "flop/B",
        "GFLOP/s",
        "layer ms",
        "flop/B",
        "GFLOP/s"
    );
    for step in steps {
        let a = cost::attention(&c, &shard, step, DType::F32);
        let mc = cost::mlp(&c, &shard, step, DType::F32);
        let mut row = Vec::new();
        for (whole_layer, flops, bytes, k) in [
            (false, a.flops, a.bytes, attn_k),
            (true, a.flops + mc.flops, a.bytes + mc.bytes, layer_k),
        ] {
            let t = time_blocks(m, step, whole_layer, iters)?;
            // Dispatch costs are added back per recorded kernel, the submission's per
            // compute span, by the projection; a noisy estimate must not leave less than a
            // tenth of the measured time.
            let fixed_us = layers * k as f64 * dispatch.launch_us + dispatch.submit_us;
            let net = (t - fixed_us / 1e6).max(t / 10.0);
            let p = Point {
                intensity: flops as f64 / bytes as f64,
                gflops: flops as f64 * layers / net / 1e9,
            };
            row.push((t, p));
            if whole_layer {
                whole.push(p);
                alone_s.push((*step, t));
            } else {
                attn.push(p)
            }
        }
        let kind = if step.seq == 1 { "decode" } else { "prefill" };
        say!(
            log,
            "    {:<22} {:>10.3} {:>10.2} {:>9.2} {:>10.3} {:>10.2} {:>9.2}",
            format!("{kind} {}x{} (+{})", step.batch, step.seq, step.past),
            row[0].0 * 1e3,
            row[0].1.intensity,
            row[0].1.gflops,
            row[1].0 * 1e3,
            row[1].1.intensity,
            row[1].1.gflops
        );
    }
    Ok(BlockCurves {
        attention: attn,
        layers: whole,
        alone_s,
    })
}

/// Curve points sorted by intensity; points closer than 2 % in intensity are averaged so the
/// intensities strictly increase.
pub(super) fn curve(mut points: Vec<Point>) -> Vec<[f64; 2]> {
    points.sort_by(|a, b| a.intensity.total_cmp(&b.intensity));
    let mut out: Vec<(f64, f64, f64)> = Vec::new();
    for p in points {
        match out.last_mut() {
            Some(last) if p.intensity <= last.0 / last.2 * 1.02 => {
                last.0 += p.intensity;
                last.1 += p.gflops;
                last.2 += 1.0;
            }
            _ => out.push((p.intensity, p.gflops, 1.0)),
        }
    }
    out.into_iter().map(|(i, g, n)| [i / n, g / n]).collect()
}
