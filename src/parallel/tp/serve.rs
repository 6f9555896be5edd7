//! Continuous batching on a tensor-parallel group ([`StepEngine`]): every step runs at once
//! on every rank.

use std::sync::Arc;
use std::time::Duration;

use super::{no_output, GroupOutput, Readout, StepPlan, TensorParallelEngine};
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, Step};
use crate::parallel::batch::row_logits;
use crate::parallel::pick::check_finite;
use crate::parallel::{BatchStep, KvEdits, StepDone, StepEngine};

impl StepEngine for TensorParallelEngine {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn lanes(&self) -> usize {
        1
    }

    /// The ranks make their caches with the next step.
    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        if slots == 0 {
            return Err(WgparError::TooFew {
                what: "KV cache slots".into(),
                got: 0,
                min: 1,
            });
        }
        self.serve_slots = slots;
        self.serve_fresh = true;
        // The plain batch (prefill/decode) lived in the old cache.
        self.batch = 0;
        self.done.clear();
        Ok(())
    }

    fn slots(&self) -> usize {
        self.serve_slots
    }

    fn masks_on_device(&self) -> bool {
        self.group.remote.is_none()
    }

    /// Runs the step at once on every rank; [`complete`](StepEngine::complete) hands it back.
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        if self.serve_slots == 0 {
            return Err(WgparError::TooFew {
                what: "KV slots reserved (call reserve_slots before submit)".into(),
                got: 0,
                min: 1,
            });
        }
        let config = &self.config;
        crate::parallel::check_kv_edits(&step, self.serve_slots, config)?;
        let shape = Step {
            batch: step.rows.len(),
            seq: step.seq,
            past: 0,
        };
        let plan = StepPlan {
            new_cache: std::mem::take(&mut self.serve_fresh).then_some(self.serve_slots),
            rows: Some(Arc::new(step.rows)),
            deps: Some(step.deps),
            release_us: step.release_us,
            encoder: None,
            // The device picks greedily; logits come back only for a caller that samples.
            readout: Readout {
                logits: step.logits,
                allow: Arc::new(step.allow.unwrap_or_default()),
                adjust: Arc::new(step.adjust.unwrap_or_default()),
                ..Readout::default()
            },
            kv_edits: KvEdits::of(step.kv_tables, step.kv_copies),
        };
        let out = match self.run(step.ids, shape, plan)? {
            GroupOutput::Picked(out) => {
                if self.group.remote.is_none() {
                    check_finite(self.steps, &out.non_finite, None)?;
                }
                out
            }
            _ => return Err(no_output()),
        };
        let vocab = self.model_config().vocab;
        self.done.push_back(StepDone {
            lane: step.lane,
            tokens: out.tokens,
            logits: row_logits(out.logits, shape.batch, vocab)?,
            span: self.last_span,
        });
        Ok(())
    }

    fn complete(&mut self, _timeout: Option<Duration>) -> Result<Option<StepDone>> {
        Ok(self.done.pop_front())
    }
}
