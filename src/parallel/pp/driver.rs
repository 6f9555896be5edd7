//! The driver's side of the stages: sending passes to stage 0, receiving what the last stage
//! returns, and turning its picks into tokens.

use std::sync::Arc;

use crossbeam::channel::RecvTimeoutError;

use super::handoff::{Output, Work};
use super::{PipelineEngine, Readout};
use crate::error::{Result, WgparError};
use crate::model::{Step, StepOut};
use crate::parallel::pick::{check_finite, count_non_finite};
use crate::parallel::Logits;
use crate::threads::lock;
use crate::trace::SpanId;

impl PipelineEngine {
    pub(super) fn check_alive(&self) -> Result<()> {
        match &self.failed {
            Some(why) => Err(WgparError::EngineStopped {
                engine: "pipeline".into(),
                cause: why.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn reset_stats(&mut self) {
        self.run += 1;
        for s in lock(&self.stats).iter_mut() {
            s.clear();
        }
    }

    pub(super) fn send(&mut self, work: Work) -> Result<()> {
        let input = self
            .input
            .as_ref()
            .ok_or_else(|| WgparError::WorkerStopped {
                worker: "stage 0".into(),
                detail: "the pipeline's input is closed".into(),
            })?;
        if input.send(work).is_err() {
            // Stage 0 is gone: its error (or the root cause further down) is in the output.
            return Err(self
                .receive()
                .err()
                .unwrap_or_else(|| WgparError::WorkerStopped {
                    worker: "stage 0".into(),
                    detail: "it closed its input".into(),
                }));
        }
        Ok(())
    }

    pub(super) fn receive(&mut self) -> Result<Output> {
        let r = match self.output.recv_timeout(self.timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(WgparError::Timeout {
                engine: "pipeline".into(),
                secs: self.timeout.as_secs_f64(),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(WgparError::WorkerStopped {
                worker: "every stage".into(),
                detail: "no logits came back".into(),
            }),
        };
        if let Err(e) = &r {
            self.failed = Some(e.to_string());
            // Close the input so every stage drains and stops.
            self.input = None;
        }
        r
    }

    /// One pass of `group` through the pipeline; its first span waits for `deps`.
    pub(super) fn work(
        &self,
        group: usize,
        ids: Vec<u32>,
        step: Step,
        (new_cache, release): (bool, bool),
        deps: Vec<SpanId>,
    ) -> Work {
        Work {
            group,
            cache: group,
            rows: None,
            slots: None,
            release_us: None,
            ids: Arc::new(ids),
            step,
            new_cache,
            release,
            hidden: Vec::new(),
            encoder: None,
            pacer: self.pacer.clone(),
            deps,
            recorder: self.recorder.clone(),
            run: self.run,
            readout: Readout::default(),
            kv_edits: Arc::default(),
        }
    }

    /// The readout of a step of `batch` sequences: the engine's pick with its draws, and the
    /// logits when asked for or when the host picks.
    pub(super) fn readout(&mut self, batch: usize, logits: bool) -> Readout {
        if self.remote_head {
            return Readout::remote(logits || self.host_picks());
        }
        Readout {
            pick: self.picker.device_or_greedy(),
            draws: Arc::new(self.picker.draws(batch)),
            logits: logits || self.picker.needs_logits(),
            allow: Arc::default(),
            adjust: Arc::default(),
        }
    }

    /// Whether tokens are picked here from read-back logits rather than on the device.
    pub(super) fn host_picks(&self) -> bool {
        self.picker.needs_logits() || (self.remote_head && self.picker.needs_remote_logits())
    }

    /// A step's tokens from the last stage's picks: refused when logits were not finite,
    /// sampled here where the device could not pick this way.
    pub(super) fn tokens_of(&mut self, step: usize, out: &StepOut) -> Result<Vec<u32>> {
        check_finite(step, &out.non_finite, None)?;
        if !self.host_picks() {
            return Ok(out.tokens.clone());
        }
        // The last stage downloads logits whenever the host picks.
        let data = out.logits.clone().ok_or_else(|| {
            WgparError::Internal("the host picks tokens but no logits came back".into())
        })?;
        let l = Logits {
            batch: out.tokens.len(),
            vocab: self.config.vocab,
            data,
        };
        check_finite(step, &count_non_finite(&l), None)?;
        Ok(self.picker.host(&l))
    }
}

/// A stage's output that its own step cannot produce (the driver sends one kind per step).
pub(super) fn unexpected_output() -> WgparError {
    WgparError::Internal("the last stage returned an output of another kind or group".into())
}
