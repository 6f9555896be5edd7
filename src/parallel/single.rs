//! The single-device engine: the whole model on one `Gpu`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    check_decode, cost, prompt_shape, BatchStep, Engine, Logits, SeqRow, StepDone, StepEngine,
    StepStats,
};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
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
    last: Option<StepStats>,
    recorder: Recorder,
    /// Device-side timing of the forward span while a trace is recorded.
    timer: SpanTimer,
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

    /// One forward step of `rows`; its span waits for `deps` and starts no earlier than
    /// `release_us`. Returns the logits and the span.
    fn forward(
        &mut self,
        ids: &[u32],
        step: Step,
        rows: &[SeqRow],
        (deps, release_us): (&[SpanId], Option<f64>),
    ) -> Result<(Logits, SpanId)> {
        let (Some(act), Some(kv)) = (&self.act, &self.kv) else {
            return Err(WgparError::InvalidCall("decode before prefill".into()));
        };
        let m = &self.model;
        m.write_ids(act, ids)?;
        m.write_seqs(act, kv, &step, rows)?;
        let start = Instant::now();
        let mut enc = m.gpu().encoder();
        self.timer.begin(&mut enc);
        m.embed(&mut enc, act, &step)?;
        m.layers(&mut enc, act, kv, &step)?;
        m.head(&mut enc, act, &step)?;
        self.timer.end(&mut enc);
        m.gpu().submit(enc);
        let logits = act
            .logits
            .as_ref()
            .ok_or_else(|| WgparError::Internal("no logits buffer".into()))?;
        let vocab = m.config().vocab;
        let mut data = m.gpu().read_f32(logits)?;
        data.truncate(step.batch * vocab);
        let end = Instant::now();
        let device_us = self.timer.read_us(m.gpu())?;
        let c = m.config();
        let placement = m.placement();
        let work = cost::total(
            c,
            &placement.shard,
            m.num_layers(),
            &step,
            m.weight_dtype(),
            true,
            true,
        );
        let dev = m.gpu().ordinal() as u32;
        // One span: the whole step is one submit, with no point where the host could time a
        // layer without adding a synchronisation the single-device path does not need.
        let span = self.recorder.record_with(start, end, || {
            let a = SpanAttrs::compute("forward", dev)
                .flops(work.flops)
                .bytes(work.bytes)
                .family(KernelFamily::Matmul)
                .kernels(work.kernels)
                .device_us(device_us)
                .after_all(deps);
            match release_us {
                Some(us) => a.not_before_us(us),
                None => a,
            }
        });
        self.last = Some(StepStats {
            tokens: step.tokens(),
            wall_s: (end - start).as_secs_f64(),
            compute_s: (end - start).as_secs_f64(),
            ..Default::default()
        });
        self.past += step.seq;
        Ok((
            Logits {
                batch: step.batch,
                vocab,
                data,
            },
            span,
        ))
    }
}

impl Engine for SingleEngine {
    fn name(&self) -> String {
        format!("single on {}", self.model.gpu().describe())
    }

    fn prefill(&mut self, prompts: &[Vec<u32>]) -> Result<Logits> {
        let (batch, seq) = prompt_shape(prompts)?;
        self.reserve_activations(batch * seq, batch)?;
        if self.kv.as_ref().map(|k| k.slots()) != Some(batch) {
            self.kv = Some(self.model.kv_cache(batch)?);
        }
        self.batch = batch;
        self.past = 0;
        let ids: Vec<u32> = prompts.concat();
        let step = Step {
            batch,
            seq,
            past: 0,
        };
        Ok(self.forward(&ids, step, &step.rows(), (&[], None))?.0)
    }

    fn decode(&mut self, tokens: &[u32]) -> Result<Logits> {
        check_decode(self.batch, tokens)?;
        let step = Step {
            batch: self.batch,
            seq: 1,
            past: self.past,
        };
        Ok(self.forward(tokens, step, &step.rows(), (&[], None))?.0)
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

    /// Runs the step at once; [`complete`](StepEngine::complete) hands it back.
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        let shape = Step {
            batch: step.rows.len(),
            seq: step.seq,
            past: 0,
        };
        self.reserve_activations(shape.tokens(), shape.batch)?;
        let (logits, span) =
            self.forward(&step.ids, shape, &step.rows, (&step.deps, step.release_us))?;
        self.done.push_back(StepDone {
            lane: step.lane,
            logits,
            span,
        });
        Ok(())
    }

    fn complete(&mut self, _timeout: Option<Duration>) -> Result<Option<StepDone>> {
        Ok(self.done.pop_front())
    }
}
