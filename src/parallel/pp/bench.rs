//! The pipeline benchmark (`wgpar bench pipeline`): one configuration of stages and
//! micro-batches on given devices, its prefill (GPipe) and its decode under each schedule,
//! the best of a few repetitions each, as [`PipelineStats`] a caller prints or checks.

use std::sync::Arc;
use std::time::Instant;

use super::{PipelineEngine, PipelineStats, Schedule};
use crate::comm::CommConfig;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::ModelWeights;
use crate::parallel::{Engine, Partition};

/// What one configuration measures.
#[derive(Debug, Clone)]
pub struct PipelineBench {
    /// Micro-batches the batch is split into.
    pub micro_batches: usize,
    /// Sequences.
    pub batch: usize,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Tokens generated per sequence (the decode measures `gen - 1` steps after the prefill).
    pub gen: usize,
    /// Repetitions; the fastest counts.
    pub reps: usize,
    /// Measure the prefill.
    pub prefill: bool,
    /// Decode schedules to measure (none: no decode).
    pub schedules: Vec<Schedule>,
}

/// One measured row: the phase, its schedule and the best repetition's statistics.
#[derive(Debug, Clone)]
pub struct PipelineBenchRow {
    /// `prefill` or `decode`.
    pub phase: &'static str,
    /// The schedule's label (`gpipe` for every prefill).
    pub schedule: &'static str,
    /// The fastest repetition.
    pub stats: PipelineStats,
}

/// Runs `bench` on a pipeline of one stage per device of `gpus` (layers split evenly) over
/// `weights`: one untimed warm-up pass (pipelines compiled, buffers allocated for every
/// shape), then each phase `bench.reps` times.
pub fn bench_pipeline(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    bench: &PipelineBench,
) -> Result<Vec<PipelineBenchRow>> {
    let comm = CommConfig::default();
    let m = bench.micro_batches;
    let mut pp = PipelineEngine::new(gpus, weights, dtype, &Partition::Even, m, comm)?;
    let prompts = bench_prompts(bench.batch, bench.prompt_len, weights.config.vocab);
    let first = pp.prefill(&prompts)?;
    pp.decode_greedy(&first.argmax(), 1, false)?;
    let mut rows = Vec::new();
    if bench.prefill {
        let mut runs = Vec::new();
        for _ in 0..bench.reps.max(1) {
            pp.prefill(&prompts)?;
            runs.extend(pp.last_run().cloned());
        }
        rows.push(row("prefill", "gpipe", runs)?);
    }
    for &schedule in &bench.schedules {
        pp.set_schedule(schedule);
        let runs = (0..bench.reps.max(1))
            .map(|_| decode_once(&mut pp, &prompts, schedule, bench.gen))
            .collect::<Result<Vec<_>>>()?;
        rows.push(row(
            "decode",
            schedule.label(),
            runs.into_iter().flatten().collect(),
        )?);
    }
    Ok(rows)
}

/// `batch` prompts of `len` ids spread over the vocabulary.
fn bench_prompts(batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..len)
                .map(|i| ((b * 7919 + i * 131) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// The fastest of `runs` as a row.
fn row(
    phase: &'static str,
    schedule: &'static str,
    runs: Vec<PipelineStats>,
) -> Result<PipelineBenchRow> {
    let stats = runs
        .into_iter()
        .min_by(|a, b| a.makespan_s.total_cmp(&b.makespan_s))
        .ok_or_else(|| WgparError::TooFew {
            what: "timed pipeline runs".into(),
            got: 0,
            min: 1,
        })?;
    Ok(PipelineBenchRow {
        phase,
        schedule,
        stats,
    })
}

/// One prefill, then `gen - 1` decode steps under `schedule`: in flight one run, GPipe one
/// run per token, summed (the driver's sampling between steps counts, as it does in flight).
fn decode_once(
    pp: &mut PipelineEngine,
    prompts: &[Vec<u32>],
    schedule: Schedule,
    gen: usize,
) -> Result<Option<PipelineStats>> {
    let first = pp.prefill(prompts)?;
    if schedule == Schedule::InFlight {
        pp.decode_greedy(&first.argmax(), gen.saturating_sub(1), false)?;
        return Ok(pp.last_run().cloned());
    }
    let wall = Instant::now();
    let mut next = first.argmax();
    let mut total: Option<PipelineStats> = None;
    for _ in 1..gen {
        next = pp.decode(&next)?.argmax();
        let s = pp.last_run().cloned().unwrap_or_default();
        total = Some(match total {
            None => s,
            Some(t) => gpipe_sum(t, &s),
        });
    }
    if let Some(t) = total.as_mut() {
        let busy: f64 = t.stages.iter().map(|s| s.busy_s).sum();
        t.makespan_s = wall.elapsed().as_secs_f64();
        t.measured_bubble = 1.0 - busy / (t.stages.len().max(1) as f64 * t.makespan_s);
    }
    Ok(total)
}

/// Two GPipe steps run back to back, as one run: times, tokens and passes add up.
fn gpipe_sum(mut a: PipelineStats, b: &PipelineStats) -> PipelineStats {
    let busy = |s: &PipelineStats| -> f64 { s.stages.iter().map(|st| st.busy_s).sum() };
    let p = a.stages.len().max(1) as f64;
    let total_busy = busy(&a) + busy(b);
    // Bubbles weighted by each step's device-time.
    a.theoretical_bubble = (a.theoretical_bubble * a.makespan_s
        + b.theoretical_bubble * b.makespan_s)
        / (a.makespan_s + b.makespan_s);
    a.makespan_s += b.makespan_s;
    a.ideal_makespan_s += b.ideal_makespan_s;
    a.tokens += b.tokens;
    a.passes += b.passes;
    for (x, y) in a.stages.iter_mut().zip(&b.stages) {
        x.busy_s += y.busy_s;
        x.upload_s += y.upload_s;
        x.download_s += y.download_s;
        x.collective_s += y.collective_s;
        x.occupied_s += y.occupied_s;
        x.bytes_in += y.bytes_in;
        x.bytes_out += y.bytes_out;
        x.collective_bytes += y.collective_bytes;
        x.transfers += y.transfers;
        x.collectives += y.collectives;
        x.microbatches += y.microbatches;
    }
    a.measured_bubble = 1.0 - total_busy / (p * a.makespan_s);
    a
}
