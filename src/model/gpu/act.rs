//! An activation set: the buffers one device computes a step in, and every op of the model
//! part bound to them once (bind groups made here, never per step), with the params buffer
//! those ops read and the step shape they are configured for.

use std::sync::Arc;

use super::layer::LayerOps;
use crate::device::{Readback, Tensor};
use crate::error::WgparError;
use crate::kernels::ops::{
    ElementwiseOp, Embed, NormOp, Params, Pass, Pick, PickSetup, Pool, TokenPick,
};

/// The buffers of an activation set.
pub(super) struct Buffers {
    /// Residual stream `[tokens][hidden]`: the input and output of every layer.
    pub(super) x: Tensor,
    pub(super) h: Tensor,
    pub(super) q: Tensor,
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    pub(super) attn: Tensor,
    pub(super) attn_out: Tensor,
    pub(super) gate: Tensor,
    pub(super) up: Tensor,
    pub(super) mlp_out: Tensor,
    pub(super) ids: Tensor,
    /// The step's sequence table, `[batch][2]` u32 (KV slot, past).
    pub(super) seqs: Tensor,
    /// Token type per token (encoders).
    pub(super) types: Tensor,
    /// Real (non-padding) tokens per sequence; `u32::MAX` (all) until written.
    pub(super) lens: Tensor,
    pub(super) last: Tensor,
    pub(super) last_norm: Tensor,
    /// `[batch][vocab]` logits (decoder head devices).
    pub(super) logits: Option<Tensor>,
    /// `[batch][hidden]` pooled embeddings (encoder output devices).
    pub(super) pooled: Option<Tensor>,
    /// `[batch]` f32 uniform draws for device sampling (decoder head devices).
    pub(super) draws: Option<Tensor>,
    /// `[batch][allow words]` u32 bit sets of the tokens each row may pick, for a masked
    /// pick (decoder head devices).
    pub(super) allow: Option<Tensor>,
    /// Packed logit adjustments (`ops::adjust_words(batch)` u32: bias and penalties), for
    /// an adjusted pick (decoder head devices).
    pub(super) adjust: Option<Tensor>,
    /// `[2][batch]` u32: picked tokens, then each row's count of non-finite logits.
    pub(super) picked: Option<Tensor>,
    /// A one-element buffer bound where an op takes no second operand.
    pub(super) unused: Tensor,
    /// Width of a token's state.
    pub(super) hidden: usize,
}

impl Buffers {
    /// `x = h` over `tokens` rows (how a norm lands in place: a kernel may not read and
    /// write one buffer).
    pub(super) fn copy_h_to_x(&self, pass: &mut Pass<'_>, tokens: usize) {
        let bytes = (tokens * self.hidden * 4) as u64;
        pass.copy((self.h.buffer(), 0), (self.x.buffer(), 0), bytes);
    }
}

/// The embedding's ops.
pub(super) struct EmbedOps {
    /// One lookup per block of the token table.
    pub(super) embed: Vec<Embed>,
    /// BERT's embedding LayerNorm (x -> h, then copied back).
    pub(super) norm: Option<NormOp>,
    /// Gemma's scale of the looked-up rows.
    pub(super) scale: Option<ElementwiseOp>,
}

/// The final norm, LM head and token pick.
pub(super) struct HeadOps {
    /// Final norm straight from the stream: one token per sequence, so its rows are the last
    /// tokens already.
    pub(super) norm_x: NormOp,
    /// Final norm of the gathered last tokens (steps of several tokens per sequence).
    pub(super) norm_last: NormOp,
    /// One matmul per block of the head's table.
    pub(super) logits: Vec<HeadBlock>,
    /// The final logits' soft-cap, where the model has one.
    pub(super) softcap: Option<ElementwiseOp>,
    pub(super) pick: Pick,
}

/// The LM head over one block of the vocabulary.
pub(super) struct HeadBlock {
    pub(super) matmul: super::matrix::Projection,
    /// Logit column (token id) of the block's first row.
    pub(super) first: usize,
    pub(super) rows: usize,
    /// `[batch][rows]`, copied into the logits' columns `first .. first + rows` after the
    /// matmul; `None` when the block is the whole table and the matmul writes the logits.
    pub(super) part: Option<Tensor>,
}

