//! How the driver schedules passes: a GPipe fill-drain (prefill, encoder batches and the
//! step-by-step decode) or decode with every micro-batch in flight.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::driver::unexpected_output;
use super::handoff::{Output, Payload};
use super::PipelineEngine;
use crate::error::Result;
use crate::model::{EncoderInput, Step, StepOut};
use crate::parallel::encoder::{pad_batch, Embeddings, Encoder};
use crate::parallel::tp::EncoderExtras;
use crate::parallel::{check_decode, Decoded, Engine, Logits, StepOutput};
use crate::trace::SpanId;

/// How a pipeline schedules decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// Each micro-batch moves to its next token as soon as its previous token has left the
    /// last stage and been sampled: no barrier between tokens, the pipeline stays full.
    #[default]
    InFlight,
    /// Every decode step fills and drains the pipeline with all micro-batches (a barrier per
    /// token), as GPipe does for one batch.
    GPipe,
}

impl Schedule {
    /// Parses `in-flight` or `gpipe`.
    pub fn parse(text: &str) -> Option<Schedule> {
        match text {
            "in-flight" | "inflight" => Some(Schedule::InFlight),
            "gpipe" => Some(Schedule::GPipe),
            _ => None,
        }
    }

    /// The name [`Schedule::parse`] reads.
    pub fn label(self) -> &'static str {
        match self {
            Schedule::InFlight => "in-flight",
            Schedule::GPipe => "gpipe",
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl PipelineEngine {
    /// One GPipe step: every group's work in, every group's tokens (and logits when asked)
    /// out, in group order. The step starts after the previous call's outputs (the driver
    /// had them all).
    pub(super) fn gpipe(
        &mut self,
        steps: Vec<(Vec<u32>, Step)>,
        new_cache: bool,
        want_logits: bool,
    ) -> Result<StepOutput> {
        self.check_alive()?;
        self.reset_stats();
        let start = Instant::now();
        let tokens: usize = steps.iter().map(|(_, s)| s.tokens()).sum();
        let n = steps.len();
        let barrier = std::mem::take(&mut self.last_outputs);
        for (g, (ids, step)) in steps.into_iter().enumerate() {
            let mut w = self.work(g, ids, step, (new_cache, false), barrier.clone());
            w.readout = self.readout(step.batch, want_logits);
            self.send(w)?;
        }
        let mut rows: Vec<Option<StepOut>> = vec![None; n];
        for _ in 0..n {
            let out = self.receive()?;
            self.group_deps.insert(out.group, out.dep);
            self.last_outputs.push(out.dep);
            match (out.payload, rows.get_mut(out.group)) {
                (Payload::Picked(p), Some(row)) => *row = Some(p),
                _ => return Err(unexpected_output()),
            }
        }
        self.finish_run(start, tokens, n, 1);
        let mut next = Vec::with_capacity(self.batch);
        let mut logits = Vec::new();
        for out in rows {
            let out = out.ok_or_else(unexpected_output)?;
            next.extend(self.tokens_of(self.steps, &out)?);
            logits.extend(out.logits.unwrap_or_default());
        }
        self.steps += 1;
        Ok(StepOutput {
            tokens: next,
            logits: want_logits.then_some(Logits {
                batch: self.batch,
                vocab: self.config.vocab,
                data: logits,
            }),
        })
    }

    /// Decode with every micro-batch in flight: a group's next token enters stage 0 as soon
    /// as its pick is back, whatever the other groups are doing. Only token ids come back
    /// unless `keep_logits` (or a host-side pick) asks for the logits.
    pub(super) fn decode_in_flight(
        &mut self,
        next: &[u32],
        steps: usize,
        keep_logits: bool,
    ) -> Result<Decoded> {
        self.check_alive()?;
        check_decode(self.batch, next)?;
        let start = Instant::now();
        let mut out = Decoded {
            tokens: vec![Vec::with_capacity(steps); self.batch],
            ..Decoded::default()
        };
        if steps == 0 {
            return Ok(out);
        }
        self.reset_stats();
        let groups = self.groups.clone();
        let mut lanes = Lanes::new(groups.len(), steps, keep_logits);
        // The first tokens were sampled from the previous call's outputs, all of them.
        let barrier = std::mem::take(&mut self.last_outputs);
        for (g, range) in groups.iter().enumerate() {
            self.decode_pass(
                g,
                next[range.clone()].to_vec(),
                barrier.clone(),
                keep_logits,
            )?;
        }
        while lanes.running > 0 {
            let o = self.receive()?;
            self.decoded(o, &mut lanes, &mut out)?;
        }
        self.last_outputs = (0..groups.len())
            .filter_map(|g| self.group_deps.get(&g).copied())
            .collect();
        self.finish_run(start, self.batch * steps, groups.len(), steps);
        if keep_logits {
            out.logits = lanes.logits(self.batch, self.config.vocab);
        }
        out.wall_s = start.elapsed().as_secs_f64();
        out.stats = self.last.clone().unwrap_or_default();
        Ok(out)
    }

    /// Sends group `g`'s next decode pass of `ids`, after `deps`.
    fn decode_pass(
        &mut self,
        g: usize,
        ids: Vec<u32>,
        deps: Vec<SpanId>,
        keep_logits: bool,
    ) -> Result<()> {
        let step = Step {
            batch: self.groups[g].len(),
            seq: 1,
            past: self.group_past[g],
        };
        let mut w = self.work(g, ids, step, (false, false), deps);
        w.readout = self.readout(step.batch, keep_logits);
        self.send(w)
    }

    /// Takes a group's decoded pass `o`: its tokens (and logits) into `out`, and the group's
    /// next pass on its way unless the group is done.
    fn decoded(&mut self, o: Output, lanes: &mut Lanes, out: &mut Decoded) -> Result<()> {
        let g = o.group;
        self.group_deps.insert(g, o.dep);
        self.group_past[g] += 1;
        lanes.left[g] -= 1;
        let Payload::Picked(picked) = o.payload else {
            return Err(unexpected_output());
        };
        // Step k of this group: the prefill was step 0.
        let chosen = self.tokens_of(lanes.steps - lanes.left[g], &picked)?;
        for (seq, &t) in self.groups[g].clone().zip(&chosen) {
            out.tokens[seq].push(t);
        }
        if lanes.keep_logits {
            let mut data = picked.logits.unwrap_or_default();
            data.truncate(o.batch * self.config.vocab);
            lanes.kept[g].push(data);
        }
        if lanes.left[g] == 0 {
            lanes.running -= 1;
            return Ok(());
        }
        self.decode_pass(g, chosen, vec![o.dep], lanes.keep_logits)
    }
}

/// The groups (lanes) of an in-flight decode: passes left, logits kept.
struct Lanes {
    steps: usize,
    keep_logits: bool,
    /// Passes left per group.
    left: Vec<usize>,
    /// Groups with passes left.
    running: usize,
    /// Per group, each step's logits (when kept).
    kept: Vec<Vec<Vec<f32>>>,
}

impl Lanes {
    fn new(groups: usize, steps: usize, keep_logits: bool) -> Self {
        Self {
            steps,
            keep_logits,
            left: vec![steps; groups],
            running: groups,
            kept: vec![Vec::new(); groups],
        }
    }

    /// The kept logits, one batch per step.
    fn logits(&self, batch: usize, vocab: usize) -> Vec<Logits> {
        (0..self.steps)
            .map(|s| Logits {
                batch,
                vocab,
                data: self
                    .kept
                    .iter()
                    .flat_map(|k| k[s].iter().copied())
                    .collect(),
            })
            .collect()
    }
}

impl Encoder for PipelineEngine {
    fn name(&self) -> String {
        Engine::name(self)
    }

    /// The batch split into micro-batches (each its own padded group) flowing through the
    /// stages; the last stage pools.
    fn encode(&mut self, inputs: &[EncoderInput]) -> Result<Embeddings> {
        self.check_alive()?;
        let seq = EncoderInput::check_batch(inputs, &self.config)?;
        let groups = split_groups(inputs.len(), self.micro_batches);
        self.reset_stats();
        let start = Instant::now();
        let barrier = std::mem::take(&mut self.last_outputs);
        for (g, range) in groups.iter().enumerate() {
            let (ids, types, lens) = pad_batch(&inputs[range.clone()], seq);
            let step = Step {
                batch: range.len(),
                seq,
                past: 0,
            };
            let mut w = self.work(g, ids, step, (true, true), barrier.clone());
            w.encoder = Some(Arc::new(EncoderExtras { types, lens }));
            self.send(w)?;
        }
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; groups.len()];
        let dim = self.config.hidden;
        for _ in 0..groups.len() {
            let out = self.receive()?;
            self.last_outputs.push(out.dep);
            let (Payload::Pooled(mut data), Some(row)) = (out.payload, rows.get_mut(out.group))
            else {
                return Err(unexpected_output());
            };
            data.truncate(out.batch * dim);
            *row = Some(data);
        }
        self.finish_run(start, inputs.len() * seq, groups.len(), 1);
        Ok(Embeddings {
            batch: inputs.len(),
            dim,
            data: rows.into_iter().flatten().flatten().collect(),
        })
    }
}

/// Contiguous sequence ranges for `m` micro-batches of a batch (at most one per sequence).
pub fn split_groups(batch: usize, m: usize) -> Vec<Range<usize>> {
    let m = m.clamp(1, batch.max(1));
    let base = batch / m;
    let extra = batch % m;
    let mut start = 0;
    (0..m)
        .map(|g| {
            let n = base + usize::from(g < extra);
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}
