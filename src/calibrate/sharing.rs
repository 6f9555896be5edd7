//! Devices on one processor: how much k of them busy at once slow each other down, per step
//! shape.

use std::io::Write;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use crate::error::Result;
use crate::model::{GpuModel, Step};
use crate::sim::ComputeSharing;

use super::blocks::{run_blocks, step_buffers, time_blocks, StackWork};
use super::join_all;

/// The step shapes the sharing is measured at: the run's own, so that it is measured under the
/// concurrency the runs see: prefill and decode of the whole batch (tensor parallel, single)
/// and, unless `quick`, of one sequence (a pipeline's micro-batches); each as the engines run
/// it ([`super::blocks::engine_step`]).
pub(crate) fn sharing_steps(
    batch: usize,
    prompt_len: usize,
    quick: bool,
    config: &crate::model::ModelConfig,
) -> Vec<Step> {
    let mut steps = vec![
        Step {
            batch,
            seq: prompt_len,
            past: 0,
        },
        Step {
            batch,
            seq: 1,
            past: prompt_len,
        },
    ];
    if batch > 1 && !quick {
        steps.push(Step {
            batch: 1,
            seq: prompt_len,
            past: 0,
        });
        steps.push(Step {
            batch: 1,
            seq: 1,
            past: prompt_len,
        });
    }
    steps
        .into_iter()
        .map(|s| super::blocks::engine_step(s, config))
        .collect()
}

/// Mean time of `step`'s whole layers on `m` while the other threads do the same: repeats it
/// from `start` until `until` and averages the repetitions that finished by then, so every
/// counted repetition ran with all devices busy. Seconds.
pub(crate) fn sustained_block_time(m: &GpuModel, step: &Step, until: Instant) -> Result<f64> {
    let (act, kv) = step_buffers(m, step)?;
    let mut done = Vec::new();
    loop {
        let t = Instant::now();
        run_blocks(m, &act, &kv, true)?;
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
pub(super) fn sharing_slowdown(
    models: &[Arc<GpuModel>],
    steps: &[Step],
    window: f64,
    alone_s: &[(Step, f64)],
    log: &mut dyn Write,
) -> Result<ComputeSharing> {
    let n = models.len();
    let mut weight = 0.0;
    let mut sums = vec![0.0; n + 1];
    let mut rows: Vec<Vec<f64>> = Vec::new();
    say!(
        log,
        "    {:<22} {:>9} {:>8}  slowdown with k devices busy, k = 2..{n}",
        "step",
        "alone ms",
        "flop/B"
    );
    for step in steps {
        let t1 = match alone_s.iter().find(|(s, _)| s == step) {
            Some(&(_, t)) => t,
            None => time_blocks(&models[0], step, true, 3)?,
        };
        let row = slowdown_row(models, step, t1, window)?;
        for (k, sum) in sums.iter_mut().enumerate().skip(2) {
            *sum += t1 * row[k];
        }
        weight += t1;
        let kind = if step.seq == 1 { "decode" } else { "prefill" };
        say!(
            log,
            "    {:<22} {:>9.2} {:>8.2}  {}",
            format!("{kind} {}x{} (+{})", step.batch, step.seq, step.past),
            t1 * 1e3,
            row[0],
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
        say!(log, "    {k} devices busy at once, weighted by time alone: each {s:.2}x slower (equal shares would be {k}x)");
        slowdown.push(s);
    }
    Ok(ComputeSharing {
        shared_by: n as u32,
        slowdown,
        slowdown_curve: intensity_curve(rows),
    })
}

/// One curve row for `step` (`t1` seconds alone): its whole-layer intensity (flop/B), then
/// the slowdown with k = 1..=N devices busy at once.
fn slowdown_row(models: &[Arc<GpuModel>], step: &Step, t1: f64, window: f64) -> Result<Vec<f64>> {
    let m = &models[0];
    let intensity = StackWork::of(m.config(), m.placement(), step).layer_intensity();
    let mut row = vec![intensity, 1.0];
    for k in 2..=models.len() {
        // Long enough for several repetitions of a slowed-down step.
        let w = window.max(3.0 * k as f64 * t1);
        let times = measure_together(&models[..k], step, w)?;
        let throughput: f64 = times.iter().map(|t| t1 / t).sum();
        row.push((k as f64 / throughput).max(1.0));
    }
    Ok(row)
}

/// Mean repetition time of `step` on each of `models`, all running it at once for `window`
/// seconds.
fn measure_together(models: &[Arc<GpuModel>], step: &Step, window: f64) -> Result<Vec<f64>> {
    let barrier = Arc::new(Barrier::new(models.len()));
    let per_device: Vec<Result<f64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = models
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
}

/// Rows in increasing intensity; steps of (nearly) the same intensity are averaged.
fn intensity_curve(mut rows: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
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
    curve
        .into_iter()
        .map(|(sum, count)| sum.into_iter().map(|x| x / count).collect())
        .collect()
}