/// Reusable activation buffers for up to `tokens` tokens and `batch` sequences on one device,
/// with the model part's ops bound to them.
pub struct Activations {
    /// Identity of this set for the KV caches' bindings (they hold a `Weak` to it).
    pub(super) token: Arc<()>,
    pub(super) tokens: usize,
    pub(super) batch: usize,
    pub(super) buf: Buffers,
    pub(super) params: Params,
    pub(super) embed: Option<EmbedOps>,
    pub(super) layers: Vec<LayerOps>,
    pub(super) head: Option<HeadOps>,
    pub(super) pool: Option<Pool>,
    /// (batch, seq) the ops are configured for.
    pub(super) configured: Option<(usize, usize)>,
    /// The token pick the head's op is configured for, and the one asked for.
    pub(super) pick_configured: Option<PickSetup>,
    pub(super) pick: TokenPick,
    /// The pick reads the rows' `allow` bit sets ([`GpuModel::write_allow`](super::GpuModel::write_allow)).
    pub(super) masked: bool,
    /// The pick applies the rows' logit adjustments ([`GpuModel::write_adjust`](super::GpuModel::write_adjust)).
    pub(super) adjusted: bool,
    /// Copy the logits out too (besides the tokens).
    pub(super) want_logits: bool,
    pub(super) tokens_out: Option<Readback>,
    pub(super) logits_out: Option<Readback>,
}

impl Activations {
    pub(super) fn token(&self) -> &Arc<()> {
        &self.token
    }

    pub(super) fn buffers(&self) -> &Buffers {
        &self.buf
    }

    /// Tokens these buffers hold.
    pub fn capacity(&self) -> usize {
        self.tokens
    }

    /// Sequences these buffers hold.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Residual stream `[tokens][hidden]`: the input and output of every layer (a pipeline
    /// stage uploads into it and downloads from it).
    pub fn x(&self) -> &Tensor {
        &self.buf.x
    }

    /// Attention output projection, a partial sum under tensor parallelism `[tokens][hidden]`.
    pub fn attn_out(&self) -> &Tensor {
        &self.buf.attn_out
    }

    /// MLP down projection, a partial sum under tensor parallelism `[tokens][hidden]`.
    pub fn mlp_out(&self) -> &Tensor {
        &self.buf.mlp_out
    }

    /// Logits of each sequence's last token `[batch][vocab]` (decoder head devices only).
    pub fn logits(&self) -> Option<&Tensor> {
        self.buf.logits.as_ref()
    }

    /// Pooled embedding per sequence `[batch][hidden]` (encoder output devices only).
    pub fn pooled(&self) -> Option<&Tensor> {
        self.buf.pooled.as_ref()
    }

    /// The head's picks `[2][batch]` u32: each sequence's next token, then its count of
    /// non-finite logits (decoder head devices only).
    pub fn picked(&self) -> Option<&Tensor> {
        self.buf.picked.as_ref()
    }

    /// How the head picks tokens from the next step on, and whether
    /// [`GpuModel::copy_out`](super::GpuModel::copy_out) copies the logits out too. Takes
    /// effect at the next `begin_step` (the pick's params are written there).
    pub fn set_readout(&mut self, pick: TokenPick, logits: bool) {
        self.pick = pick;
        self.want_logits = logits;
        self.masked = false;
        self.adjusted = false;
    }

    /// After [`Self::set_readout`]: the pick keeps to the bit sets the step wrote with
    /// [`GpuModel::write_allow`](super::GpuModel::write_allow).
    pub fn set_masked(&mut self) {
        self.masked = true;
    }

    /// After [`Self::set_readout`]: the pick applies the adjustments the step wrote with
    /// [`GpuModel::write_adjust`](super::GpuModel::write_adjust).
    pub fn set_adjusted(&mut self) {
        self.adjusted = true;
    }

    pub(super) fn no_head(&self) -> WgparError {
        WgparError::NotHeld {
            part: "LM head".into(),
            holder: "this device (not the model's last stage)".into(),
        }
    }
}
