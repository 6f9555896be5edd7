//! Links: host<->device copy sweeps fitted to alpha-beta, the device->host->device bounce,
//! the host reduction rate and the fixed cost of a host-staged all-reduce.

use std::io::Write;
use std::sync::{Arc, Barrier};

use crate::comm::{CollectiveOp as CommOp, Collectives, CommConfig, Communicator};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{self, MatmulIo, MatmulKernel};
use crate::sim::{fit_alpha_beta, Algorithm, AlphaBetaFit, CostModel, HostProfile};
use crate::trace::CollectiveOp as TraceOp;

use super::{join_all, median_time, random};
use crate::stats::median;

pub(super) fn fit_error(what: &str, source: crate::sim::FitError) -> WgparError {
    WgparError::Fit {
        what: what.to_string(),
        source,
    }
}

/// Fits a link sweep; when noise hides the bandwidth term entirely (times do not grow with
/// size, as happens on a loaded machine over a short sweep), keeps the link latency-bound:
/// alpha is the median time and beta the lower bound the largest size shows, with a warning,
/// instead of failing the whole calibration.
pub(super) fn fit_link(
    what: &str,
    points: &[(u64, f64)],
    log: &mut dyn Write,
) -> Result<AlphaBetaFit> {
    match fit_alpha_beta(points) {
        Err(crate::sim::FitError::NoBandwidth { us_per_mb }) => {
            let median_s = median(points.iter().map(|p| p.1).collect())
                .ok_or_else(|| fit_error(what, crate::sim::FitError::TooFewPoints { found: 0 }))?;
            let (bytes, secs) = points
                .iter()
                .copied()
                .max_by_key(|p| p.0)
                .unwrap_or((1, median_s));
            say!(
                log,
                "warning: {what}: times do not grow with size ({us_per_mb:.1} us/MB fitted); \
                 latency-bound over this sweep: alpha = median time, beta = its lower bound \
                 (use a longer --max-bytes sweep on a quieter machine)"
            );
            Ok(AlphaBetaFit {
                alpha_us: median_s * 1e6,
                beta_gbps: bytes as f64 / secs / 1e9,
                r_squared: 0.0,
                rms_relative_residual: 0.0,
                points: points.len(),
            })
        }
        other => other.map_err(|e| fit_error(what, e)),
    }
}

pub(super) fn print_fit(what: &str, fit: &AlphaBetaFit, log: &mut dyn Write) {
    say!(
        log,
        "  {what:<14} alpha {:>8.1} us   beta {:>7.3} GB/s   R^2 {:.4}   rms rel. residual {:.1} % ({} points)",
        fit.alpha_us,
        fit.beta_gbps,
        fit.r_squared,
        fit.rms_relative_residual * 100.0,
        fit.points
    );
}

/// Copy sweeps of one device: (device->host, host->device) points as (bytes, seconds).
pub(super) type Sweep = Vec<(u64, f64)>;

pub(super) fn link_sweeps(
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
pub(super) fn bounce_sweep(
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
pub(super) fn host_reduce_gbps(
    gpus: &[Arc<Gpu>],
    sizes: &[u64],
    iters: usize,
    log: &mut dyn Write,
) -> Result<f64> {
    let coll = Collectives::new(CommConfig::default())?;
    let n = gpus.len() as f64;
    let mut rates = Vec::new();
    say!(
        log,
        "  all-reduce over {} devices (host-staged):",
        gpus.len()
    );
    for &bytes in sizes.iter().filter(|&&b| b >= 64 << 10) {
        let len = (bytes / 4) as usize;
        let tensors: Vec<Tensor> = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| g.upload_f32("calibrate.ar", &random(len, 20 + i as u32)))
            .collect::<Result<_>>()?;
        let parts: Vec<(&Gpu, &Tensor)> = gpus.iter().map(|g| &**g).zip(&tensors).collect();
        let total = median_time(iters, || coll.all_reduce(&parts))?;
        let reduce: Vec<f64> = coll
            .stats()
            .drain()
            .iter()
            .filter(|r| r.op == CommOp::AllReduce && r.error.is_none())
            .map(|r| r.reduce.as_secs_f64())
            .filter(|&s| s > 0.0)
            .collect();
        if let Some(r) = median(reduce) {
            // Each chunk reads n partials and writes one sum: (n + 1) S bytes in all.
            let gbps = (n + 1.0) * bytes as f64 / r / 1e9;
            say!(
                log,
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
        .ok_or_else(|| WgparError::Measurement("no all-reduce reported a reduce phase".into()))
}

/// Time of one all-reduce of `bytes` through a [`Communicator`] over `gpus`, as the
/// tensor-parallel engine meets it: one thread per rank, each computes (a decode-sized matmul,
/// submitted and waited for) and then joins the collective, which is the rendezvous. Counted
/// from the moment the last rank arrived to each rank's return, averaged over the ranks (what
/// the engine records as the collective span); median over `iters` calls, microseconds.
///
/// The compute before each call matters on a CPU driver: back to back, with the driver's
/// threads still awake, the same all-reduce measured 2-3 times faster than in a run.
pub(super) fn communicator_all_reduce_us(
    gpus: &[Arc<Gpu>],
    bytes: usize,
    iters: usize,
) -> Result<f64> {
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
                        let io = MatmulIo {
                            x: &x,
                            w: &w,
                            bias: None,
                            y: &y,
                        };
                        ops::matmul(&gpu, &mut enc, io, (rows, out, inner), MatmulKernel::Tiled)?;
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
    let calls: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|r| r[i]).sum::<f64>() / n as f64)
        .collect();
    median(calls).ok_or_else(|| WgparError::Measurement("no all-reduce was timed".into()))
}

/// Fixed host cost of a host-staged all-reduce over the first 2, 3, ... devices: the measured
/// time of small (single-chunk) all-reduces minus what `base` models for their copies and
/// reduction, median over sizes, microseconds.
pub(super) fn collective_overheads(
    gpus: &[Arc<Gpu>],
    base: &HostProfile,
    iters: usize,
    log: &mut dyn Write,
) -> Result<Vec<f64>> {
    let model = CostModel::new(base);
    let mut out = Vec::new();
    say!(log, "  all-reduce through the rank-per-thread communicator after each rank's compute, measured vs modelled copies + reduction:");
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
                .map_err(|source| WgparError::Projection {
                    what: format!("a {n}-device all-reduce"),
                    profile: base.name.clone(),
                    source,
                })?;
            say!(
                log,
                "    {n} devices, {:>7} B: {measured:>8.1} us measured, {modelled:>8.1} us modelled",
                bytes
            );
            extra.push(measured - modelled);
        }
        out.push(median(extra).map_or(0.0, |e| e.max(0.0)));
    }
    Ok(out)
}

/// Host reduce rate without a second device: the host summing two buffers into a third.
pub(super) fn host_sum_gbps(iters: usize) -> Result<f64> {
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
