//! A timed generation on synthetic prompts, what `wgpar run` measures in one process and the
//! driving rank measures over MPI ranks: an untimed warm-up that compiles the pipelines and
//! allocates the buffers, then a recorded prefill (for its accounting) and a generation.

use std::sync::Arc;
use std::time::Instant;

use super::{generate, generate_keeping, Engine, Generation, KeepLogits, PipelineStats, StepStats};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::load::ModelChoice;
use crate::model::memory::DeviceBytes;
use crate::model::{ModelConfig, ModelWeights};
use crate::trace::Recorder;

/// Steps of the untimed warm-up (a generation of 2 tokens: a prefill and one decode step).
pub const WARMUP_STEPS: usize = 2;

/// The shape of a timed run: `batch` synthetic prompts of `prompt_len` tokens, `gen` tokens
/// generated per sequence, the logits `keep` names kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedRun {
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per prompt.
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    pub gen: usize,
    /// The logits the generation keeps.
    pub keep: KeepLogits,
}

/// What the recorded prefill measured: its step's accounting and its pipeline's bubble.
#[derive(Debug, Clone, Default)]
pub struct PrefillStats {
    /// The prefill step's accounting.
    pub step: Option<StepStats>,
    /// The prefill's pipeline statistics (pipelines only).
    pub pipeline: Option<PipelineStats>,
}

/// The measured part of a run.
#[derive(Debug, Clone)]
pub struct Timed {
    /// The recorded prefill.
    pub prefill: PrefillStats,
    /// The generation after it (its own prefill and the decode steps).
    pub generation: Generation,
    /// The accounting of the generation's last step (the decode).
    pub decode: Option<StepStats>,
    /// Wall time of the whole recorded part, seconds.
    pub wall_s: f64,
}

impl TimedRun {
    /// `batch` prompts of `prompt_len` token ids spread over a `vocab`-token vocabulary, the
    /// same in one process and over ranks.
    pub fn prompts(&self, vocab: usize) -> Vec<Vec<u32>> {
        (0..self.batch)
            .map(|b| {
                (0..self.prompt_len)
                    .map(|i| ((b * 7919 + i * 104_729) % vocab.max(1)) as u32)
                    .collect()
            })
            .collect()
    }

    /// Tokens the recorded part processes: one prefill, then a generation (a prefill and
    /// `gen - 1` decode steps). What `wgpar project` turns a makespan into throughput with.
    pub fn tokens(&self) -> usize {
        self.batch * (2 * self.prompt_len + self.gen.max(1) - 1)
    }

    /// Writes what a reader of the trace needs to know what ran, `model` on `strategy`.
    pub fn describe(&self, recorder: &Recorder, model: &str, strategy: &str) {
        for (key, value) in [
            ("model", model.to_string()),
            ("strategy", strategy.to_string()),
            ("batch", self.batch.to_string()),
            ("prompt_len", self.prompt_len.to_string()),
            ("gen", self.gen.to_string()),
            ("tokens", self.tokens().to_string()),
        ] {
            recorder.set_meta(key, value);
        }
    }

    /// The untimed pass: compiles the pipelines and allocates the buffers (an injected fault
    /// counts its jobs too).
    pub fn warm_up(&self, engine: &mut dyn Engine, vocab: usize) -> Result<()> {
        generate(engine, &self.prompts(vocab), WARMUP_STEPS).map(|_| ())
    }

    /// The recorded prefill of `prompts`, with its accounting.
    pub fn prefill(&self, engine: &mut dyn Engine, prompts: &[Vec<u32>]) -> Result<PrefillStats> {
        engine.prefill(prompts)?;
        Ok(PrefillStats {
            step: engine.last_step(),
            pipeline: engine.pipeline_stats(),
        })
    }

    /// The recorded generation of `gen` tokens after `prompts`.
    pub fn generate(&self, engine: &mut dyn Engine, prompts: &[Vec<u32>]) -> Result<Generation> {
        generate_keeping(engine, prompts, self.gen, self.keep)
    }

