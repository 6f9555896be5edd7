//! Step statistics of a pipeline: per-stage sums of the recorded spans, and the run's
//! bubbles and ideal makespan from them.

use std::ops::Range;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{PipelineEngine, Schedule};
use crate::parallel::StepStats;
use crate::threads::lock;

/// Per-stage accounting of a run. Every time is the sum of the stage's recorded spans of that
/// kind (on its first device, for a hybrid stage), so the statistics and the timeline agree.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// Layers held.
    pub layers: Range<usize>,
    /// Device.
    pub device: String,
    /// Time computing (the compute spans: encode, submit, device work), seconds.
    pub busy_s: f64,
    /// Time receiving the previous stage's activations (host -> device: the h2d spans), seconds.
    pub upload_s: f64,
    /// Time handing the output on (device -> host: the d2h spans), seconds. On a device stage
    /// it overlaps the next micro-batch's compute.
    pub download_s: f64,
    /// Time in the stage's tensor-parallel all-reduces (hybrid: the collective spans), seconds.
    pub collective_s: f64,
    /// Time the stage's own thread was occupied: upload and compute (and, on a hybrid stage,
    /// its collectives, waits and download), seconds. With [`download_s`](Self::download_s),
    /// what limits the stage's rate.
    pub occupied_s: f64,
    /// Bytes received from the previous stage.
    pub bytes_in: u64,
    /// Bytes handed to the next stage (or logits read back on the last stage).
    pub bytes_out: u64,
    /// Bytes the stage's all-reduces carried (hybrid), per device.
    pub collective_bytes: u64,
    /// Host transfers (uploads and downloads).
    pub transfers: usize,
    /// All-reduces (hybrid stages).
    pub collectives: usize,
    /// Micro-batch passes processed.
    pub microbatches: usize,
}

impl StageStats {
    /// Upload plus download time, seconds.
    pub fn handoff_s(&self) -> f64 {
        self.upload_s + self.download_s
    }

    /// Mean time per pass that limits the stage's rate: its thread's occupation or its
    /// outgoing link, whichever is longer.
    pub fn per_pass_s(&self) -> f64 {
        self.occupied_s.max(self.download_s) / self.microbatches.max(1) as f64
    }

    pub(super) fn clear(&mut self) {
        *self = StageStats {
            layers: self.layers.clone(),
            device: std::mem::take(&mut self.device),
            ..Default::default()
        };
    }
}

/// Accounting of one pipeline run (a GPipe step, an in-flight decode or a served stream).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PipelineStats {
    /// Stages.
    pub stages: Vec<StageStats>,
    /// How the run was scheduled.
    pub schedule: Schedule,
    /// Micro-batches (lanes) in flight.
    pub microbatches: usize,
    /// Passes through the pipeline (micro-batch steps) in the run, per stage.
    pub passes: usize,
    /// First input to last output, seconds.
    pub makespan_s: f64,
    /// 1 - sum(busy) / (p x makespan).
    pub measured_bubble: f64,
    /// The bubble of a perfect pipeline with equal stages: (p - 1) / (m + p - 1) for a GPipe
    /// step; for N passes over lanes of K passes each, 1 - N / max(N + p - 1, K p).
    pub theoretical_bubble: f64,
    /// Makespan of a perfect pipeline with the measured per-pass stage times `t_s` (total
    /// `T_s` per stage): max(max T_s + sum t_s - max t_s, K sum t_s), the slowest stage's
    /// work plus fill and drain, or the longest lane's chain of K passes. For a GPipe step,
    /// sum(t_s) + (m - 1) max(t_s).
    pub ideal_makespan_s: f64,
    /// New tokens processed.
    pub tokens: usize,
    /// Passes the longest lane made in a row (1 for a GPipe step).
    pub chain: usize,
}

