//! The decode benchmark (`wgpar bench decode`): what one engine's steady decode step costs on
//! the host, how fast it runs, and whether it creates buffers or bind groups per step.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::Engine;
use crate::comm::CommConfig;
use crate::device::{Created, DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, ModelWeights};
use crate::stats::median;

/// One engine's decode figures.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeMeasure {
    /// Median host time to stage, record and submit one decode step (mean over devices);
    /// absent for a pipeline (its stage threads do not report it).
    pub encode_us: Option<f64>,
    /// The same in CPU time of the recording thread (the host work without waits for a
    /// core); absent where the platform has no thread CPU clock.
    pub encode_cpu_us: Option<f64>,
    /// Median wall time of a decode step.
    pub step_ms: f64,
    /// Generated tokens per second over the timed steps.
    pub tokens_per_s: f64,
    /// Buffers created per timed step (most over devices).
    pub buffers_per_step: f64,
    /// Bind groups created per timed step (most over devices).
    pub bind_groups_per_step: f64,
}

/// Prefills `prompts` on `engine` (which runs on `devices`), decodes `warmup` untimed steps,
/// then times `steps` greedy decode steps.
pub fn measure_decode(
    engine: &mut dyn Engine,
    devices: &[Arc<Gpu>],
    prompts: &[Vec<u32>],
    (warmup, steps): (usize, usize),
) -> Result<DecodeMeasure> {
    if steps == 0 {
        return Err(WgparError::TooFew {
            what: "timed decode steps".into(),
            got: 0,
            min: 1,
        });
    }
    let mut next = engine.prefill_step(prompts, false)?.tokens;
    for _ in 0..warmup {
        next = engine.decode_step(&next, false)?.tokens;
    }
    let before = created(devices);
    let (mut encode, mut encode_cpu, mut walls) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    for _ in 0..steps {
        let t = Instant::now();
        next = engine.decode_step(&next, false)?.tokens;
        walls.push(t.elapsed().as_secs_f64());
        let stats = engine.last_step();
        encode.extend(stats.as_ref().and_then(|s| s.encode_s));
        encode_cpu.extend(stats.and_then(|s| s.encode_cpu_s));
    }
    let total = start.elapsed().as_secs_f64();
    let after = created(devices);
    let per_step = |f: fn(&Created) -> u64| {
        (after.iter().zip(&before))
            .map(|(a, b)| f(a).saturating_sub(f(b)))
            .max()
            .unwrap_or(0) as f64
            / steps as f64
    };
    let none = || WgparError::TooFew {
        what: "timed decode steps".into(),
        got: 0,
        min: 1,
    };
    Ok(DecodeMeasure {
        encode_us: median(encode).map(|s| s * 1e6),
        encode_cpu_us: median(encode_cpu).map(|s| s * 1e6),
        step_ms: median(walls).ok_or_else(none)? * 1e3,
        tokens_per_s: (prompts.len() * steps) as f64 / total,
        buffers_per_step: per_step(|c| c.buffers),
        bind_groups_per_step: per_step(|c| c.bind_groups),
    })
}

fn created(gpus: &[Arc<Gpu>]) -> Vec<Created> {
    gpus.iter().map(|g| g.created()).collect()
}

/// `wgpar bench decode`'s work: which strategies, over how many devices, on what batch.
#[derive(Debug, Clone)]
pub struct DecodeBench {
    /// The strategies by name as given (`single`, `tp`, `pp`) and as built.
    pub strategies: Vec<(String, super::Strategy)>,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub stages: usize,
    /// Sequences decoded together.
    pub batch: usize,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Untimed decode steps first.
    pub warmup: usize,
    /// Decode steps timed.
    pub steps: usize,
}

/// One strategy's figures in [`DecodeBench::measure`]'s table.
#[derive(Debug, Serialize)]
pub struct DecodeBenchRow {
    /// The strategy's name.
    pub strategy: String,
    /// Devices it ran on.
    pub devices: usize,
    /// Sequences.
    pub batch: usize,
    /// Timed steps.
    pub steps: usize,
    /// What was measured.
    #[serde(flatten)]
    pub measured: DecodeMeasure,
}

/// A strategy `bench decode` measures, by name: `single`, `tp` or `pp` (one micro-batch).
pub fn decode_strategy(name: &str) -> Result<super::Strategy> {
    use super::{PartitionSpec, Schedule, Strategy};
    match name {
        "single" => Ok(Strategy::Single),
        "tp" => Ok(Strategy::Tensor { split: None }),
        "pp" => Ok(Strategy::Pipeline {
            partition: PartitionSpec::Even,
            micro_batches: 1,
            schedule: Schedule::InFlight,
        }),
        other => Err(WgparError::option(
            "--strategies",
            format!("bench decode measures 'single', 'tp' and 'pp', not '{other}'"),
        )),
    }
}

