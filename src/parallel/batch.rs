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
pub use crate::kernels::ops::{blocks_per_slot, KV_BLOCK};
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
    /// New block tables of some slots, applied in order before this step's copies and
    /// layers on every device, stage and rank that holds KV (empty: the tables stay).
    pub kv_tables: Vec<SlotTable>,
    /// Copies of cached KV between slots, made in order before this step runs (a prefix
    /// another slot already holds, so the step prefills only the rest), through the slots'
    /// block tables (after [`kv_tables`](Self::kv_tables)).
    pub kv_copies: Vec<KvCopy>,
}

/// A slot's new block table, or its leading part: the KV cache is a pool of physical blocks
/// of [`KV_BLOCK`] positions, block `b = s * bps + j` (`bps` = [`blocks_per_slot`]) holding
/// positions `KV_BLOCK * j ..` of slot region `s` in every layer and KV head, and slot
/// `slot`'s logical block `j` (its positions `KV_BLOCK * j ..`) is `blocks[j]`. Entries past
/// `blocks.len()` keep their value. Every slot starts with the identity table (`s * bps + j`:
/// the contiguous layout). Several slots may name one block (a shared prefix that nobody
/// writes); the caller keeps the blocks a step writes to itself.
///
/// When `max_seq` is not a multiple of `KV_BLOCK`, each region's last block is short: a
/// slot's last logical block maps only onto a short block, and the others only onto full
/// ones.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotTable {
    /// The slot whose table changes.
    pub slot: usize,
    /// Physical blocks of its logical blocks `0..blocks.len()`.
    pub blocks: Vec<u32>,
}

impl SlotTable {
    /// Checks the table against a cache of `slots` slots of `max_seq` positions.
    pub fn check(&self, slots: usize, max_seq: usize) -> Result<()> {
        let bps = blocks_per_slot(max_seq);
        let pool = slots * bps;
        let short = !max_seq.is_multiple_of(KV_BLOCK);
        let why = if self.slot >= slots {
            format!("the slot is out of range ({slots} slots)")
        } else if self.blocks.len() > bps {
            format!("{} blocks for a slot of {bps}", self.blocks.len())
        } else if let Some((j, b)) =
            (self.blocks.iter().enumerate()).find(|&(_, &b)| b as usize >= pool)
        {
            format!("logical block {j} names block {b} of a pool of {pool}")
        } else if let Some((j, b)) = (self.blocks.iter().enumerate())
            .find(|&(j, &b)| short && ((j + 1 == bps) != ((b as usize) % bps + 1 == bps)))
        {
            format!(
                "logical block {j} names block {b}, but only a slot's last block may be, or \
                 map onto, a short one ({} positions)",
                max_seq % KV_BLOCK
            )
        } else {
            return Ok(());
        };
        Err(WgparError::KvTable {
            slot: self.slot,
            slots,
            max_seq,
            why,
        })
    }
}

/// A step's changes to the KV caches, as they travel to the devices, stages and ranks that
/// apply them: block tables first, then copies.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct KvEdits {
    pub tables: Vec<SlotTable>,
    pub copies: Vec<KvCopy>,
}

impl KvEdits {
    /// A step's edits.
    pub fn of(tables: Vec<SlotTable>, copies: Vec<KvCopy>) -> Self {
        Self { tables, copies }
    }

    /// The edits as `KvCache::apply_edits` takes them.
    pub fn parts(&self) -> (&[SlotTable], &[KvCopy]) {
        (&self.tables, &self.copies)
    }
}

/// Checks every table and copy of a step against `config`'s cache of `slots` slots before
/// anything of the step runs.
pub(crate) fn check_kv_edits(step: &BatchStep, slots: usize, config: &ModelConfig) -> Result<()> {
    (step.kv_tables.iter()).try_for_each(|t| t.check(slots, config.max_seq))?;
    check_kv_copies(&step.kv_copies, slots, config)
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
fn check_kv_copies(copies: &[KvCopy], slots: usize, config: &ModelConfig) -> Result<()> {
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
