//! Engines: run a model's forward pass on one device or across several. Every engine has the
//! same prefill/decode interface, so the CLI, the benchmarks and the tests treat them alike.

pub mod arming;
pub mod auto;
mod balance;
mod batch;
mod buffers;
pub mod choice;
pub mod cost;
mod decode_bench;
mod encoder;
mod fault;
pub mod partition;
mod pick;
pub mod pipeline_sweep;
pub(crate) mod pp;
pub mod run_plan;
mod single;
mod strategy;
pub mod timed;
mod tp;
mod upload;
mod worker;

use std::time::Instant;

pub use balance::{measure_stage_costs, rescale_stage_costs};
pub use batch::{
    blocks_per_slot, BatchStep, KvCopy, SeqRow, SlotTable, StepDone, StepEngine, KV_BLOCK,
};
pub(crate) use batch::{check_kv_edits, KvEdits};
pub use decode_bench::{
    decode_strategy, measure_decode, DecodeBench, DecodeBenchRow, DecodeMeasure,
};
pub use encoder::{cosine_similarity, pad_batch, Embeddings, Encoder, SingleEncoder};
pub use fault::{Fault, FaultKind};
pub use partition::{partition, Partition, StageCost};
pub use pp::{
    bench_pipeline, split_groups, PipelineBench, PipelineBenchRow, PipelineEngine, PipelineStats,
    Schedule, StageStats,
};
pub use single::SingleEngine;
pub use strategy::{
    build_engine, build_pipeline, build_step_engine, with_measured_partition, PartitionSpec,
    Strategy,
};
pub use tp::TensorParallelEngine;

use crate::error::{Result, WgparError};
use crate::model::sampling::SamplingParams;
use crate::sim::LinkPacer;
use crate::trace::Recorder;
use std::sync::Arc;

/// Accounting of one prefill or decode step.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepStats {
    /// New tokens in the step (all sequences).
    pub tokens: usize,
    /// Wall time of the step, seconds.
    pub wall_s: f64,
    /// Time a device spent computing (mean over devices), seconds.
    pub compute_s: f64,
    /// Time a device spent in collectives or transfers (mean over devices), seconds.
    pub comm_s: f64,
    /// Collectives (or hand-offs) per device in the step.
    pub collectives: usize,
    /// Bytes one device sent to the host in the step.
    pub bytes_sent: u64,
    /// Bytes one device received from the host in the step.
    pub bytes_received: u64,
    /// Host time to stage the step's inputs, record its commands and submit them (mean over
    /// devices; waits for the device and collectives excluded), seconds. Measured by the
    /// single-device and tensor-parallel engines.
    pub encode_s: Option<f64>,
    /// The same span in CPU time of the recording thread (mean over devices), seconds: the
    /// host work itself, without the time the thread waited for a core. Unix only.
    pub encode_cpu_s: Option<f64>,
}

impl StepStats {
    /// Adds `other`'s tokens, times, collectives and bytes (a run of several steps).
    pub fn accumulate(&mut self, other: &StepStats) {
        // A run's encode time is known where every step's is.
        let first = *self == StepStats::default();
        self.tokens += other.tokens;
        self.wall_s += other.wall_s;
        self.compute_s += other.compute_s;
        self.comm_s += other.comm_s;
        self.collectives += other.collectives;
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        let sum = |a: Option<f64>, b: Option<f64>, first: bool| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (None, Some(b)) if first => Some(b),
            _ => None,
        };
        self.encode_s = sum(self.encode_s, other.encode_s, first);
        self.encode_cpu_s = sum(self.encode_cpu_s, other.encode_cpu_s, first);
    }

    /// Communication as a share of compute + communication.
    pub fn comm_share(&self) -> f64 {
        let total = self.compute_s + self.comm_s;
        if total > 0.0 {
            self.comm_s / total
        } else {
            0.0
        }
    }

    /// The per-token line: compute ms, transfer ms, bytes sent/received per token.
    pub fn per_token_line(&self) -> String {
        let t = self.tokens.max(1) as f64;
        format!(
            "per token: compute {:.3} ms, transfer {:.3} ms, sent {:.0} B, received {:.0} B",
            self.compute_s * 1e3 / t,
            self.comm_s * 1e3 / t,
            self.bytes_sent as f64 / t,
            self.bytes_received as f64 / t
        )
    }
}

