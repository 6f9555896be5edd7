//! The single-device engine: the whole model on one `Gpu`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pick::{check_finite, count_non_finite, Picker};
use super::{
    check_decode, cost, prompt_shape, BatchStep, Engine, KvEdits, Logits, SeqRow, StepDone,
    StepEngine, StepOutput, StepStats,
};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::kernels::ops::TokenPick;
use crate::model::sampling::SamplingParams;
use crate::model::{Activations, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, Step};
use crate::trace::{KernelFamily, Recorder, SpanAttrs, SpanId};

/// The whole model on one device, with its KV cache.
pub struct SingleEngine {
    model: GpuModel,
    act: Option<Activations>,
    /// Sequences `act` has room for.
    act_batch: usize,
    kv: Option<KvCache>,
    /// Finished continuous-batching steps not yet collected (one at most: steps run at once).
    done: VecDeque<StepDone>,
    batch: usize,
    past: usize,
    /// Steps since the prefill (the prefill is step 0).
    steps: usize,
    picker: Picker,
    last: Option<StepStats>,
    recorder: Recorder,
    /// Device-side timing of the forward span while a trace is recorded.
    timer: SpanTimer,
}

/// Who picks a step's next tokens.
#[derive(Debug, Clone)]
enum StepPick {
    /// The engine's sampler (greedy unless [`Engine::set_sampling`] said otherwise), with the
    /// logits read back when asked for.
    Engine { logits: bool },
    /// Greedy on the device, and the logits read back only when asked for: the serving
    /// loop's steps, each row kept to its bits of `allow` and its logits changed by
    /// `adjust` (packed bias and penalties) when given.
    Greedy {
        logits: bool,
        allow: Option<Vec<u32>>,
        adjust: Option<Vec<u32>>,
    },
}

impl SingleEngine {
    /// Uploads `weights` to `gpu`, stored as `dtype`.
    pub fn new(gpu: Arc<Gpu>, weights: &ModelWeights, dtype: DType) -> Result<Self> {
        let placement = Placement::whole(&weights.config);
        Ok(Self {
            model: GpuModel::upload(gpu, weights, placement, dtype)?,
            act: None,
            act_batch: 0,
            kv: None,
            done: VecDeque::new(),
            batch: 0,
            past: 0,
            steps: 0,
            picker: Picker::greedy(),
            last: None,
            recorder: Recorder::disabled(),
            timer: SpanTimer::default(),
        })
    }

    /// The model on the device.
    pub fn model(&self) -> &GpuModel {
        &self.model
    }

    /// Makes sure the activations hold `tokens` tokens of `batch` sequences.
    fn reserve_activations(&mut self, tokens: usize, batch: usize) -> Result<()> {
        let fits = self
            .act
            .as_ref()
            .is_some_and(|a| self.act_batch >= batch && a.capacity() >= tokens);
        if !fits {
            let tokens = tokens.max(self.act.as_ref().map_or(0, Activations::capacity));
            let batch = batch.max(self.act_batch);
            self.act = Some(self.model.activations(tokens, batch)?);
            self.act_batch = batch;
        }
        Ok(())
    }

