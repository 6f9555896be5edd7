//! The single-device engine: the whole model on one `Gpu`.

use std::sync::Arc;
use std::time::Instant;

use super::{check_decode, cost, prompt_shape, Engine, Logits, StepStats};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::model::{Activations, GpuModel, KvCache, ModelWeights, Placement, Step};
use crate::trace::{KernelFamily, Recorder, SpanAttrs};

/// The whole model on one device, with its KV cache.
pub struct SingleEngine {
    model: GpuModel,
    act: Option<Activations>,
    kv: Option<KvCache>,
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
            kv: None,
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

    fn forward(&mut self, ids: &[u32], step: Step) -> Result<Logits> {
        let (Some(act), Some(kv)) = (&self.act, &self.kv) else {
            return Err(WgparError::InvalidCall("decode before prefill".into()));
        };
        let m = &self.model;
        m.write_ids(act, ids)?;
        m.write_seqs(act, kv, &step, &step.rows())?;
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
        self.recorder.record_with(start, end, || {
            SpanAttrs::compute("forward", dev)
                .flops(work.flops)
                .bytes(work.bytes)
                .family(KernelFamily::Matmul)
                .kernels(work.kernels)
                .device_us(device_us)
        });
        self.last = Some(StepStats {
            tokens: step.tokens(),
            wall_s: (end - start).as_secs_f64(),
            compute_s: (end - start).as_secs_f64(),
            ..Default::default()
        });
        self.past += step.seq;
        Ok(Logits {
            batch: step.batch,
            vocab,
            data,
        })
    }
}

impl Engine for SingleEngine {
    fn name(&self) -> String {
        format!("single on {}", self.model.gpu().describe())
    }

    fn prefill(&mut self, prompts: &[Vec<u32>]) -> Result<Logits> {
        let (batch, seq) = prompt_shape(prompts)?;
        let tokens = batch * seq;
        let fits = self
            .act
            .as_ref()
            .is_some_and(|a| self.batch == batch && a.capacity() >= tokens);
        if !fits {
            self.act = Some(self.model.activations(tokens, batch)?);
        }
        if self.kv.as_ref().map(|k| k.slots()) != Some(batch) {
            self.kv = Some(self.model.kv_cache(batch)?);
        }
        self.batch = batch;
        self.past = 0;
        let ids: Vec<u32> = prompts.concat();
        self.forward(
            &ids,
            Step {
                batch,
                seq,
                past: 0,
            },
        )
    }

    fn decode(&mut self, tokens: &[u32]) -> Result<Logits> {
        check_decode(self.batch, tokens)?;
        let step = Step {
            batch: self.batch,
            seq: 1,
            past: self.past,
        };
        self.forward(tokens, step)
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