/// Last-token logits of each sequence, `[batch][vocab]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    /// Sequences.
    pub batch: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Logits {
    /// One sequence's logits.
    pub fn row(&self, b: usize) -> &[f32] {
        &self.data[b * self.vocab..(b + 1) * self.vocab]
    }

    /// Greedy choice per sequence (lowest index wins ties, NaN never wins).
    pub fn argmax(&self) -> Vec<u32> {
        (0..self.batch)
            .map(|b| {
                let mut best = 0;
                for (i, &v) in self.row(b).iter().enumerate() {
                    if v > self.row(b)[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect()
    }

    /// Largest |a - b| over all entries divided by the largest |b|: the norm-wise relative
    /// error the correctness bars are stated in.
    pub fn relative_error(&self, reference: &[f32]) -> f64 {
        let scale = reference
            .iter()
            .fold(0.0f64, |m, &v| m.max((v as f64).abs()))
            .max(f64::MIN_POSITIVE);
        let diff = self.data.iter().zip(reference).fold(0.0f64, |m, (&a, &b)| {
            let d = (a as f64 - b as f64).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                m.max(d)
            }
        });
        if self.data.len() != reference.len() {
            return f64::INFINITY;
        }
        diff / scale
    }
}

/// What one engine step hands back.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// Each sequence's next token: picked on the device (greedy, or the engine's sampling),
    /// or by the host sampler from read-back logits where the device cannot sample that way.
    pub tokens: Vec<u32>,
    /// Last-token logits `[batch][vocab]`, when asked for.
    pub logits: Option<Logits>,
}

impl StepOutput {
    fn into_logits(self) -> Result<Logits> {
        // Called only on the output of a step that asked for logits.
        self.logits
            .ok_or_else(|| WgparError::Internal("a step asked for logits returned none".into()))
    }
}

/// A way of running the model: one device, tensor parallel, pipeline parallel, or hybrid.
pub trait Engine {
    /// Short description, e.g. `tp=2 on gpu0,gpu1`.
    fn name(&self) -> String;

    /// Runs `prompts` (equal lengths) from an empty cache; returns each sequence's next token
    /// and, when `logits`, the last-token logits (otherwise only token ids are read back).
    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput>;

    /// Appends one token per sequence; returns each sequence's next token and, when `logits`,
    /// the new logits.
    fn decode_step(&mut self, tokens: &[u32], logits: bool) -> Result<StepOutput>;

    /// How later steps pick tokens (greedy until set); restarts the seeded draws.
    fn set_sampling(&mut self, params: SamplingParams) -> Result<()>;

    /// Runs `prompts` (equal lengths) from an empty cache; returns last-token logits.
    fn prefill(&mut self, prompts: &[Vec<u32>]) -> Result<Logits> {
        self.prefill_step(prompts, true)?.into_logits()
    }

    /// Appends one token per sequence; returns the new logits.
    fn decode(&mut self, tokens: &[u32]) -> Result<Logits> {
        self.decode_step(tokens, true)?.into_logits()
    }

    /// Greedily decodes `steps` more tokens per sequence after a prefill, starting from `next`
    /// (the tokens chosen from the last logits). The default runs one batched [`decode`]
    /// per token; a pipeline overrides it to keep its micro-batches in flight, each moving to
    /// its next token as soon as its own logits return. `keep_logits` keeps every step's
    /// logits (for checks against a reference); otherwise only tokens are kept.
    ///
    /// [`decode`]: Engine::decode
    fn decode_greedy(&mut self, next: &[u32], steps: usize, keep_logits: bool) -> Result<Decoded> {
        decode_step_by_step(self, next, steps, keep_logits)
    }

    /// Accounting of the last prefill or decode step.
    fn last_step(&self) -> Option<StepStats>;

    /// Records spans of every later step into `recorder` (a disabled recorder turns it off).
    fn set_recorder(&mut self, recorder: Recorder);

    /// Slows every later transfer and collective to a modelled link (`None`: real speed), so
    /// a run on one box behaves like the profiled machine. One device has nothing to pace.
    fn set_pacer(&mut self, pacer: Option<Arc<LinkPacer>>) {
        let _ = pacer;
    }

    /// Accounting of the last pipeline run (stages, bubble), for engines that are pipelines.
    fn pipeline_stats(&self) -> Option<PipelineStats> {
        None
    }

    /// Makes worker `worker` (a pipeline stage, or a tensor-parallel rank) fail as `fault`
    /// says: tests and demos of the failure path (`run --inject-fault`).
    fn inject_fault(&mut self, worker: usize, fault: Fault) -> Result<()> {
        let _ = fault;
        Err(WgparError::unsupported(format!(
            "{} has no worker {worker} to fail: --inject-fault needs --strategy tp, pp or hybrid",
            self.name()
        )))
    }
}

/// Tokens (and, when asked, logits) of a greedy decode run, with its accounting.
#[derive(Debug, Clone, Default)]
pub struct Decoded {
    /// Generated tokens per sequence (`steps` each).
    pub tokens: Vec<Vec<u32>>,
    /// Logits of every step, when kept (`[batch][vocab]` per step, in sequence order).
    pub logits: Vec<Logits>,
    /// Wall time of the whole run, seconds.
    pub wall_s: f64,
    /// Accounting summed over the run (tokens, compute, communication, bytes).
    pub stats: StepStats,
}

/// [`Engine::decode_greedy`] as one batched step per token: every sequence waits for the
/// whole batch's logits before its next token.
pub fn decode_step_by_step<E: Engine + ?Sized>(
    engine: &mut E,
    next: &[u32],
    steps: usize,
    keep_logits: bool,
) -> Result<Decoded> {
    let start = Instant::now();
    let mut next = next.to_vec();
    let mut out = Decoded {
        tokens: vec![Vec::with_capacity(steps); next.len()],
        ..Decoded::default()
    };
    for _ in 0..steps {
        let step = engine.decode_step(&next, keep_logits)?;
        next = step.tokens;
        for (seq_tokens, &t) in out.tokens.iter_mut().zip(&next) {
            seq_tokens.push(t);
        }
        if let Some(s) = engine.last_step() {
            out.stats.accumulate(&s);
        }
        out.logits.extend(step.logits);
    }
    out.wall_s = start.elapsed().as_secs_f64();
    Ok(out)
}

/// Checks a decode step's tokens against the prefilled batch (one token per sequence).
pub(crate) fn check_decode(batch: usize, tokens: &[u32]) -> Result<()> {
    if batch == 0 {
        return Err(WgparError::DecodeBeforePrefill);
    }
    if tokens.len() != batch {
        return Err(WgparError::DecodeTokens {
            got: tokens.len(),
            batch,
        });
    }
    Ok(())
}

/// The prefill of prompts of `seq` tokens as the steps a model takes, (past, tokens) each:
/// one step, or, where sliding-window layers keep a ring ([`ModelConfig::ring_step`]),
/// chunks of at most the ring's step at their pasts.
pub(crate) fn prefill_chunks(
    config: &crate::model::ModelConfig,
    seq: usize,
) -> Vec<(usize, usize)> {
    let most = config.ring_step().unwrap_or(seq).max(1);
    (0..seq)
        .step_by(most)
        .map(|past| (past, most.min(seq - past)))
        .collect()
}

/// Tokens `past .. past + len` of every prompt, one after another (a step's ids).
pub(crate) fn chunk_ids(prompts: &[Vec<u32>], (past, len): (usize, usize)) -> Vec<u32> {
    (prompts.iter())
        .flat_map(|p| p[past..past + len].iter().copied())
        .collect()
}

/// Checks a batch of prompts: non-empty, equal lengths. Returns (batch, seq).
pub fn prompt_shape(prompts: &[Vec<u32>]) -> Result<(usize, usize)> {
    let seq = prompts.first().map_or(0, |p| p.len());
    if prompts.is_empty() || seq == 0 {
        return Err(WgparError::NoPrompt);
    }
    if let Some(p) = prompts.iter().find(|p| p.len() != seq) {
        return Err(WgparError::UnequalPrompts {
            first: seq,
            other: p.len(),
        });
    }
    Ok((prompts.len(), seq))
}

/// Result and timings of a generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated tokens per sequence.
    pub tokens: Vec<Vec<u32>>,
    /// Logits of the steps asked for ([`KeepLogits`]), prefill first; empty by default, so
    /// memory does not grow with the number of steps.
    pub logits: Vec<Logits>,
    /// Prefill wall time, seconds.
    pub prefill_s: f64,
    /// Wall time of the decode run (every token after the first), seconds. Under an
    /// in-flight pipeline the micro-batches do not share step boundaries, so only the whole
    /// run has a wall time.
    pub decode_s: f64,
    /// Tokens decoded per sequence after the first.
    pub decode_steps: usize,
    /// Accounting of the decode run.
    pub decode_stats: StepStats,
    /// Prompt tokens processed.
    pub prompt_tokens: usize,
}

impl Generation {
    /// Prompt processing rate, tokens/s.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s
    }

    /// Generation rate over all sequences, tokens/s.
    pub fn decode_tokens_per_s(&self) -> f64 {
        (self.decode_steps * self.tokens.len()) as f64 / self.decode_s
    }

    /// Mean time between two tokens of one sequence, seconds.
    pub fn per_token_s(&self) -> f64 {
        self.decode_s / self.decode_steps.max(1) as f64
    }
}