    /// One forward step of `rows`, after `edits` of the KV cache (tables, copies); its span waits
    /// for `deps` and starts no earlier than `release_us`. Returns the step's tokens (and logits when `want_logits`) and the span.
    fn forward(
        &mut self,
        ids: &[u32],
        step: Step,
        rows: &[SeqRow],
        (deps, release_us, edits): (&[SpanId], Option<f64>, &KvEdits),
        pick: StepPick,
    ) -> Result<(StepOutput, SpanId)> {
        let (Some(act), Some(kv)) = (&mut self.act, &mut self.kv) else {
            return Err(WgparError::DecodeBeforePrefill);
        };
        let m = &self.model;
        let gpu = m.gpu();
        let start = Instant::now();
        let cpu_start = super::thread_cpu_s();
        let readout = Readout::of(&mut self.picker, pick, step.batch);
        act.set_readout(readout.device_pick, readout.read_logits);
        if let Some(allow) = &readout.allow {
            // Before `begin_step`, which configures the pick as masked.
            m.write_allow(act, allow)?;
        }
        if let Some(adjust) = &readout.adjust {
            m.write_adjust(act, adjust)?;
        }
        m.write_ids(act, ids)?;
        m.begin_step(act, kv, &step, rows)?;
        if !readout.draws.is_empty() {
            m.write_draws(act, &readout.draws)?;
        }
        submit_forward(m, &self.timer, act, (kv, edits))?;
        let encode_s = start.elapsed().as_secs_f64();
        let encode_cpu_s = super::thread_cpu_s().zip(cpu_start).map(|(b, a)| b - a);
        let out = m.read_out(act)?;
        let end = Instant::now();
        let device_us = self.timer.read_us(gpu)?;
        let timing = SpanTiming {
            start,
            end,
            device_us,
            deps,
            release_us,
        };
        let span = record_forward(&self.recorder, m, &step, timing);
        self.last = Some(StepStats {
            tokens: step.tokens(),
            wall_s: (end - start).as_secs_f64(),
            compute_s: (end - start).as_secs_f64(),
            encode_s: Some(encode_s),
            encode_cpu_s,
            ..Default::default()
        });
        let logits = out.logits.map(|data| Logits {
            batch: step.batch,
            vocab: m.config().vocab,
            data,
        });
        if out.non_finite.iter().any(|&n| n > 0) {
            // The error path only: find the first layer whose output is not finite.
            let location = m
                .locate_non_finite(act, kv)?
                .map(|l| format!("{l} on {}", gpu.describe()));
            check_finite(self.steps, &out.non_finite, location)?;
        }
        let tokens = match (&logits, readout.host_picks) {
            (Some(l), true) => {
                check_finite(self.steps, &count_non_finite(l), None)?;
                self.picker.host(l)
            }
            _ => out.tokens,
        };
        self.past += step.seq;
        self.steps += 1;
        Ok((
            StepOutput {
                tokens,
                logits: logits.filter(|_| readout.want_logits),
            },
            span,
        ))
    }
}

/// How a step's tokens come back: picked on the device (which pick) or on the host from the
/// logits, and whether the logits are read back and handed to the caller.
struct Readout {
    device_pick: TokenPick,
    read_logits: bool,
    host_picks: bool,
    /// The sampler's random draws for a device-side pick (empty for greedy).
    draws: Vec<f32>,
    want_logits: bool,
    /// Each row's bit set of the tokens the device may pick.
    allow: Option<Vec<u32>>,
    /// The rows' packed logit adjustments (bias and penalties).
    adjust: Option<Vec<u32>>,
}

impl Readout {
    fn of(picker: &mut Picker, pick: StepPick, batch: usize) -> Self {
        match pick {
            StepPick::Engine { logits } => Self {
                device_pick: picker.device_or_greedy(),
                read_logits: logits || picker.needs_logits(),
                host_picks: picker.needs_logits(),
                draws: picker.draws(batch),
                want_logits: logits,
                allow: None,
                adjust: None,
            },
            StepPick::Greedy {
                logits,
                allow,
                adjust,
            } => Self {
                device_pick: TokenPick::Greedy,
                read_logits: logits,
                host_picks: false,
                draws: Vec::new(),
                want_logits: logits,
                allow,
                adjust,
            },
        }
    }
}

/// Records the whole forward pass (timed on the device while a trace is recorded) and the
/// copy of its output in one submit.
fn submit_forward(
    m: &GpuModel,
    timer: &SpanTimer,
    act: &Activations,
    (kv, edits): (&mut KvCache, &KvEdits),
) -> Result<()> {
    let gpu = m.gpu();
    let mut enc = gpu.encoder();
    // In the step's own submission: after every earlier step, before this one's layers.
    kv.apply_edits(gpu, &mut enc, edits.parts())?;
    timer.begin(&mut enc);
    m.embed(&mut enc, act)?;
    m.layers(&mut enc, act, kv)?;
    m.head(&mut enc, act)?;
    timer.end(&mut enc);
    m.copy_out(&mut enc, act)?;
    gpu.submit(enc);
    Ok(())
}

/// When a step ran (host and device time) and what its span waits for.
struct SpanTiming<'a> {
    start: Instant,
    end: Instant,
    device_us: Option<f64>,
    deps: &'a [SpanId],
    release_us: Option<f64>,
}

