//! `wgpar calibrate`: measure this machine and write a host profile of it.
//!
//! What is measured, and why this way:
//! - host links: device->host, host->device and device->host->device copies through the comm
//!   layer's staging path (what the engines use), over a size sweep, fitted to
//!   `t = alpha + bytes / beta` by `sim::fit_alpha_beta`;
//! - host reduction: the reduce phase of real host-staged all-reduces (with two or more
//!   devices), as bytes read plus written per second;
//! - kernels at the model's own shapes: matmul GFLOP/s, attention and element-wise GB/s and the
//!   cost of one dispatch (printed; the element-wise rate and the dispatch cost go into the
//!   profile);
//! - the model's blocks (attention half, whole decoder layer) at decode and prefill steps of the
//!   run's shapes, net of dispatch costs: the achieved rate as a function of arithmetic
//!   intensity (`attention_curve`, `matmul_curve`). Engines record a whole forward pass or
//!   layer half as one span, so the rate that predicts such a span is the rate of that block,
//!   not of a bare matmul;
//! - devices on one adapter (`--virtual N`) share its processor: the slowdown of k = 2..N of
//!   them computing at once is measured and written as `compute_sharing`.

use std::sync::{Arc, Barrier};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use wgpar::comm::{
    units::parse_size, CollectiveOp as CommOp, Collectives, CommConfig, Communicator,
};
use wgpar::device::{DType, Gpu, Tensor};
use wgpar::kernels::ops::{self, AttnShape, Elementwise, MatmulKernel, Norm};
use wgpar::model::{
    Activations, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, ShardSpec, Step,
};
use wgpar::parallel::cost;
use wgpar::sim::{
    calibrated_profile, fit_alpha_beta, write_calibrated_profile, Algorithm, AlphaBetaFit,
    ComputeSharing, CostModel, HostProfile, MachineMeasurement, MeasuredDevice,
};
use wgpar::trace::CollectiveOp as TraceOp;
use wgpar::{Result, WgparError};

use super::{DeviceArgs, ModelArgs};

/// Options of `wgpar calibrate`.
#[derive(Args, Clone, Debug)]
pub struct CalibrateArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Model whose block shapes the kernel rates are measured at.
    #[command(flatten)]
    model: ModelArgs,
    /// Largest batch of the runs to project (steps of 1, 2, 4, ... sequences are measured).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Prompt length of the runs to project (prefill steps; decode steps attend to it).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Profile file to write.
    #[arg(long, default_value = "hosts/this-machine.toml")]
    out: String,
    /// Profile name.
    #[arg(long, default_value = "this-machine")]
    name: String,
    /// Largest copy in the link sweep (sizes grow by 4 from 256 bytes).
    #[arg(long, default_value = "16M")]
    max_bytes: String,
    /// Timed repetitions per point (the median is used).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// A fast, rough calibration: copies up to 256K, 3 repetitions, two batch sizes.
    #[arg(long)]
    quick: bool,
}

/// Median of timed repetitions after one untimed warm-up, seconds.
fn median_time(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64());
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

fn random(len: usize, seed: u32) -> Vec<f32> {
    // Deterministic, non-trivial values (timing must not see zeros).
    (0..len as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 9) % 2000)
        .map(|h| h as f32 / 1000.0 - 1.0)
        .collect()
}

fn fit_error(what: &str, e: impl std::fmt::Display) -> WgparError {
    WgparError::Config(format!("cannot fit the {what} sweep: {e}"))
}

/// Fits a link sweep; when noise hides the bandwidth term entirely (times do not grow with
/// size, as happens on a loaded machine over a short sweep), keeps the link latency-bound:
/// alpha is the median time and beta the lower bound the largest size shows, with a warning,
/// instead of failing the whole calibration.
fn fit_link(what: &str, points: &[(u64, f64)]) -> Result<AlphaBetaFit> {
    match fit_alpha_beta(points) {
        Err(wgpar::sim::FitError::NoBandwidth { us_per_mb }) => {
            let mut times: Vec<f64> = points.iter().map(|p| p.1).collect();
            times.sort_by(|a, b| a.total_cmp(b));
            let median = times[times.len() / 2];
            let (bytes, secs) = points
                .iter()
                .copied()
                .max_by_key(|p| p.0)
                .unwrap_or((1, median));
            eprintln!(
                "warning: {what}: times do not grow with size ({us_per_mb:.1} us/MB fitted); \
                 latency-bound over this sweep: alpha = median time, beta = its lower bound \
                 (use a longer --max-bytes sweep on a quieter machine)"
            );
            Ok(AlphaBetaFit {
                alpha_us: median * 1e6,
                beta_gbps: bytes as f64 / secs / 1e9,
                r_squared: 0.0,
                rms_relative_residual: 0.0,
                points: points.len(),
            })
        }
        other => other.map_err(|e| fit_error(what, e)),
    }
}