/// Which steps' logits a generation keeps (tokens are always kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepLogits {
    /// None: only token ids are read back.
    #[default]
    None,
    /// The prefill's (to check a run against a reference).
    Prefill,
    /// Every step's (memory grows with the steps).
    All,
}

/// Prefills `prompts`, then decodes up to `steps` tokens per sequence in all (the first from
/// the prefill) with the engine's token pick (greedy unless [`Engine::set_sampling`] said
/// otherwise), through [`Engine::decode_greedy`] (in flight on a pipeline); keeps tokens only.
pub fn generate(engine: &mut dyn Engine, prompts: &[Vec<u32>], steps: usize) -> Result<Generation> {
    generate_keeping(engine, prompts, steps, KeepLogits::None)
}

/// [`generate`], also keeping the logits `keep` names.
pub fn generate_keeping(
    engine: &mut dyn Engine,
    prompts: &[Vec<u32>],
    steps: usize,
    keep: KeepLogits,
) -> Result<Generation> {
    let (batch, seq) = prompt_shape(prompts)?;
    let start = Instant::now();
    let first = engine.prefill_step(prompts, keep != KeepLogits::None)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let next = first.tokens;
    let decoded = engine.decode_greedy(&next, steps.max(1) - 1, keep == KeepLogits::All)?;
    let tokens = next
        .iter()
        .zip(&decoded.tokens)
        .map(|(&t, rest)| std::iter::once(t).chain(rest.iter().copied()).collect())
        .collect();
    let mut logits: Vec<Logits> = first.logits.into_iter().collect();
    logits.extend(decoded.logits);
    Ok(Generation {
        tokens,
        logits,
        prefill_s,
        decode_s: decoded.wall_s,
        decode_steps: steps.max(1) - 1,
        decode_stats: decoded.stats,
        prompt_tokens: batch * seq,
    })
}