/// Records the step as one span: the whole step is one submit, with no point where the host
/// could time a layer without adding a synchronisation the single-device path does not need.
fn record_forward(recorder: &Recorder, m: &GpuModel, step: &Step, t: SpanTiming<'_>) -> SpanId {
    let c = m.config();
    let work = cost::total(
        c,
        &m.placement().shard,
        m.placement().layers.clone(),
        step,
        m.weight_dtype(),
        true,
        true,
    );
    let dev = m.gpu().ordinal() as u32;
    recorder.record_with(t.start, t.end, || {
        let a = SpanAttrs::compute("forward", dev)
            .flops(work.flops)
            .bytes(work.bytes)
            .family(KernelFamily::Matmul)
            .kernels(work.kernels)
            .blocks_of(c.hidden, m.placement().shard.world)
            .head_part(cost::head_work(c, step.batch, m.weight_dtype()))
            .device_us(t.device_us)
            .after_all(t.deps);
        match t.release_us {
            Some(us) => a.not_before_us(us),
            None => a,
        }
    })
}

impl Engine for SingleEngine {
    fn name(&self) -> String {
        format!("single on {}", self.model.gpu().describe())
    }

    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput> {
        let (batch, seq) = prompt_shape(prompts)?;
        self.reserve_activations(batch * seq, batch)?;
        if self.kv.as_ref().map(|k| k.slots()) != Some(batch) {
            self.kv = Some(self.model.kv_cache(batch)?);
        }
        self.batch = batch;
        self.past = 0;
        self.steps = 0;
        let mut out = None;
        // Sliding layers' rings take a long prompt in chunks; the last one's pick counts.
        for chunk in super::prefill_chunks(self.model.config(), seq) {
            let ids = super::chunk_ids(prompts, chunk);
            let step = Step {
                batch,
                seq: chunk.1,
                past: chunk.0,
            };
            let edits = (&[][..], None, &KvEdits::default());
            let pick = StepPick::Engine { logits };
            out = Some(self.forward(&ids, step, &step.rows(), edits, pick)?.0);
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
        Ok(self
            .forward(
                tokens,
                step,
                &step.rows(),
                (&[], None, &KvEdits::default()),
                StepPick::Engine { logits },
            )?
            .0)
    }

    fn set_sampling(&mut self, params: SamplingParams) -> Result<()> {
        self.picker = Picker::new(params)?;
        Ok(())
    }

    fn last_step(&self) -> Option<StepStats> {
        self.last.clone()
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        recorder.label_device(
            self.model.gpu().ordinal() as u32,
            self.model.gpu().describe(),
        );
        super::sync_span_timer(&mut self.timer, self.model.gpu(), &recorder);
        self.recorder = recorder;
    }
}

impl StepEngine for SingleEngine {
    fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn lanes(&self) -> usize {
        1
    }

    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        self.kv = Some(self.model.kv_cache(slots)?);
        // The plain batch (prefill/decode) lived in the old cache.
        self.batch = 0;
        self.done.clear();
        Ok(())
    }

    fn slots(&self) -> usize {
        self.kv.as_ref().map_or(0, KvCache::slots)
    }

    fn masks_on_device(&self) -> bool {
        true
    }

    /// Runs the step at once; [`complete`](StepEngine::complete) hands it back.
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        super::check_kv_edits(&step, self.slots(), self.model.config())?;
        let shape = Step {
            batch: step.rows.len(),
            seq: step.seq,
            past: 0,
        };
        self.reserve_activations(shape.tokens(), shape.batch)?;
        let edits = KvEdits::of(step.kv_tables, step.kv_copies);
        // The device picks greedily; logits come back only for a caller that samples.
        let (out, span) = self.forward(
            &step.ids,
            shape,
            &step.rows,
            (&step.deps, step.release_us, &edits),
            StepPick::Greedy {
                logits: step.logits,
                allow: step.allow,
                adjust: step.adjust,
            },
        )?;
        // Logits with a non-finite value were refused by the device's counts in `forward`.
        self.done.push_back(StepDone {
            lane: step.lane,
            tokens: out.tokens,
            logits: out.logits,
            span,
        });
        Ok(())
    }

    fn complete(&mut self, _timeout: Option<Duration>) -> Result<Option<StepDone>> {
        Ok(self.done.pop_front())
    }
}
