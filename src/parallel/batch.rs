//! Continuous batching at the engine level: a step runs rows of sequences, each in its own KV
//! slot with its own count of cached tokens, so sequences can join and leave a running batch
//! at any token boundary. [`StepEngine`] is what the serving loop (`crate::batching`) drives.
//!
//! An engine has one or more *lanes*: a single device or a tensor-parallel group runs one step
//! at a time (one lane); a pipeline keeps one step per micro-batch lane in flight, each lane a
//! running batch of its own, so the stages overlap.

use std::time::Duration;

use super::{Engine, Logits, PipelineStats};
use crate::error::{Result, WgparError};
use crate::model::ModelConfig;
pub use crate::model::SeqRow;
use crate::trace::SpanId;

/// One step of a running batch on one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchStep {
    /// Lane the step runs on (`0..lanes()`).
    pub lane: usize,
    /// Rows, each with `seq` new tokens.
    pub rows: Vec<SeqRow>,
    /// New tokens per row (prompt length for a prefill, 1 for a decode step).
    pub seq: usize,
    /// Token ids, `rows.len() * seq`, row after row.
    pub ids: Vec<u32>,
    /// Spans the step waits for: the lane's previous output, and whatever freed the slots it
    /// fills.
    pub deps: Vec<SpanId>,
    /// Earliest start, microseconds since the recorder's epoch: when the requests a prefill
    /// admits arrived (see [`crate::trace::Span::release_ns`]).
    pub release_us: Option<f64>,
    /// Read each row's logits back as well, for a caller that samples some rows itself (a
    /// server whose requests carry their own temperature and seed).
    pub logits: bool,
    /// Each row's bit set of the tokens the device may pick for it (`rows x
    /// ops::allow_words(vocab)` u32, bit t % 32 of word t / 32 is token t): structured
    /// output's grammar masks, applied in the pick kernel. `None`: no mask. Only for an
    /// engine whose [`StepEngine::masks_on_device`] says so.
    pub allow: Option<Vec<u32>>,
    /// Changes to some rows' logits before the device pick (logit bias and penalties),
    /// packed by `ops::pack_adjustments`. `None`: none. Only for an engine whose
    /// [`StepEngine::masks_on_device`] says so.
    pub adjust: Option<Vec<u32>>,
    /// Copies of cached KV between slots, made in order before this step runs (a prefix
    /// another slot already holds, so the step prefills only the rest).
    pub kv_copies: Vec<KvCopy>,
}

/// A device-side copy of cached KV between slots, made before a step's layers run: positions
/// `0..tokens` of slot `from` into slot `to`, every layer and KV head, on every device, stage
/// and rank that holds KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvCopy {
    /// Slot that holds the cached prefix.
    pub from: usize,
    /// Slot the prefix is copied into.
    pub to: usize,
    /// Positions copied, from position 0.
    pub tokens: usize,
}

impl KvCopy {
    /// Checks the copy against a cache of `slots` slots of `max_seq` positions of `head_dim`
    /// each.
    pub fn check(&self, slots: usize, max_seq: usize, head_dim: usize) -> Result<()> {
        let why = if self.from >= slots {
            "the source slot is out of range"
        } else if self.to >= slots {
            "the target slot is out of range"
        } else if self.from == self.to {
            "a slot cannot be copied onto itself"
        } else if self.tokens > max_seq {
            "more positions than a slot holds"
        } else if !(max_seq * head_dim).is_multiple_of(2) {
            // An f16 cache would then put every other slot at a 2-byte offset, which a
            // buffer copy cannot address (wgpu copies 4-byte words).
            "an odd head_dim with an odd max_seq leaves slots unaligned for a device copy"
        } else {
            return Ok(());
        };
        Err(WgparError::KvCopy {
            from: self.from,
            to: self.to,
            tokens: self.tokens,
            slots,
            max_seq,
            why,
        })
    }
}

/// Checks every copy of a step against `config`'s cache of `slots` slots before anything of
/// the step runs.
pub(crate) fn check_kv_copies(copies: &[KvCopy], slots: usize, config: &ModelConfig) -> Result<()> {
    (copies.iter()).try_for_each(|c| c.check(slots, config.max_seq, config.head_dim))
}

/// A finished step.
#[derive(Debug, Clone)]
pub struct StepDone {
    /// Lane it ran on.
    pub lane: usize,
    /// Each row's next token, in row order: picked greedily on the device, so a step reads
    /// back token ids rather than `rows x vocab` logits.
    pub tokens: Vec<u32>,
    /// Each row's logits (`rows x vocab`), when the step asked for them
    /// ([`BatchStep::logits`]), checked finite.
    pub logits: Option<Logits>,
    /// The span that delivered the tokens (the lane's next step depends on it).
    pub span: SpanId,
}

/// The first `rows` rows of read-back logits (a pipeline may pad its batch), or `None`
/// when none were read.
pub(crate) fn row_logits(
    data: Option<Vec<f32>>,
    rows: usize,
    vocab: usize,
) -> Result<Option<Logits>> {
    let Some(mut data) = data else {
        return Ok(None);
    };
    let want = rows * vocab;
    if data.len() < want {
        return Err(WgparError::Shape {
            op: "serving step logits".into(),
            detail: format!("{} values for {rows} rows of {vocab}", data.len()),
        });
    }
    data.truncate(want);
    Ok(Some(Logits {
        batch: rows,
        vocab,
        data,
    }))
}

/// An engine that runs a continuously batched workload: steps over rows of (slot, past).
pub trait StepEngine: Engine {
    /// The model it runs.
    fn model_config(&self) -> &ModelConfig;

    /// Steps that can be in flight at once.
    fn lanes(&self) -> usize;

    /// Allocates KV caches for `slots` sequences of up to `max_seq` tokens each, replacing
    /// any earlier caches.
    fn reserve_slots(&mut self, slots: usize) -> Result<()>;

    /// KV slots reserved.
    fn slots(&self) -> usize;

    /// Starts `step` on its lane (which must be idle).
    fn submit(&mut self, step: BatchStep) -> Result<()>;

    /// The next finished step, waiting at most `timeout` (`None`: until one finishes).
    /// `Ok(None)` when the timeout passed first.
    fn complete(&mut self, timeout: Option<Duration>) -> Result<Option<StepDone>>;

    /// Whether [`BatchStep::allow`] and [`BatchStep::adjust`] reach the pick kernel: false
    /// where the head is in another process (a caller then masks and adjusts read-back
    /// logits itself).
    fn masks_on_device(&self) -> bool {
        false
    }

    /// Pipeline accounting of the work since the last [`reserve_slots`](Self::reserve_slots)
    /// (pipelines only).
    fn serving_stats(&self) -> Option<PipelineStats> {
        None
    }
}
