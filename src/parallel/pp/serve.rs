//! Continuous batching on a pipeline ([`StepEngine`]): one serving KV cache on every stage,
//! one lane per micro-batch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::RecvTimeoutError;

use super::driver::unexpected_output;
use super::handoff::Payload;
use super::{PipelineEngine, PipelineStats, Readout};
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, Step};
use crate::parallel::pick::check_finite;
use crate::parallel::{BatchStep, KvEdits, StepDone, StepEngine};

/// The continuous-batching state of a pipeline: one KV cache of `slots` on every stage,
/// shared by the lanes (the micro-batches in flight).
#[derive(Debug, Default)]
pub(super) struct Serving {
    slots: usize,
    /// The next pass makes the cache on every stage.
    fresh: bool,
    /// Lanes with a pass in flight.
    busy: Vec<bool>,
    /// Passes per lane so far.
    passes: Vec<usize>,
    /// New tokens processed so far.
    tokens: usize,
    started: Option<Instant>,
    last_output: Option<Instant>,
}

/// The key of the serving KV cache on every stage (micro-batch caches use their index).
const SERVING_CACHE: usize = usize::MAX;

impl StepEngine for PipelineEngine {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// One lane per micro-batch.
    fn lanes(&self) -> usize {
        self.micro_batches
    }

    /// The stages make their caches with the next pass; the accounting starts over.
    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        self.check_alive()?;
        if slots == 0 {
            return Err(WgparError::TooFew {
                what: "KV cache slots".into(),
                got: 0,
                min: 1,
            });
        }
        self.reset_stats();
        self.serving = Serving {
            slots,
            fresh: true,
            busy: vec![false; self.micro_batches],
            passes: vec![0; self.micro_batches],
            ..Serving::default()
        };
        // The plain batch lived in the micro-batch caches.
        self.batch = 0;
        Ok(())
    }

    fn slots(&self) -> usize {
        self.serving.slots
    }

    fn masks_on_device(&self) -> bool {
        !self.remote_head
    }

    fn submit(&mut self, step: BatchStep) -> Result<()> {
        self.check_alive()?;
        let lanes = self.serving.busy.len();
        if self.serving.slots == 0 {
            return Err(WgparError::TooFew {
                what: "KV slots reserved (call reserve_slots before submit)".into(),
                got: 0,
                min: 1,
            });
        }
        if step.lane >= lanes {
            return Err(WgparError::OutOfRange {
                what: "serving lane".into(),
                index: step.lane,
                count: lanes,
            });
        }
        if self.serving.busy[step.lane] {
            // The scheduler submits to a lane only after it completed that lane's last step.
            return Err(WgparError::Internal(format!(
                "lane {} of {lanes} submitted while busy",
                step.lane
            )));
        }
        crate::parallel::check_kv_edits(&step, self.serving.slots, &self.config)?;
        let shape = Step {
            batch: step.rows.len(),
            seq: step.seq,
            past: 0,
        };
        let new_cache = std::mem::take(&mut self.serving.fresh);
        let mut w = self.work(step.lane, step.ids, shape, (new_cache, false), step.deps);
        w.cache = SERVING_CACHE;
        w.rows = Some(Arc::new(step.rows));
        w.slots = Some(self.serving.slots);
        w.release_us = step.release_us;
        w.kv_edits = Arc::new(KvEdits::of(step.kv_tables, step.kv_copies));
        // The device picks greedily; logits come back only for a caller that samples.
        w.readout = Readout {
            logits: step.logits,
            allow: Arc::new(step.allow.unwrap_or_default()),
            adjust: Arc::new(step.adjust.unwrap_or_default()),
            ..Readout::default()
        };
        self.serving.started.get_or_insert_with(Instant::now);
        self.serving.busy[step.lane] = true;
        self.serving.tokens += shape.tokens();
        self.send(w)
    }

    fn complete(&mut self, timeout: Option<Duration>) -> Result<Option<StepDone>> {
        let out = match timeout {
            None => self.receive()?,
            Some(t) => match self.output.recv_timeout(t.min(self.timeout)) {
                Ok(Ok(out)) => out,
                Err(RecvTimeoutError::Timeout) if t < self.timeout => return Ok(None),
                // A failure, a stop or a real stall: `receive` reports it.
                Ok(Err(e)) => {
                    self.failed = Some(e.to_string());
                    self.input = None;
                    return Err(e);
                }
                Err(_) => self.receive()?,
            },
        };
        let lane = out.group;
        let s = &mut self.serving;
        if let Some(b) = s.busy.get_mut(lane) {
            *b = false;
        }
        if let Some(p) = s.passes.get_mut(lane) {
            *p += 1;
        }
        s.last_output = Some(Instant::now());
        let Payload::Picked(picked) = out.payload else {
            return Err(unexpected_output());
        };
        check_finite(
            s.passes.get(lane).copied().unwrap_or(0),
            &picked.non_finite,
            None,
        )?;
        let mut tokens = picked.tokens;
        tokens.truncate(out.batch);
        let vocab = self.model_config().vocab;
        Ok(Some(StepDone {
            lane,
            tokens,
            logits: crate::parallel::batch::row_logits(picked.logits, out.batch, vocab)?,
            span: out.dep,
        }))
    }

    fn serving_stats(&self) -> Option<PipelineStats> {
        let s = &self.serving;
        let makespan = match (s.started, s.last_output) {
            (Some(a), Some(b)) => (b - a).as_secs_f64(),
            _ => 0.0,
        };
        let chain = s.passes.iter().copied().max().unwrap_or(0);
        let lanes = s.passes.iter().filter(|&&p| p > 0).count();
        Some(self.run_stats(makespan, s.tokens, lanes, chain).1)
    }
}
