//! Tensor parallelism (Megatron pairing): every device holds a shard of every layer and runs it
//! in its own thread; after the attention output and the MLP down projection, whose results
//! are partial sums, a host-staged all-reduce sums them. Those two all-reduces per layer are the
//! only synchronisation between devices.
//!
//! Embedding and LM head are replicated (each device holds the full tables): the embedding is
//! a lookup every rank needs anyway, and a vocab-parallel head would add an all-gather of
//! `batch x vocab` logits per step to save `vocab x hidden` weights per device. Only rank 0
//! computes the head; the other ranks skip it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::encoder::{pad_batch, Embeddings, Encoder};
use super::pick::{check_finite, count_non_finite, Picker};
use super::{
    check_decode, prompt_shape, Engine, Fault, KvEdits, Logits, StepDone, StepOutput, StepStats,
};
use crate::comm::{CommConfig, Communicator, CrossProcessGroup};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::sampling::SamplingParams;
use crate::model::{EncoderInput, ModelConfig, ModelWeights, SeqRow, ShardSpec, Step, StepOut};
use crate::sim::LinkPacer;
use crate::trace::{Recorder, SpanId};

mod collective;
mod compute;
mod group;
mod handoff;
mod pass;
mod rank;
mod serve;

pub(crate) use group::{
    EncoderExtras, GroupInput, GroupJob, GroupOutput, GroupPart, Readout, TpGroup,
};
use pass::RankOutput;

/// How a step uses the KV cache and the timeline, beyond its shape.
#[derive(Default)]
struct StepPlan {
    /// Make a fresh KV cache of this many slots first.
    new_cache: Option<usize>,
    /// The sequence table (`None`: the plain batch).
    rows: Option<Arc<Vec<SeqRow>>>,
    /// What the step waits for (`None`: the previous step's logits).
    deps: Option<Vec<SpanId>>,
    /// Earliest start, microseconds since the recorder's epoch.
    release_us: Option<f64>,
    /// Encoder inputs.
    encoder: Option<Arc<EncoderExtras>>,
    /// The head's token pick and readback.
    readout: Readout,
    /// Block tables and copies of cached KV between slots before the step.
    kv_edits: KvEdits,
}

/// The model sharded over several devices, one worker thread per device.
pub struct TensorParallelEngine {
    group: TpGroup,
    pacer: Option<Arc<LinkPacer>>,
    /// Rank 0's last span of the previous step: the next step starts after the logits are back.
    last_span: SpanId,
    config: ModelConfig,
    batch: usize,
    past: usize,
    /// Steps since the prefill (the prefill is step 0).
    steps: usize,
    picker: Picker,
    last: Option<StepStats>,
    failed: Option<String>,
    recorder: Recorder,
    /// Continuous batching: slots reserved, and whether the next step makes the cache.
    serve_slots: usize,
    serve_fresh: bool,
    /// Finished continuous-batching steps not yet collected.
    done: VecDeque<StepDone>,
}

