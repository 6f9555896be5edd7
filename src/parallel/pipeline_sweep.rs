//! `wgpar bench pipeline`'s sweep: every (stages, micro-batches) pair of the command line,
//! checked, listed for the memory check, measured with [`super::bench_pipeline`] on the first
//! `p` devices and rendered as one table row per phase and schedule.

use std::sync::Arc;

use super::{bench_pipeline, PartitionSpec, PipelineBench, PipelineBenchRow, Schedule, Strategy};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, ModelWeights};

/// A micro-batch count as `--micro-batches` gives it: a number, `p` (the stage count) or
/// `Kp` (K times the stage count).
pub fn micro_batch_count(text: &str, p: usize) -> Result<usize> {
    let bad = || WgparError::option("--micro-batches", format!("bad micro-batch count '{text}'"));
    match text {
        "p" => Ok(p),
        t if t.ends_with('p') => t[..t.len() - 1]
            .parse::<usize>()
            .map(|k| k * p)
            .map_err(|_| bad()),
        t => t.parse().map_err(|_| bad()),
    }
}

/// What the sweep measures.
#[derive(Debug, Clone)]
pub struct PipelineSweep {
    /// Stage counts.
    pub stages: Vec<usize>,
    /// Micro-batch counts as given (`1`, `p`, `4p`), resolved per stage count.
    pub micro_batches: Vec<String>,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Sequences per micro-batch (the batch grows with m), unless `batch` is given.
    pub per_microbatch: usize,
    /// A fixed batch for every m.
    pub batch: Option<usize>,
    /// Measure the GPipe prefill.
    pub prefill: bool,
    /// Decode schedules to measure (none: no decode).
    pub schedules: Vec<Schedule>,
    /// Tokens generated per sequence in the decode phase.
    pub gen: usize,
    /// Timed repetitions (best kept).
    pub reps: usize,
}

/// One configuration of the sweep: its strategy, stages, batch and micro-batches.
#[derive(Debug, Clone)]
pub struct SweepRun {
    /// A pipeline of `micro_batches` over even stages.
    pub strategy: Strategy,
    /// Stages (devices).
    pub stages: usize,
    /// Sequences.
    pub batch: usize,
    /// Micro-batches.
    pub micro_batches: usize,
}

impl PipelineSweep {
    /// The counts, checked before anything is loaded.
    pub fn check(&self) -> Result<()> {
        if self.stages.is_empty() || self.stages.contains(&0) {
            return Err(WgparError::option(
                "--stages",
                "--stages must be positive".into(),
            ));
        }
        if self.prompt_len == 0 || self.per_microbatch == 0 || self.batch == Some(0) {
            return Err(WgparError::option(
                "--prompt-len",
                "--prompt-len, --per-microbatch and --batch must be positive".into(),
            ));
        }
        if !self.schedules.is_empty() && self.gen < 2 {
            return Err(WgparError::option(
                "--gen",
                "--gen must be at least 2 to measure decode".into(),
            ));
        }
        Ok(())
    }

    /// The batch a run with `m` micro-batches measures.
    pub fn batch_of(&self, m: usize) -> usize {
        self.batch.unwrap_or(self.per_microbatch * m)
    }

    /// Every configuration, stage count by stage count.
    pub fn runs(&self) -> Result<Vec<SweepRun>> {
        let mut runs = Vec::new();
        for &p in &self.stages {
            for text in &self.micro_batches {
                let m = micro_batch_count(text, p)?;
                runs.push(SweepRun {
                    strategy: Strategy::Pipeline {
                        partition: PartitionSpec::Even,
                        micro_batches: m,
                        schedule: Schedule::InFlight,
                    },
                    stages: p,
                    batch: self.batch_of(m),
                    micro_batches: m,
                });
            }
        }
        Ok(runs)
    }

    /// Measures every configuration on the first `p` of `gpus`, handing each row's text to
    /// `row` as it is measured.
    pub fn measure(
        &self,
        gpus: &[Arc<Gpu>],
        (weights, dtype): (&ModelWeights, DType),
        mut row: impl FnMut(String) -> Result<()>,
    ) -> Result<()> {
        for run in self.runs()? {
            let bench = PipelineBench {
                micro_batches: run.micro_batches,
                batch: run.batch,
                prompt_len: self.prompt_len,
                gen: self.gen,
                reps: self.reps,
                prefill: self.prefill,
                schedules: self.schedules.clone(),
            };
            for r in bench_pipeline(&gpus[..run.stages], weights, dtype, &bench)? {
                row(render_row(&r, run.stages, bench.batch))?;
            }
        }
        Ok(())
    }

    /// The title line (model, work, device) and the column heads.
    pub fn header(&self, config: &ModelConfig, gpu: &Gpu) -> String {
        let title = format!(
            "# model {} ({} layers), prompt {}, {}, gen {}, {} ({} {})",
            config.name,
            config.layers,
            self.prompt_len,
            match self.batch {
                Some(b) => format!("batch {b}"),
                None => format!("{} sequence(s) per micro-batch", self.per_microbatch),
            },
            self.gen,
            gpu.describe(),
            gpu.info().driver,
            gpu.info().driver_info
        );
        let heads = format!(
            "{:<8} {:<9} {:>3} {:>4} {:>5} {:>8} {:>10} {:>11} {:>8} {:>8} {:>8} {:>18}",
            "phase",
            "schedule",
            "p",
            "m",
            "batch",
            "tokens",
            "tokens/s",
            "ideal tok/s",
            "of ideal",
            "bubble",
            "theory",
            "hand-off/pass"
        );
        format!("{title}\n{heads}\n")
    }
}

/// One row of the table: a phase of `p` stages over `batch` sequences.
fn render_row(r: &PipelineBenchRow, p: usize, batch: usize) -> String {
    let s = &r.stats;
    let (handoff_s, handoff_b) = s.handoff_per_microbatch();
    format!(
        "{:<8} {:<9} {:>3} {:>4} {:>5} {:>8} {:>10.1} {:>11.1} {:>7.0}% {:>7.1}% {:>7.1}% {:>7.2} ms {:>6} B\n",
        r.phase,
        r.schedule,
        p,
        s.microbatches,
        batch,
        s.tokens,
        s.tokens_per_s(),
        s.ideal_tokens_per_s(),
        s.tokens_per_s() / s.ideal_tokens_per_s() * 100.0,
        s.measured_bubble * 100.0,
        s.theoretical_bubble * 100.0,
        handoff_s * 1e3,
        handoff_b
    )
}