impl DecodeBench {
    /// Devices `strategy` runs on: one, `stages` or `tp`.
    pub fn devices_of(&self, strategy: &super::Strategy) -> usize {
        match strategy {
            super::Strategy::Single => 1,
            super::Strategy::Pipeline { .. } => self.stages,
            _ => self.tp,
        }
    }

    /// Devices the largest strategy runs on.
    pub fn devices(&self) -> usize {
        (self.strategies.iter())
            .map(|(_, s)| self.devices_of(s))
            .max()
            .unwrap_or(1)
    }

    /// The counts and the strategies' devices, checked against the model before anything
    /// opens.
    pub fn check(&self, config: &ModelConfig) -> Result<()> {
        use super::Strategy;
        if self.steps == 0 || self.batch == 0 || self.prompt_len == 0 {
            return Err(WgparError::option(
                "--steps",
                "--steps, --batch and --prompt-len must be at least 1".into(),
            ));
        }
        let any = |f: fn(&Strategy) -> bool| self.strategies.iter().any(|(_, s)| f(s));
        let needs_tp = any(|s| matches!(s, Strategy::Tensor { .. }));
        if needs_tp && self.tp < 2 {
            return Err(WgparError::option("--tp", "--tp must be at least 2".into()));
        }
        let needs_pp = any(|s| matches!(s, Strategy::Pipeline { .. }));
        if needs_pp && !(2..=config.layers).contains(&self.stages) {
            return Err(WgparError::option(
                "--stages",
                format!(
                    "--stages must be in 2..={} (the layers of model '{}')",
                    config.layers, config.name
                ),
            ));
        }
        self.check_context(config)?;
        let valid = crate::model::valid_tp_degrees(config);
        if needs_tp && !valid.contains(&self.tp) {
            return Err(WgparError::unsupported(format!(
                "model '{}' does not split over {} devices (valid: {valid:?})",
                config.name, self.tp
            )));
        }
        Ok(())
    }

    /// The prompt, warm-up and timed steps within the model's context.
    fn check_context(&self, config: &ModelConfig) -> Result<()> {
        let context = self.prompt_len + self.warmup + self.steps + 1;
        if context > config.max_seq {
            return Err(WgparError::limit(
                "context (tokens)",
                (context as u64, config.max_seq as u64),
                format!(
                    "--prompt-len {} + --warmup {} + --steps {} need {context} positions, model \
                     '{}' has {}",
                    self.prompt_len, self.warmup, self.steps, config.name, config.max_seq
                ),
            ));
        }
        Ok(())
    }

    /// Builds each strategy's engine on the first of `gpus` and measures its decode.
    pub fn measure(
        &self,
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
    ) -> Result<Vec<DecodeBenchRow>> {
        let vocab = weights.config.vocab;
        let prompts: Vec<Vec<u32>> = (0..self.batch)
            .map(|b| {
                (0..self.prompt_len)
                    .map(|i| ((b * 7919 + i * 131) % vocab) as u32)
                    .collect()
            })
            .collect();
        let mut rows = Vec::new();
        for (name, strategy) in &self.strategies {
            let devices = &gpus[..self.devices_of(strategy)];
            let comm = CommConfig::default();
            let mut engine = super::build_engine(strategy, devices, weights, dtype, &comm, (1, 1))?;
            let steps = (self.warmup, self.steps);
            rows.push(DecodeBenchRow {
                strategy: name.clone(),
                devices: devices.len(),
                batch: self.batch,
                steps: self.steps,
                measured: measure_decode(engine.as_mut(), devices, &prompts, steps)?,
            });
        }
        Ok(rows)
    }

    /// The table of `rows`, with a title naming the model, the work and the device `g`. A
    /// figure not measured (the pipeline's encode time) prints `-`.
    pub fn render(&self, config: &ModelConfig, g: &Gpu, rows: &[DecodeBenchRow]) -> String {
        let mut s = format!(
            "# model {} ({} layers), batch {}, prompt {}, {} timed decode steps after {}, {} ({} {})\n",
            config.name,
            config.layers,
            self.batch,
            self.prompt_len,
            self.steps,
            self.warmup,
            g.describe(),
            g.info().driver,
            g.info().driver_info
        );
        s += &format!(
            "{:>10} {:>7} {:>14} {:>13} {:>10} {:>10} {:>13} {:>17}\n",
            "strategy",
            "devices",
            "encode us/step",
            "(thread CPU)",
            "ms/step",
            "tokens/s",
            "buffers/step",
            "bind groups/step"
        );
        for r in rows {
            let m = &r.measured;
            let us = |v: Option<f64>| v.map_or("-".into(), |c| format!("{c:.1}"));
            s += &format!(
                "{:>10} {:>7} {:>14} {:>13} {:>10.2} {:>10.1} {:>13.1} {:>17.1}\n",
                r.strategy,
                r.devices,
                us(m.encode_us),
                us(m.encode_cpu_us),
                m.step_ms,
                m.tokens_per_s,
                m.buffers_per_step,
                m.bind_groups_per_step
            );
        }
        s
    }
}