fn print_fit(what: &str, fit: &AlphaBetaFit) {
    println!(
        "  {what:<14} alpha {:>8.1} us   beta {:>7.3} GB/s   R^2 {:.4}   rms rel. residual {:.1} % ({} points)",
        fit.alpha_us,
        fit.beta_gbps,
        fit.r_squared,
        fit.rms_relative_residual * 100.0,
        fit.points
    );
}

/// Copy sweeps of one device: (device->host, host->device) points as (bytes, seconds).
type Sweep = Vec<(u64, f64)>;

fn link_sweeps(
    coll: &Collectives,
    gpu: &Gpu,
    sizes: &[u64],
    iters: usize,
) -> Result<(Sweep, Sweep)> {
    let (mut d2h, mut h2d) = (Vec::new(), Vec::new());
    for &bytes in sizes {
        let len = (bytes / 4) as usize;
        let t = gpu.upload_f32("calibrate.link", &random(len, 11))?;
        let host: Vec<u8> = bytemuck::cast_slice(&random(len, 12)).to_vec();
        d2h.push((
            bytes,
            median_time(iters, || coll.begin_download(gpu, &t)?.finish().map(|_| ()))?,
        ));
        h2d.push((
            bytes,
            median_time(iters, || {
                coll.upload(gpu, &t, 0, &host)?;
                gpu.wait()
            })?,
        ));
    }
    Ok((d2h, h2d))
}

/// Device `a` -> host -> device `b`, the path of a pipeline hand-off.
fn bounce_sweep(
    coll: &Collectives,
    a: &Gpu,
    b: &Gpu,
    sizes: &[u64],
    iters: usize,
) -> Result<Sweep> {
    let mut out = Vec::new();
    for &bytes in sizes {
        let len = (bytes / 4) as usize;
        let src = a.upload_f32("calibrate.src", &random(len, 13))?;
        let dst = b.empty("calibrate.dst", DType::F32, len)?;
        out.push((
            bytes,
            median_time(iters, || {
                let host = coll.begin_download(a, &src)?.finish()?;
                coll.upload(b, &dst, 0, &host)?;
                b.wait()
            })?,
        ));
    }
    Ok(out)
}

/// Host reduce rate (bytes read plus written per second, GB/s) from the reduce phase of real
/// all-reduces over `gpus`, at the larger sizes of the sweep; also prints each size's total.
fn host_reduce_gbps(gpus: &[Arc<Gpu>], sizes: &[u64], iters: usize) -> Result<f64> {
    let coll = Collectives::new(CommConfig::default())?;
    let n = gpus.len() as f64;
    let mut rates = Vec::new();
    println!("  all-reduce over {} devices (host-staged):", gpus.len());
    for &bytes in sizes.iter().filter(|&&b| b >= 64 << 10) {
        let len = (bytes / 4) as usize;
        let tensors: Vec<Tensor> = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| g.upload_f32("calibrate.ar", &random(len, 20 + i as u32)))
            .collect::<Result<_>>()?;
        let parts: Vec<(&Gpu, &Tensor)> = gpus.iter().map(|g| &**g).zip(&tensors).collect();
        let total = median_time(iters, || coll.all_reduce(&parts))?;
        let mut reduce: Vec<f64> = coll
            .stats()
            .drain()
            .iter()
            .filter(|r| r.op == CommOp::AllReduce && r.error.is_none())
            .map(|r| r.reduce.as_secs_f64())
            .filter(|&s| s > 0.0)
            .collect();
        reduce.sort_by(|a, b| a.total_cmp(b));
        if let Some(&r) = reduce.get(reduce.len() / 2) {
            // Each chunk reads n partials and writes one sum: (n + 1) S bytes in all.
            let gbps = (n + 1.0) * bytes as f64 / r / 1e9;
            println!(
                "    {:>10} B: {:>9.1} us, reduce phase {:>9.1} us = {:.2} GB/s",
                bytes,
                total * 1e6,
                r * 1e6,
                gbps
            );
            rates.push(gbps);
        }
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    // The larger half of the sizes: small reductions are all fixed cost.
    let big = &rates[rates.len() / 2..];
    big.get(big.len() / 2)
        .copied()
        .ok_or_else(|| WgparError::Config("no all-reduce reported a reduce phase".into()))
}

/// Joins calibration threads in order; a thread that panicked becomes an error.
fn join_all<T>(handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T>>>) -> Vec<Result<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(WgparError::Config("calibration thread panicked".into())))
        })
        .collect()
}