impl TensorParallelEngine {
    /// Shards `weights` over `gpus` with relative shares `split` (`None`: even), stored as
    /// `dtype`. Errors list the valid degrees when the heads do not divide.
    pub fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let config = weights.config.clone();
        let part = GroupPart::whole(&config);
        let group = TpGroup::new(gpus, weights, dtype, split, part, comm_config)?;
        Ok(Self::with_group(group, config))
    }

    /// Tensor parallelism across processes: this process holds one shard on `gpu`, its peers
    /// the others (`remote`, e.g. MPI ranks); every process gets the logits.
    pub fn spanning(
        gpu: &Arc<Gpu>,
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        comm_config: CommConfig,
        remote: Arc<dyn CrossProcessGroup>,
    ) -> Result<Self> {
        let group = TpGroup::spanning(gpu, weights, dtype, split, comm_config, remote)?;
        Ok(Self::with_group(group, weights.config.clone()))
    }

    fn with_group(group: TpGroup, config: ModelConfig) -> Self {
        Self {
            group,
            pacer: None,
            last_span: SpanId::NONE,
            config,
            batch: 0,
            past: 0,
            steps: 0,
            picker: Picker::greedy(),
            last: None,
            failed: None,
            recorder: Recorder::disabled(),
            serve_slots: 0,
            serve_fresh: false,
            done: VecDeque::new(),
        }
    }

    /// Each rank's shard.
    pub fn shards(&self) -> &[ShardSpec] {
        self.group.shards()
    }

    /// The communicator (its stats log has every all-reduce).
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.group.comm
    }

    /// Whether tokens are picked on the host from read-back logits: where the device cannot
    /// pick this way, or where the group spans processes (every process then gets the
    /// logits and picks alike).
    fn host_picks(&self) -> bool {
        self.picker.needs_logits() || self.group.remote.is_some()
    }

    /// The readout of a step of `batch` sequences.
    fn readout(&mut self, batch: usize, want_logits: bool) -> Readout {
        Readout {
            pick: self.picker.device_or_greedy(),
            draws: Arc::new(self.picker.draws(batch)),
            logits: want_logits || self.host_picks(),
            allow: Arc::default(),
            adjust: Arc::default(),
        }
    }

    /// A step's tokens (and logits when asked) from the head's picks: refused when the
    /// logits were not finite, picked here where the host picks.
    fn tokens_of(&mut self, out: StepOut, batch: usize, want_logits: bool) -> Result<StepOutput> {
        let logits = out.logits.map(|data| Logits {
            batch,
            vocab: self.config.vocab,
            data,
        });
        let tokens = match (&logits, self.host_picks()) {
            (Some(l), true) => {
                check_finite(self.steps, &count_non_finite(l), None)?;
                self.picker.host(l)
            }
            (None, true) => return Err(no_output()),
            (_, false) => {
                check_finite(self.steps, &out.non_finite, None)?;
                out.tokens
            }
        };
        Ok(StepOutput {
            tokens,
            logits: logits.filter(|_| want_logits),
        })
    }

    fn step(
        &mut self,
        ids: Vec<u32>,
        step: Step,
        new_cache: bool,
        want_logits: bool,
    ) -> Result<StepOutput> {
        let plan = StepPlan {
            new_cache: new_cache.then_some(step.batch),
            readout: self.readout(step.batch, want_logits),
            ..StepPlan::default()
        };
        let out = match self.run(ids, step, plan)? {
            GroupOutput::Picked(out) => out,
            _ => return Err(no_output()),
        };
        let out = self.tokens_of(out, step.batch, want_logits)?;
        self.steps += 1;
        Ok(out)
    }

    /// One step on every rank; returns rank 0's final output (picks or pooled embeddings).
    fn run(&mut self, ids: Vec<u32>, step: Step, plan: StepPlan) -> Result<GroupOutput> {
        if let Some(why) = &self.failed {
            return Err(WgparError::EngineStopped {
                engine: "tensor-parallel engine".into(),
                cause: why.clone(),
            });
        }
        let start = Instant::now();
        let encoder = plan.encoder.is_some();
        let job = self.job(ids, step, plan);
        let outputs = match self.group.run(job) {
            Ok(o) => o,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        };
        let wall_s = start.elapsed().as_secs_f64();
        self.last = Some(step_stats(step.tokens(), wall_s, &outputs));
        self.past = step.past + step.seq;
        self.last_span = outputs[0].last_span;
        let output = outputs.into_iter().find_map(|o| o.output);
        match &self.group.remote {
            Some(remote) => share_output(remote.as_ref(), output, encoder),
            None => output.ok_or_else(no_output),
        }
    }

    /// The job every rank runs for `step` of `ids` as `plan` says.
    fn job(&self, ids: Vec<u32>, step: Step, plan: StepPlan) -> GroupJob {
        let new_cache = plan.new_cache.is_some();
        GroupJob {
            group: 0,
            input: GroupInput::Ids(Arc::new(ids)),
            step,
            new_cache,
            release: false,
            recorder: self.recorder.clone(),
            microbatch: None,
            deps: plan.deps.unwrap_or_else(|| {
                if new_cache {
                    Vec::new()
                } else {
                    vec![self.last_span]
                }
            }),
            release_us: plan.release_us,
            rows: plan.rows,
            slots: plan.new_cache,
            encoder: plan.encoder,
            pacer: self.pacer.clone(),
            readout: plan.readout,
            kv_edits: Arc::new(plan.kv_edits),
        }
    }
}

/// A step's statistics from every rank's output: means over the ranks, rank 0's collectives.
fn step_stats(tokens: usize, wall_s: f64, outputs: &[RankOutput]) -> StepStats {
    let n = outputs.len() as f64;
    StepStats {
        tokens,
        wall_s,
        compute_s: outputs.iter().map(|o| o.compute_s).sum::<f64>() / n,
        comm_s: outputs.iter().map(|o| o.comm_s).sum::<f64>() / n,
        collectives: outputs[0].collectives,
        bytes_sent: outputs[0].bytes,
        bytes_received: outputs[0].bytes,
        encode_s: Some(outputs.iter().map(|o| o.encode_s).sum::<f64>() / n),
        encode_cpu_s: (outputs.iter().map(|o| o.encode_cpu_s))
            .sum::<Option<f64>>()
            .map(|s| s / n),
    }
}