impl PipelineStats {
    /// The accounting of `stages` (in pipeline order) over a run of `makespan_s` that
    /// processed `tokens` with `lanes` sequence groups in flight, the longest making `chain`
    /// passes in a row: bubbles and the ideal makespan from the measured stage times. The
    /// engine closes its runs with it; `dist` with the stages of every rank.
    pub fn from_stages(
        stages: Vec<StageStats>,
        schedule: Schedule,
        makespan_s: f64,
        tokens: usize,
        lanes: usize,
        chain: usize,
    ) -> Self {
        let p = stages.len().max(1) as f64;
        let passes = stages.first().map_or(0, |s| s.microbatches);
        let per_pass: Vec<f64> = stages.iter().map(StageStats::per_pass_s).collect();
        let slowest = per_pass.iter().cloned().fold(0.0, f64::max);
        let cycle: f64 = per_pass.iter().sum();
        let bottleneck = stages
            .iter()
            .map(|s| s.occupied_s.max(s.download_s))
            .fold(0.0, f64::max);
        let ideal = (bottleneck + cycle - slowest).max(chain as f64 * cycle);
        let n = passes as f64;
        let uniform = (n + p - 1.0).max(chain as f64 * p);
        let busy: f64 = stages.iter().map(|s| s.busy_s).sum();
        PipelineStats {
            schedule,
            microbatches: lanes,
            passes,
            makespan_s,
            measured_bubble: if makespan_s > 0.0 {
                1.0 - busy / (p * makespan_s)
            } else {
                0.0
            },
            theoretical_bubble: if uniform > 0.0 {
                1.0 - n / uniform
            } else {
                0.0
            },
            ideal_makespan_s: ideal,
            tokens,
            chain,
            stages,
        }
    }

    /// Measured throughput, tokens/s.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.makespan_s
    }

    /// Throughput of the ideal pipeline, tokens/s.
    pub fn ideal_tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.ideal_makespan_s
    }

    /// Mean hand-off time (upload + download) and bytes per pass at one stage boundary.
    pub fn handoff_per_microbatch(&self) -> (f64, u64) {
        let inner = &self.stages[..self.stages.len().saturating_sub(1)];
        let passes: usize = inner.iter().map(|s| s.microbatches).sum();
        if inner.is_empty() || passes == 0 {
            return (0.0, 0);
        }
        // A boundary costs the sender's download and the receiver's upload.
        let secs = inner
            .iter()
            .zip(&self.stages[1..])
            .map(|(a, b)| a.download_s + b.upload_s)
            .sum::<f64>()
            / passes as f64;
        let bytes = inner.iter().map(|s| s.bytes_out).sum::<u64>() / passes as u64;
        (secs, bytes)
    }
}

impl PipelineEngine {
    /// Closes a run: its [`PipelineStats`] and [`StepStats`] from the stage statistics.
    /// `lanes` sequence groups were in flight, the longest making `chain` passes in a row.
    pub(super) fn finish_run(&mut self, start: Instant, tokens: usize, lanes: usize, chain: usize) {
        let (step, run) = self.run_stats(start.elapsed().as_secs_f64(), tokens, lanes, chain);
        self.last = Some(step);
        self.last_run = Some(run);
    }

    /// The accounting of the stage statistics so far, for a run of `makespan_s`.
    pub(super) fn run_stats(
        &self,
        makespan_s: f64,
        tokens: usize,
        lanes: usize,
        chain: usize,
    ) -> (StepStats, PipelineStats) {
        let stages = lock(&self.stats).clone();
        let p = stages.len().max(1) as f64;
        let mean = |f: &dyn Fn(&StageStats) -> f64| stages.iter().map(f).sum::<f64>() / p;
        let busy: f64 = stages.iter().map(|s| s.busy_s).sum();
        let step = StepStats {
            tokens,
            wall_s: makespan_s,
            compute_s: busy / p,
            comm_s: mean(&|s| s.upload_s + s.download_s + s.collective_s),
            collectives: mean(&|s| (s.transfers + s.collectives) as f64).round() as usize,
            bytes_sent: mean(&|s| (s.bytes_out + s.collective_bytes) as f64).round() as u64,
            bytes_received: mean(&|s| (s.bytes_in + s.collective_bytes) as f64).round() as u64,
            encode_s: None,
            encode_cpu_s: None,
        };
        let run =
            PipelineStats::from_stages(stages, self.schedule, makespan_s, tokens, lanes, chain);
        (step, run)
    }
}