/// Time of one all-reduce of `bytes` through a [`Communicator`] over `gpus`, as the
/// tensor-parallel engine meets it: one thread per rank, each computes (a decode-sized matmul,
/// submitted and waited for) and then joins the collective, which is the rendezvous. Counted
/// from the moment the last rank arrived to each rank's return, averaged over the ranks (what
/// the engine records as the collective span); median over `iters` calls, microseconds.
///
/// The compute before each call matters on a CPU driver: back to back, with the driver's
/// threads still awake, the same all-reduce measured 2-3 times faster than in a run.
fn communicator_all_reduce_us(gpus: &[Arc<Gpu>], bytes: usize, iters: usize) -> Result<f64> {
    let comm = Communicator::new(gpus.to_vec(), CommConfig::default())?;
    let n = gpus.len();
    let barrier = Arc::new(Barrier::new(n));
    // A decode step's matmul of a small model: 8 rows through a 384 x 1024 projection.
    let (rows, out, inner) = (8usize, 1024usize, 384usize);
    let per_rank: Vec<Result<Vec<f64>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (comm, barrier, gpu) = (comm.clone(), barrier.clone(), gpus[rank].clone());
                scope.spawn(move || -> Result<Vec<f64>> {
                    let handle = comm.join(rank)?;
                    let seed = 40 + rank as u32;
                    let t = gpu.upload_f32("calibrate.ar", &random(bytes / 4, seed))?;
                    let x = gpu.upload_f32("calibrate.x", &random(rows * inner, seed + 8))?;
                    let w = gpu.upload_f32("calibrate.w", &random(out * inner, seed + 16))?;
                    let y = gpu.empty("calibrate.y", DType::F32, rows * out)?;
                    let mut times = Vec::with_capacity(iters + 1);
                    for _ in 0..=iters {
                        barrier.wait();
                        let mut enc = gpu.encoder();
                        ops::matmul(
                            &gpu,
                            &mut enc,
                            &x,
                            &w,
                            None,
                            &y,
                            (rows, out, inner),
                            MatmulKernel::Tiled,
                        )?;
                        gpu.submit(enc);
                        gpu.wait()?;
                        let all_arrived = handle.all_reduce_timed(&t)?;
                        times.push(all_arrived.elapsed().as_secs_f64() * 1e6);
                    }
                    // The first call warms the staging buffers up.
                    times.remove(0);
                    Ok(times)
                })
            })
            .collect();
        join_all(handles)
    });
    let per_rank = per_rank.into_iter().collect::<Result<Vec<Vec<f64>>>>()?;
    let mut calls: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|r| r[i]).sum::<f64>() / n as f64)
        .collect();
    calls.sort_by(|a, b| a.total_cmp(b));
    Ok(calls[calls.len() / 2])
}

/// Fixed host cost of a host-staged all-reduce over the first 2, 3, ... devices: the measured
/// time of small (single-chunk) all-reduces minus what `base` models for their copies and
/// reduction, median over sizes, microseconds.
fn collective_overheads(gpus: &[Arc<Gpu>], base: &HostProfile, iters: usize) -> Result<Vec<f64>> {
    let model = CostModel::new(base);
    let mut out = Vec::new();
    println!("  all-reduce through the rank-per-thread communicator after each rank's compute, measured vs modelled copies + reduction:");
    for n in 2..=gpus.len() {
        let mut extra = Vec::new();
        for bytes in [4usize << 10, 16 << 10, 64 << 10, 192 << 10] {
            let measured = communicator_all_reduce_us(&gpus[..n], bytes, iters)?;
            let devices: Vec<usize> = (0..n).collect();
            let modelled = model
                .collective_us(
                    TraceOp::AllReduce,
                    Algorithm::HostStaged,
                    &devices,
                    bytes as u64,
                    1,
                )
                .map_err(|e| WgparError::Config(e.to_string()))?;
            println!(
                "    {n} devices, {:>7} B: {measured:>8.1} us measured, {modelled:>8.1} us modelled",
                bytes
            );
            extra.push(measured - modelled);
        }
        extra.sort_by(|a, b| a.total_cmp(b));
        out.push(extra[extra.len() / 2].max(0.0));
    }
    Ok(out)
}

/// Host reduce rate without a second device: the host summing two buffers into a third.
fn host_sum_gbps(iters: usize) -> Result<f64> {
    let len = 4 << 20;
    let (a, b) = (random(len, 30), random(len, 31));
    let mut out = vec![0f32; len];
    let t = median_time(iters, || {
        for ((o, x), y) in out.iter_mut().zip(&a).zip(&b) {
            *o = x + y;
        }
        Ok(())
    })?;
    std::hint::black_box(&out);
    Ok(3.0 * (len * 4) as f64 / t / 1e9)
}