    /// The recorded part: [`Self::prefill`], then [`Self::generate`], timed.
    pub fn run(&self, engine: &mut dyn Engine, vocab: usize) -> Result<Timed> {
        let prompts = self.prompts(vocab);
        let start = Instant::now();
        let prefill = self.prefill(engine, &prompts)?;
        let generation = self.generate(engine, &prompts)?;
        Ok(Timed {
            prefill,
            generation,
            decode: engine.last_step(),
            wall_s: start.elapsed().as_secs_f64(),
        })
    }
}

/// Writes a generation's tokens and every kept step's logits as JSON: for comparing
/// strategies and layouts bit for bit.
pub fn write_logits(path: &str, batch: usize, vocab: usize, g: &Generation) -> Result<()> {
    let rows: Vec<&Vec<f32>> = g.logits.iter().map(|l| &l.data).collect();
    let text = serde_json::to_string(&serde_json::json!({
        "batch": batch, "vocab": vocab, "tokens": g.tokens, "logits": rows
    }))
    .map_err(|source| WgparError::Json {
        what: "logits".into(),
        source,
    })?;
    std::fs::write(path, text).map_err(|source| WgparError::Io {
        path: path.to_string(),
        source,
    })
}

/// The line that says what runs: the model's shape, how its weights are held and the KV
/// caches' type.
pub fn model_line(
    config: &ModelConfig,
    weights: &ModelWeights,
    dtype: DType,
    gpus: &[Arc<Gpu>],
) -> String {
    format!(
        "model {} ({} arch, {} layers, hidden {}, {:.1}M params, {}, {})",
        config.name,
        format!("{:?}", config.arch).to_lowercase(),
        config.layers,
        config.hidden,
        config.params() as f64 / 1e6,
        storage_of(weights, dtype),
        kv_of(gpus),
    )
}

/// The devices' weight bytes (as accounted, which the memory lines check against what was
/// allocated; summed over devices) beside a GGUF file's tensor bytes, so that a file widened
/// on the device shows.
pub fn weight_bytes_line(model: ModelChoice<'_>, accounted: &[DeviceBytes]) -> Result<String> {
    let device: u64 = accounted.iter().map(|a| a.weights).sum();
    let file = match model.checkpoint_dir() {
        Some(path) if crate::model::gguf::is_gguf(path) => {
            let f = crate::model::gguf::GgufFile::open(path)?;
            let bytes: u64 = (f.tensors.iter())
                .map(|(_, i)| (i.end - i.start) as u64)
                .sum();
            let ratio = device as f64 / bytes.max(1) as f64;
            format!(", the file's tensors {bytes} B ({ratio:.2}x)")
        }
        _ => String::new(),
    };
    Ok(format!("weights: {device} B on the device(s){file}"))
}

/// The devices' adapters for a trace's metadata: their labels, `; `-separated.
pub fn adapter_labels(gpus: &[Arc<Gpu>]) -> String {
    let labels: Vec<String> = gpus.iter().map(|g| g.info().label()).collect();
    labels.join("; ")
}

/// How the weights are held on the device: packed into one block type, the file's own
/// blocks, or `dtype` throughout.
pub fn storage_of(weights: &ModelWeights, dtype: DType) -> String {
    match (weights.packed, weights.block_types().as_slice()) {
        (Some(t), _) if weights.tables.iter().next().is_some() => {
            let tables: Vec<String> = (weights.tables.iter())
                .map(|(name, m)| format!("{name} in the file's {}", m.dtype.name()))
                .collect();
            let tables = tables.join(", ");
            format!("{} layer matrices, {tables}, {dtype:?} elsewhere", t.name())
        }
        (Some(t), _) => format!("{} layer matrices, {dtype:?} elsewhere", t.name()),
        (None, []) => format!("{dtype:?} weights"),
        (None, types) => {
            let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
            format!("the file's {} blocks, {dtype:?} elsewhere", names.join("/"))
        }
    }
}