/// CPU time the calling thread has used, seconds (`None` where the platform has no thread
/// CPU clock).
pub(crate) fn thread_cpu_s() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime only writes the timespec it is given, which lives here.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (r == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Keeps an engine's device timer for `gpu`'s compute spans in step with `recorder`: active
/// while it records, where the recorder's [`DeviceTiming`](crate::trace::DeviceTiming) allows
/// it and the adapter has `TIMESTAMP_QUERY`; remade only when that changes.
pub(crate) fn sync_span_timer(
    timer: &mut crate::device::SpanTimer,
    gpu: &crate::device::Gpu,
    recorder: &Recorder,
) {
    use crate::trace::DeviceTiming;
    let wanted = recorder.is_enabled()
        && match recorder.device_timing() {
            DeviceTiming::On => true,
            DeviceTiming::Off => false,
            DeviceTiming::Auto => !gpu.info().is_cpu(),
        };
    if timer.is_active() != wanted {
        *timer = crate::device::SpanTimer::new(gpu, wanted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_and_relative_error() {
        let l = Logits {
            batch: 2,
            vocab: 3,
            data: vec![0.1, 0.9, 0.3, 2.0, -1.0, 2.0],
        };
        assert_eq!(l.argmax(), vec![1, 0]);
        let mut r = l.data.clone();
        r[1] = 1.0;
        assert!((l.relative_error(&r) - 0.05).abs() < 1e-6);
        let nan = Logits {
            data: vec![f32::NAN; 6],
            ..l.clone()
        };
        assert!(nan.relative_error(&l.data).is_infinite());
    }
}