/// Cost of one dispatch, microseconds: a batch of tiny dispatches in one submit, minus one.
fn launch_overhead_us(gpu: &Gpu, iters: usize) -> Result<f64> {
    let a = gpu.upload_f32("calibrate.a", &random(64, 1))?;
    let b = gpu.upload_f32("calibrate.b", &random(64, 2))?;
    let batch = |reps: usize| {
        median_time(iters, || {
            let mut e = gpu.encoder();
            for _ in 0..reps {
                ops::elementwise(gpu, &mut e, Elementwise::Add, &a, Some(&b), (1, 64))?;
            }
            gpu.submit(e);
            gpu.wait()
        })
    };
    let (one, many, reps) = (batch(1)?, batch(65)?, 64.0);
    Ok(((many - one) / reps * 1e6).max(0.0))
}

/// Times `record` (one dispatch) `reps` times per submit; seconds per dispatch.
fn per_dispatch(
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
fn kernel_rates(
    gpu: &Gpu,
    c: &ModelConfig,
    tokens: &[usize],
    context: usize,
    iters: usize,
) -> Result<f64> {
    let (h, f, d) = (c.hidden, c.ffn, c.head_dim);
    let qkv = (c.heads + 2 * c.kv_heads) * d;
    println!("  matmul (tiled) at the model's projection shapes, GFLOP/s:");
    let shapes = [(qkv, h), (h, c.heads * d), (f, h), (h, f), (c.vocab, h)];
    let maxk = shapes.iter().map(|s| s.0.max(s.1)).max().unwrap_or(h);
    let t_max = tokens.iter().copied().max().unwrap_or(1);
    let x = gpu.upload_f32("calibrate.x", &random(t_max * maxk, 3))?;
    let y = gpu.empty("calibrate.y", DType::F32, t_max * c.vocab.max(maxk))?;
    print!("    {:>8}", "tokens");
    for (n, k) in shapes {
        print!(" {:>12}", format!("{n}x{k}"));
    }
    println!();
    let weights: Vec<Tensor> = shapes
        .iter()
        .map(|&(n, k)| gpu.upload_weights("calibrate.w", &random(n * k, 4), DType::F32))
        .collect::<Result<_>>()?;
    for &t in tokens {
        print!("    {t:>8}");
        for (&(n, k), w) in shapes.iter().zip(&weights) {
            let s = per_dispatch(gpu, iters, 2, |e| {
                ops::matmul(gpu, e, &x, w, None, &y, (t, n, k), MatmulKernel::Tiled)
            })?;
            print!(" {:>12.2}", 2.0 * (t * n * k) as f64 / s / 1e9);
        }
        println!();
    }
    // Element-wise streaming rate: norm, residual add and SwiGLU rows of the model's widths
    // over 16 MiB per operand, so that the dispatch cost (measured apart) does not count.
    let len = 4usize << 20;
    let a = gpu.upload_f32("calibrate.ea", &random(len, 5))?;
    let b = gpu.upload_f32("calibrate.eb", &random(len, 6))?;
    let gamma = gpu.upload_f32("calibrate.gamma", &random(h, 7))?;
    let out = gpu.empty("calibrate.eo", DType::F32, len)?;
    let (hr, fr) = (len / h, len / f);
    let mut gbps = Vec::new();
    let s = per_dispatch(gpu, iters, 2, |e| {
        ops::norm(gpu, e, Norm::Rms { gamma: &gamma }, &a, &out, hr, h, 1e-5)
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
    print!("  element-wise over 16 MiB operands, GB/s (bytes read plus written):");
    for (name, v) in &gbps {
        print!(" {name} {v:.2}");
    }
    println!();
    // Attention over the model's heads: a decode step against the prompt, and the prefill.
    let kv_heads = c.kv_heads;
    for (seq, past, batch) in [
        (1usize, context, t_max),
        (context, 0, (t_max / context).max(1)),
    ] {
        let shape = AttnShape {
            batch,
            seq,
            past,
            n_heads: c.heads,
            n_kv_heads: kv_heads,
            head_dim: d,
            max_seq: c.max_seq,
            group: c.heads / kv_heads.max(1),
            q_head_offset: 0,
            kv_head_offset: 0,
        };
        if past + seq > c.max_seq {
            continue;
        }
        let cache = gpu.upload_f32("calibrate.kv", &random(shape.cache_len(), 8))?;
        let q = gpu.upload_f32("calibrate.q", &random(batch * seq * c.heads * d, 9))?;
        let o = gpu.empty("calibrate.o", DType::F32, batch * seq * c.heads * d)?;
        let s = per_dispatch(gpu, iters, 4, |e| {
            ops::attention(gpu, e, &q, &cache, &cache, &o, &shape)
        })?;
        // Keys and values read once per query head and position: the traffic it issues.
        let ctx: f64 = (0..seq).map(|i| (past + i + 1) as f64).sum::<f64>() * batch as f64;
        let traffic = ctx * c.heads as f64 * d as f64 * 2.0 * 4.0;
        println!(
            "  attention {batch}x{seq} tokens over {} positions: {:.3} ms, {:.2} GB/s",
            past + seq,
            s * 1e3,
            traffic / s / 1e9
        );
    }
    gbps.sort_by(|a, b| a.1.total_cmp(&b.1));
    Ok(gbps[gbps.len() / 2].1)
}

/// Dispatches the model's blocks encode per layer: (attention half with its residual, whole
/// layer). Mirrors `model::gpu`: norm, Q/K/V, RoPE (Llama), cache append, attention, output
/// projection, bias (GPT-2) and residual add; then norm, up, gate and SwiGLU (Llama) or GELU,
/// down, bias (GPT-2) and residual add.
fn dispatches_per_layer(c: &ModelConfig) -> (usize, usize) {
    // The engines' own counts (`parallel::cost`), so calibration and spans agree.
    let shard = ShardSpec::full(c);
    let step = Step {
        batch: 1,
        seq: 1,
        past: 0,
    };
    let attention = wgpar::parallel::cost::attention(c, &shard, &step, wgpar::device::DType::F32)
        .kernels as usize;
    let mlp =
        wgpar::parallel::cost::mlp(c, &shard, &step, wgpar::device::DType::F32).kernels as usize;
    (attention, attention + mlp)
}

/// The steps the curves are measured at: decode and prefill with 1, 2, 4, ... sequences.
fn block_steps(batch: usize, prompt: usize, quick: bool) -> Vec<Step> {
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
struct Point {
    intensity: f64,
    gflops: f64,
}

/// Buffers for running `step` on a model: activations, a KV cache and token ids written.
fn step_buffers(m: &GpuModel, step: &Step) -> Result<(Activations, KvCache)> {
    let act = m.activations(step.tokens(), step.batch)?;
    let kv = m.kv_cache(step.batch)?;
    let vocab = m.config().vocab as u32;
    let ids: Vec<u32> = (0..step.tokens() as u32)
        .map(|i| i * 7919 % vocab)
        .collect();
    m.write_ids(&act, &ids)?;
    Ok((act, kv))
}

/// Every layer's blocks of `step` in one submit, like the single and pipeline engines, and a
/// wait; `whole` = attention and MLP halves, else attention halves only.
fn run_blocks(
    m: &GpuModel,
    act: &Activations,
    kv: &KvCache,
    step: &Step,
    whole: bool,
) -> Result<()> {
    let gpu = m.gpu();
    let mut e = gpu.encoder();
    for i in 0..m.num_layers() {
        m.attention(&mut e, i, act, kv, step)?;
        m.attention_residual(&mut e, i, act, step)?;
        if whole {
            m.mlp(&mut e, i, act, step)?;
            m.mlp_residual(&mut e, i, act, step)?;
        }
    }
    gpu.submit(e);
    gpu.wait()
}

/// Median time of [`run_blocks`], seconds.
fn time_blocks(m: &GpuModel, step: &Step, whole: bool, iters: usize) -> Result<f64> {
    let (act, kv) = step_buffers(m, step)?;
    median_time(iters, || run_blocks(m, &act, &kv, step, whole))
}

/// The blocks measured at each step: achieved rates of the attention halves and of whole
/// layers, and the time of the whole layers alone (seconds), which the sharing measurement
/// compares against.
struct BlockCurves {
    attention: Vec<Point>,
    layers: Vec<Point>,
    alone_s: Vec<(Step, f64)>,
}

/// Achieved rate of the model's blocks at each step.
fn block_curves(m: &GpuModel, steps: &[Step], launch_us: f64, iters: usize) -> Result<BlockCurves> {
    let c = m.config().clone();
    let shard = ShardSpec::full(&c);
    let layers = m.num_layers() as f64;
    let (attn_k, layer_k) = dispatches_per_layer(&c);
    let (mut attn, mut whole, mut alone_s) = (Vec::new(), Vec::new(), Vec::new());
    println!(
        "  model blocks ({} layers, one submit), net of {:.1} us per dispatch:",
        m.num_layers(),
        launch_us
    );
    println!(
        "    {:<22} {:>10} {:>10} {:>9} {:>10} {:>10} {:>9}",
        "step", "attn ms", "flop/B", "GFLOP/s", "layer ms", "flop/B", "GFLOP/s"
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
            // Dispatch costs are added back per recorded kernel by the projection; a noisy
            // estimate must not leave less than a tenth of the measured time.
            let net = (t - layers * k as f64 * launch_us / 1e6).max(t / 10.0);
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
        println!(
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
fn curve(mut points: Vec<Point>) -> Vec<[f64; 2]> {
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

/// Mean time of `step`'s whole layers on `m` while the other threads do the same: repeats it
/// from `start` until `until` and averages the repetitions that finished by then, so every
/// counted repetition ran with all devices busy. Seconds.
fn sustained_block_time(m: &GpuModel, step: &Step, until: Instant) -> Result<f64> {
    let (act, kv) = step_buffers(m, step)?;
    let mut done = Vec::new();
    loop {
        let t = Instant::now();
        run_blocks(m, &act, &kv, step, true)?;
        let end = Instant::now();
        if end > until {
            break;
        }
        done.push((end - t).as_secs_f64());
    }
    // The first repetition may have started before the others were running.
    if done.len() > 1 {
        done.remove(0);
    }
    Ok(done.iter().sum::<f64>() / done.len().max(1) as f64)
}

/// Slowdown of each of k = 1..=N devices computing whole layers at the same time, relative to
/// one alone, per step shape and overall. The devices run back to back for `window` seconds
/// (at least three slowed-down repetitions) per step shape, which is the situation the
/// projection models: k devices busy at once. The processor need not share fairly, so the
/// slowdown is taken from the devices' combined throughput, `k / sum(alone / time_i)`, the
/// equal-share figure that does the same work in the same time.
///
/// "Alone" is the block time behind the rate curves (`alone_s`), not a fresh measurement: a
/// shared span is projected as its curve time times this slowdown, so the two must describe
/// the same alone run. On a CPU driver a decode step alone is bimodal (whether the cores idle
/// between its tiny dispatches, and pay the wake-ups, varies from minute to minute) while the
/// same step shared with busy neighbours is steady; relative to the curve's own figure the
/// product stays right either way.
///
/// Returns the sharing with one curve row per step (its whole-layer intensity) and, as the
/// summary and fallback, the slowdowns weighted by time alone.
fn sharing_slowdown(
    models: &[Arc<GpuModel>],
    steps: &[Step],
    window: f64,
    alone_s: &[(Step, f64)],
) -> Result<ComputeSharing> {
    // Mean repetition time of each of the first k devices, per step.
    let measure = |k: usize, step: &Step, window: f64| -> Result<Vec<f64>> {
        let barrier = Arc::new(Barrier::new(k));
        let per_device: Vec<Result<f64>> = std::thread::scope(|scope| {
            let handles: Vec<_> = models[..k]
                .iter()
                .map(|m| {
                    let barrier = barrier.clone();
                    scope.spawn(move || {
                        // Warm the step's buffers up, then start together.
                        time_blocks(m, step, true, 1)?;
                        barrier.wait();
                        let until = Instant::now() + std::time::Duration::from_secs_f64(window);
                        sustained_block_time(m, step, until)
                    })
                })
                .collect();
            join_all(handles)
        });
        per_device.into_iter().collect()
    };
    let c = models[0].config().clone();
    let shard = ShardSpec::full(&c);
    let n = models.len();
    let mut weight = 0.0;
    let mut sums = vec![0.0; n + 1];
    let mut rows: Vec<Vec<f64>> = Vec::new();
    println!(
        "    {:<22} {:>9} {:>8}  slowdown with k devices busy, k = 2..{n}",
        "step", "alone ms", "flop/B"
    );
    for step in steps {
        let t1 = match alone_s.iter().find(|(s, _)| s == step) {
            Some(&(_, t)) => t,
            None => time_blocks(&models[0], step, true, 3)?,
        };
        let a = cost::attention(&c, &shard, step, DType::F32);
        let m = cost::mlp(&c, &shard, step, DType::F32);
        let intensity = (a.flops + m.flops) as f64 / (a.bytes + m.bytes) as f64;
        let mut row = vec![intensity, 1.0];
        for (k, sum) in sums.iter_mut().enumerate().skip(2) {
            // Long enough for several repetitions of a slowed-down step.
            let w = window.max(3.0 * k as f64 * t1);
            let times = measure(k, step, w)?;
            let throughput: f64 = times.iter().map(|t| t1 / t).sum();
            let s = (k as f64 / throughput).max(1.0);
            *sum += t1 * s;
            row.push(s);
        }
        weight += t1;
        let kind = if step.seq == 1 { "decode" } else { "prefill" };
        println!(
            "    {:<22} {:>9.2} {:>8.2}  {}",
            format!("{kind} {}x{} (+{})", step.batch, step.seq, step.past),
            t1 * 1e3,
            intensity,
            row[2..]
                .iter()
                .map(|s| format!("{s:.2}"))
                .collect::<Vec<_>>()
                .join("  ")
        );
        rows.push(row);
    }
    let mut slowdown = vec![1.0];
    for (k, sum) in sums.iter().enumerate().skip(2) {
        let s = (sum / weight).max(1.0);
        println!("    {k} devices busy at once, weighted by time alone: each {s:.2}x slower (equal shares would be {k}x)");
        slowdown.push(s);
    }
    // Rows in increasing intensity; steps of (nearly) the same intensity are averaged.
    rows.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let mut curve: Vec<(Vec<f64>, f64)> = Vec::new();
    for row in rows {
        match curve.last_mut() {
            Some((sum, count)) if row[0] <= sum[0] / *count * 1.02 => {
                for (x, v) in sum.iter_mut().zip(&row) {
                    *x += v;
                }
                *count += 1.0;
            }
            _ => curve.push((row, 1.0)),
        }
    }
    Ok(ComputeSharing {
        shared_by: n as u32,
        slowdown,
        slowdown_curve: curve
            .into_iter()
            .map(|(sum, count)| sum.into_iter().map(|x| x / count).collect())
            .collect(),
    })
}

fn cpu_name() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = text
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!(
        "{}, {cores} hardware threads",
        model.unwrap_or_else(|| "unknown CPU".into())
    )
}

/// Device memory: wgpu does not report it. A CPU driver's memory is the host's; otherwise the
/// largest buffer the adapter allows, a lower bound.
fn memory_bytes(gpu: &Gpu) -> u64 {
    if gpu.info().device_type == "Cpu" {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = text
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
        if let Some(k) = kib {
            return k * 1024;
        }
    }
    gpu.info().max_buffer_size.max(1)
}

/// Today's UTC date, `YYYY-MM-DD` (civil-from-days, proleptic Gregorian).
fn utc_date() -> String {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Devices that sit on the same adapter, in runs of consecutive device indices.
fn adapter_groups(gpus: &[Arc<Gpu>]) -> Vec<Vec<Arc<Gpu>>> {
    let mut groups: Vec<Vec<Arc<Gpu>>> = Vec::new();
    for g in gpus {
        match groups.last_mut() {
            Some(last) if last[0].info().index == g.info().index => last.push(g.clone()),
            _ => groups.push(vec![g.clone()]),
        }
    }
    groups
}

/// Runs the calibration and writes the profile.
pub fn run(args: &CalibrateArgs) -> Result<()> {
    let config = args.model.config()?;
    if args.iters == 0 || args.batch == 0 || args.prompt_len == 0 {
        return Err(WgparError::Config(
            "--iters, --batch and --prompt-len must be positive".into(),
        ));
    }
    if args.prompt_len + 1 > config.max_seq {
        return Err(WgparError::Config(format!(
            "--prompt-len {} leaves no room to decode in max_seq {} of model '{}'",
            args.prompt_len, config.max_seq, config.name
        )));
    }
    let max_bytes = if args.quick {
        256 << 10
    } else {
        parse_size(&args.max_bytes).map_err(|e| WgparError::Config(format!("--max-bytes: {e}")))?
    };
    let iters = if args.quick {
        args.iters.min(3)
    } else {
        args.iters
    };
    let sizes: Vec<u64> = std::iter::successors(Some(256u64), |s| Some(s * 4))
        .take_while(|&s| s <= max_bytes)
        .collect();
    if sizes.len() < 2 {
        return Err(WgparError::Config(format!(
            "--max-bytes {max_bytes} leaves fewer than two sizes (the sweep starts at 256 bytes)"
        )));
    }
    let adapters = wgpar::device::Adapters::discover()?;
    let gpus = args.devices.open(&adapters)?;
    let date = utc_date();
    let host_name = cpu_name();
    println!(
        "calibrating {} device(s) on {host_name}, {date}",
        gpus.len()
    );
    for g in &gpus {
        println!(
            "  {}: driver {} {}",
            g.describe(),
            g.info().driver,
            g.info().driver_info
        );
    }
    let coll = Collectives::new(CommConfig::default())?;
    let weights = ModelWeights::synthetic(&config, args.model.seed);
    let steps = block_steps(args.batch, args.prompt_len, args.quick);
    let tokens: Vec<usize> = {
        let mut t: Vec<usize> = steps.iter().map(Step::tokens).collect();
        t.sort_unstable();
        t.dedup();
        t
    };

    let mut measured = Vec::new();
    for group in adapter_groups(&gpus) {
        let gpu = &group[0];
        println!();
        println!(
            "# {} (stands for {} device(s))",
            gpu.describe(),
            group.len()
        );
        println!(
            "host links (size sweep {} B .. {} B, median of {iters}):",
            sizes[0], max_bytes
        );
        let (d2h_pts, h2d_pts) = link_sweeps(&coll, gpu, &sizes, iters)?;
        println!("  {:>10} {:>12} {:>12}", "bytes", "d2h us", "h2d us");
        for (d, h) in d2h_pts.iter().zip(&h2d_pts) {
            println!("  {:>10} {:>12.1} {:>12.1}", d.0, d.1 * 1e6, h.1 * 1e6);
        }
        let d2h = fit_link("device->host", &d2h_pts)?;
        let h2d = fit_link("host->device", &h2d_pts)?;
        print_fit("device->host", &d2h);
        print_fit("host->device", &h2d);

        println!(
            "kernels at the shapes of model {} (median of {iters}):",
            config.name
        );
        let launch_us = launch_overhead_us(gpu, iters)?;
        println!("  one dispatch: {launch_us:.1} us");
        let elementwise_gbps = kernel_rates(gpu, &config, &tokens, args.prompt_len, iters)?;
        let model = Arc::new(GpuModel::upload(
            gpu.clone(),
            &weights,
            Placement::whole(&config),
            DType::F32,
        )?);
        let blocks = block_curves(&model, &steps, launch_us, iters)?;
        let attention_curve = curve(blocks.attention);
        let matmul_curve = curve(blocks.layers);
        let plateau = |c: &[[f64; 2]]| c.last().map_or(0.0, |p| p[1]);

        let compute_sharing = if group.len() > 1 {
            println!("shared processor ({} devices on one adapter):", group.len());
            let mut models = vec![model.clone()];
            for g in &group[1..] {
                models.push(Arc::new(GpuModel::upload(
                    g.clone(),
                    &weights,
                    Placement::whole(&config),
                    DType::F32,
                )?));
            }
            // The run's own steps, so that the sharing is measured under the concurrency the
            // runs see: prefill and decode of the whole batch (tensor parallel, single) and of
            // one sequence (a pipeline's micro-batches).
            let mut shapes = vec![
                Step {
                    batch: args.batch,
                    seq: args.prompt_len,
                    past: 0,
                },
                Step {
                    batch: args.batch,
                    seq: 1,
                    past: args.prompt_len,
                },
            ];
            if args.batch > 1 && !args.quick {
                shapes.push(Step {
                    batch: 1,
                    seq: args.prompt_len,
                    past: 0,
                });
                shapes.push(Step {
                    batch: 1,
                    seq: 1,
                    past: args.prompt_len,
                });
            }
            let window = if args.quick { 0.3 } else { 1.0 };
            Some(sharing_slowdown(&models, &shapes, window, &blocks.alone_s)?)
        } else {
            None
        };
        measured.push(MeasuredDevice {
            name: gpu.info().label(),
            count: group.len() as u32,
            memory_bytes: memory_bytes(gpu),
            h2d,
            d2h,
            matmul_gflops: plateau(&matmul_curve),
            matmul_f16_gflops: None,
            attention_gflops: Some(plateau(&attention_curve)),
            elementwise_gbps,
            launch_overhead_us: launch_us,
            matmul_curve,
            attention_curve,
            compute_sharing,
        });
    }

    println!();
    println!("between devices:");
    let b = gpus.get(1).unwrap_or(&gpus[0]);
    let bounce_pts = bounce_sweep(&coll, &gpus[0], b, &sizes, iters)?;
    let bounce = fit_link("device->host->device", &bounce_pts)?;
    print_fit("dev->host->dev", &bounce);
    let host_reduce = if gpus.len() > 1 {
        host_reduce_gbps(&gpus, &sizes, iters)?
    } else {
        let r = host_sum_gbps(iters)?;
        println!("  one device: host summing two 16 MiB buffers: {r:.2} GB/s");
        r
    };
    println!("  host reduce rate: {host_reduce:.2} GB/s (bytes read plus written)");

    let mut machine = MachineMeasurement {
        name: args.name.clone(),
        description: format!(
            "this machine as calibrated on {date}: {} device(s), {}",
            gpus.len(),
            gpus[0].info().label()
        ),
        host_name,
        host_reduce_gbps: host_reduce,
        collective_overhead_us: Vec::new(),
        devices: measured,
    };
    let invalid = |e: wgpar::sim::ProfileError| WgparError::Config(e.to_string());
    if gpus.len() > 1 {
        let base = calibrated_profile(&machine).map_err(invalid)?;
        machine.collective_overhead_us = collective_overheads(&gpus, &base, iters.max(9))?;
        let list: Vec<String> = machine
            .collective_overhead_us
            .iter()
            .enumerate()
            .map(|(i, o)| format!("{} devices {o:.1} us", i + 2))
            .collect();
        println!(
            "  fixed cost per host-staged collective: {}",
            list.join(", ")
        );
    }
    let profile = calibrated_profile(&machine).map_err(invalid)?;
    let note = format!(
        "{date}, wgpar {}; driver {} {}\nkernel rates at model {} shapes, batch up to {}, prompt {}\n\
         device->host->device fit: alpha {:.1} us, beta {:.3} GB/s (R^2 {:.4})",
        env!("CARGO_PKG_VERSION"),
        gpus[0].info().driver,
        gpus[0].info().driver_info,
        config.name,
        args.batch,
        args.prompt_len,
        bounce.alpha_us,
        bounce.beta_gbps,
        bounce.r_squared
    );
    if let Some(dir) = std::path::Path::new(&args.out).parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).map_err(|source| WgparError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
    }
    write_calibrated_profile(&profile, &note, &args.out).map_err(invalid)?;
    println!();
    println!("profile `{}` written to {}", profile.name, args.out);
    Ok(())
}