/// The KV caches' element type: one for all devices, or each device's where they differ
/// (`--kv-dtype auto` over adapters with and without SHADER_F16).
pub fn kv_of(gpus: &[Arc<Gpu>]) -> String {
    let types: Vec<DType> = gpus.iter().map(|g| g.kv_dtype()).collect();
    if types.windows(2).all(|w| w[0] == w[1]) {
        return format!(
            "{:?} KV cache",
            types.first().copied().unwrap_or(DType::F32)
        );
    }
    let each: Vec<String> = gpus
        .iter()
        .map(|g| format!("{:?} on {}", g.kv_dtype(), g.label()))
        .collect();
    format!("KV cache {}", each.join(", "))
}

/// A run's prefill and decode rates as `wgpar run` prints them, with the prefill's accounting
/// and its pipeline's bubble, then the decode's accounting when it decoded.
pub fn render_rates(g: &Generation, batch: usize, prefill: &PrefillStats) -> String {
    let mut s = format!(
        "prefill: {} tokens in {:.1} ms = {:.1} tokens/s (time to first token {:.1} ms)\n",
        g.prompt_tokens,
        g.prefill_s * 1e3,
        g.prefill_tokens_per_s(),
        g.prefill_s * 1e3
    );
    if let Some(st) = &prefill.step {
        s += &format!(
            "  compute {:.1} ms, communication {:.1} ms ({:.0}% of device time), {} collectives/hand-offs, {} B sent per device\n  {}\n",
            st.compute_s * 1e3,
            st.comm_s * 1e3,
            st.comm_share() * 100.0,
            st.collectives,
            st.bytes_sent,
            st.per_token_line()
        );
    }
    if let Some(p) = &prefill.pipeline {
        s += &format!(
            "  pipeline: {} stages x {} micro-batches, bubble {:.0}% measured ({:.0}% = (p-1)/(m+p-1) for equal stages)\n",
            p.stages.len(),
            p.microbatches,
            p.measured_bubble * 100.0,
            p.theoretical_bubble * 100.0
        );
    }
    if g.decode_steps == 0 {
        // The prefill gave the only token (`--gen 1`): no decode step was timed.
        s += &format!(
            "decode: 0 tokens x {batch} sequences: n/a ms per token, n/a tokens/s (no decode \
             step was run)\n"
        );
    } else {
        s += &format!(
            "decode: {} tokens x {} sequences in {:.1} ms, {:.2} ms per token = {:.1} tokens/s\n",
            g.decode_steps,
            batch,
            g.decode_s * 1e3,
            g.per_token_s() * 1e3,
            g.decode_tokens_per_s()
        );
        let st = &g.decode_stats;
        s += &format!(
            "  compute {:.2} ms, communication {:.2} ms ({:.0}%), {} collectives/hand-offs per device\n  {}\n",
            st.compute_s * 1e3,
            st.comm_s * 1e3,
            st.comm_share() * 100.0,
            st.collectives,
            st.per_token_line()
        );
    }
    s
}

/// A pipeline's bubble share (measured and the GPipe bound) after `indent`, as compare and
/// bench print it; empty for an engine that is not a pipeline.
pub fn render_bubble(stats: Option<&PipelineStats>, indent: &str) -> String {
    stats.map_or_else(String::new, |p| {
        format!(
            "{indent}pipeline: {} stages x {} micro-batches ({}), bubble {:.0}% measured ({:.0}% for equal stages)\n",
            p.stages.len(),
            p.microbatches,
            p.schedule,
            p.measured_bubble * 100.0,
            p.theoretical_bubble * 100.0
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_cover_the_batch_within_the_vocabulary() {
        let run = TimedRun {
            batch: 3,
            prompt_len: 5,
            gen: 4,
            keep: KeepLogits::None,
        };
        let prompts = run.prompts(97);
        assert_eq!(prompts.len(), 3);
        assert!(prompts.iter().all(|p| p.len() == 5));
        assert!(prompts.iter().flatten().all(|&t| t < 97));
        // Different sequences, so a batch's rows are not all one.
        assert_ne!(prompts[0], prompts[1]);
        // One prefill of 3 x 5, then a generation: a prefill and 3 decode steps.
        assert_eq!(run.tokens(), 3 * (2 * 5 + 3));
    }
}