/// The step's output in every process of a group that spans processes. Only floats travel:
/// the logits (the readout asked for them) or the pooled embeddings; every process then
/// picks from the logits.
fn share_output(
    remote: &dyn CrossProcessGroup,
    output: Option<GroupOutput>,
    encoder: bool,
) -> Result<GroupOutput> {
    let shared = output.map(|o| match o {
        GroupOutput::Picked(p) => p.logits.unwrap_or_default(),
        GroupOutput::Pooled(p) => p,
        GroupOutput::Hidden(_) => Vec::new(),
    });
    let data = remote.share_output(shared)?;
    Ok(if encoder {
        GroupOutput::Pooled(data)
    } else {
        GroupOutput::Picked(StepOut {
            tokens: Vec::new(),
            non_finite: Vec::new(),
            logits: Some(data),
        })
    })
}

/// Rank 0 returns every step's output; none means a rank thread broke its contract.
fn no_output() -> WgparError {
    WgparError::Internal("no rank returned the step's output".into())
}

impl Encoder for TensorParallelEngine {
    fn name(&self) -> String {
        Engine::name(self)
    }

    fn encode(&mut self, inputs: &[EncoderInput]) -> Result<Embeddings> {
        let seq = EncoderInput::check_batch(inputs, &self.config)?;
        let (ids, types, lens) = pad_batch(inputs, seq);
        let step = Step {
            batch: inputs.len(),
            seq,
            past: 0,
        };
        let extras = Arc::new(EncoderExtras { types, lens });
        let plan = StepPlan {
            new_cache: Some(step.batch),
            encoder: Some(extras),
            ..StepPlan::default()
        };
        let data = match self.run(ids, step, plan)? {
            GroupOutput::Pooled(data) => data,
            _ => return Err(no_output()),
        };
        Ok(Embeddings {
            batch: inputs.len(),
            dim: self.config.hidden,
            data,
        })
    }
}

impl Engine for TensorParallelEngine {
    fn name(&self) -> String {
        let shares: Vec<usize> = self.shards().iter().map(|s| s.local_heads()).collect();
        if let Some(remote) = &self.group.remote {
            return format!(
                "tp={} across {} processes (this one: rank {}, {} query heads on {})",
                remote.size(),
                remote.size(),
                remote.rank(),
                shares.iter().sum::<usize>(),
                self.group.labels().join(",")
            );
        }
        format!(
            "tp={} on {} (query heads {:?})",
            shares.len(),
            self.group.labels().join(","),
            shares
        )
    }

    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput> {
        let (batch, seq) = prompt_shape(prompts)?;
        self.batch = batch;
        self.steps = 0;
        let mut out = None;
        // Sliding layers' rings take a long prompt in chunks; the first makes the cache.
        for chunk in super::prefill_chunks(&self.config, seq) {
            let step = Step {
                batch,
                seq: chunk.1,
                past: chunk.0,
            };
            let ids = super::chunk_ids(prompts, chunk);
            out = Some(self.step(ids, step, chunk.0 == 0, logits)?);
        }
        out.ok_or(WgparError::NoPrompt)
    }

    fn decode_step(&mut self, tokens: &[u32], logits: bool) -> Result<StepOutput> {
        check_decode(self.batch, tokens)?;
        let step = Step {
            batch: self.batch,
            seq: 1,
            past: self.past,
        };
        self.step(tokens.to_vec(), step, false, logits)
    }

    fn set_sampling(&mut self, params: SamplingParams) -> Result<()> {
        self.picker = Picker::new(params)?;
        Ok(())
    }

    fn last_step(&self) -> Option<StepStats> {
        self.last.clone()
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        for (i, label) in self.group.labels().iter().enumerate() {
            recorder.label_device(i as u32, label.clone());
        }
        // Span ids belong to one recorder: never carry a dependency into another.
        self.last_span = SpanId::NONE;
        self.recorder = recorder;
    }

    fn set_pacer(&mut self, pacer: Option<Arc<LinkPacer>>) {
        self.pacer = pacer;
    }

    fn inject_fault(&mut self, rank: usize, fault: Fault) -> Result<()> {
        self.group.inject_fault(rank, fault)
    }
}
