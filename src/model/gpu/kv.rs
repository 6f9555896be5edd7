//! A device's KV cache, and the cache's ops (KV append and attention) bound to each activation
//! set that runs steps on it: made when the pair first meets, kept while both live.

use std::sync::{Arc, Weak};

use super::act::Activations;
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{self, Attention, AttnMask, AttnShape, KvStore, Params};
use crate::kernels::variants::context_bucket;
use crate::parallel::KvCopy;

/// One device's KV cache for its layers and heads: per layer, keys and values laid out
/// `[slots][kv_heads][max_seq][head_dim]`, one slot per sequence. A step's sequence table
/// says which slot each of its rows uses.
pub struct KvCache {
    slots: usize,
    layout: KvLayout,
    layers: Vec<(Tensor, Tensor)>,
    bindings: Vec<KvBinding>,
    /// Where a copy between slots stages one layer's keys or values (wgpu copies no buffer
    /// onto itself): made by the first copy, one slot of one layer.
    scratch: Option<Tensor>,
}

/// A slot's shape on this device: `kv_heads` (its own) of `max_seq` positions of `head_dim`.
#[derive(Debug, Clone, Copy)]
pub(super) struct KvLayout {
    pub kv_heads: usize,
    pub max_seq: usize,
    pub head_dim: usize,
}

/// One copy's byte ranges in a layer's buffer: each head's start in the source and target
/// slots, and the bytes of each.
struct CopyPlan {
    from: Vec<u64>,
    to: Vec<u64>,
    bytes: u64,
}

impl CopyPlan {
    /// Source heads into `scratch` (packed), then `scratch` into the target heads: wgpu
    /// orders copies within an encoder, and copies no buffer onto itself.
    fn encode(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &wgpu::Buffer,
        scratch: &wgpu::Buffer,
    ) {
        if self.bytes == 0 {
            return;
        }
        for (h, &from) in self.from.iter().enumerate() {
            encoder.copy_buffer_to_buffer(cache, from, scratch, h as u64 * self.bytes, self.bytes);
        }
        for (h, &to) in self.to.iter().enumerate() {
            encoder.copy_buffer_to_buffer(scratch, h as u64 * self.bytes, cache, to, self.bytes);
        }
    }
}

/// One layer's cache ops for one activation set.
pub(super) struct KvLayer {
    pub(super) store: KvStore,
    pub(super) attend: Attention,
}

/// The cache's ops bound to one activation set (its Q/K/V, attention output, sequence table
/// and lengths), with their own params (the cache's slot count is part of them).
struct KvBinding {
    act: Weak<()>,
    params: Params,
    layers: Vec<KvLayer>,
    shape: Option<(usize, usize)>,
    /// The context bucket the attention ops are configured for.
    context_bucket: Option<u32>,
}

/// What the cache's ops need to know about the model on this device.
pub(super) struct KvSpec {
    /// The attention shape with every per-model field set (batch and seq are replaced).
    pub heads: AttnShape,
    pub causal: bool,
    /// Score scale instead of 1/sqrt(head_dim), if the model sets one (Gemma).
    pub scale: Option<f32>,
    /// Per local layer: its sliding window, if it slides (Gemma 3).
    pub windows: Vec<Option<usize>>,
}

impl KvCache {
    pub(super) fn new(slots: usize, layout: KvLayout, layers: Vec<(Tensor, Tensor)>) -> Self {
        Self {
            slots,
            layout,
            layers,
            bindings: Vec::new(),
            scratch: None,
        }
    }

    /// Encodes `copies`, in order, into `encoder`: for each, positions `0..tokens` of slot
    /// `from` into slot `to`, every layer and KV head of this device. Checks them all before
    /// encoding any. Commands encoded after them see the copied KV, and they see every
    /// earlier submission's.
    pub fn copy_prefixes(
        &mut self,
        gpu: &Gpu,
        encoder: &mut wgpu::CommandEncoder,
        copies: &[KvCopy],
    ) -> Result<()> {
        let plans = (copies.iter())
            .map(|c| self.plan_copy(c))
            .collect::<Result<Vec<_>>>()?;
        if plans.iter().all(|p| p.bytes == 0) {
            return Ok(());
        }
        if self.scratch.is_none() {
            let l = self.layout;
            let len = l.kv_heads * l.max_seq * l.head_dim;
            let dtype = self.layers.first().map_or(DType::F32, |(k, _)| k.dtype());
            self.scratch = Some(gpu.empty("kv copy scratch", dtype, len)?);
        }
        let Some(scratch) = &self.scratch else {
            return Ok(());
        };
        for plan in &plans {
            for (k, v) in &self.layers {
                for cache in [k, v] {
                    plan.encode(encoder, cache.buffer(), scratch.buffer());
                }
            }
        }
        Ok(())
    }

    /// [`copy_prefixes`](Self::copy_prefixes) in a submission of their own (none when there
    /// are no copies): queue order puts them after every earlier submission on this device
    /// and before every later one.
    pub fn submit_copies(&mut self, gpu: &Gpu, copies: &[KvCopy]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let mut enc = gpu.encoder();
        self.copy_prefixes(gpu, &mut enc, copies)?;
        gpu.submit(enc);
        Ok(())
    }

    /// Byte ranges of `copy` in one layer's buffer, checked against the cache and wgpu's
    /// 4-byte copy alignment.
    fn plan_copy(&self, copy: &KvCopy) -> Result<CopyPlan> {
        let l = self.layout;
        copy.check(self.slots, l.max_seq, l.head_dim)?;
        let elem = self.layers.first().map_or(4, |(k, _)| k.dtype().size());
        // An f16 head of odd length ends mid-word: one more position (past the prefix, which
        // the slot's next step writes before any attention reads it) makes it whole. The
        // check above refused the one layout where that cannot work (odd max_seq too).
        let tokens = if !(copy.tokens * l.head_dim * elem).is_multiple_of(4) {
            copy.tokens + 1
        } else {
            copy.tokens
        };
        let head = (l.max_seq * l.head_dim * elem) as u64;
        let bytes = (tokens * l.head_dim * elem) as u64;
        let at = |slot: usize, h: usize| (slot * l.kv_heads + h) as u64 * head;
        if tokens > l.max_seq || !bytes.is_multiple_of(4) || !head.is_multiple_of(4) {
            return Err(WgparError::Internal(format!(
                "KV copy of {tokens} positions of {} x {} bytes is not 4-byte aligned",
                l.head_dim, elem
            )));
        }
        Ok(CopyPlan {
            from: (0..l.kv_heads).map(|h| at(copy.from, h)).collect(),
            to: (0..l.kv_heads).map(|h| at(copy.to, h)).collect(),
            bytes,
        })
    }

    /// Sequences the cache holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    fn find(&self, act: &Activations) -> Option<usize> {
        let token = Arc::as_ptr(act.token());
        // A live `Weak` keeps its allocation, so an equal pointer is the same activation set.
        self.bindings
            .iter()
            .position(|b| Weak::as_ptr(&b.act) == token)
    }

    /// Binds the cache's ops to `act` on first use (dropping bindings of activation sets that
    /// are gone) and configures them for `batch` rows of `seq` tokens when that changed, and
    /// the attention for a step over `context` positions when its bucket changed.
    pub(super) fn prepare(
        &mut self,
        gpu: &Gpu,
        act: &Activations,
        spec: &KvSpec,
        (batch, seq): (usize, usize),
        context: usize,
    ) -> Result<()> {
        self.bindings.retain(|b| b.act.strong_count() > 0);
        let index = match self.find(act) {
            Some(i) => i,
            None => {
                let binding = self.bind(gpu, act, spec)?;
                self.bindings.push(binding);
                self.bindings.len() - 1
            }
        };
        let binding = &mut self.bindings[index];
        let bucket = context_bucket(context);
        let reshaped = binding.shape != Some((batch, seq));
        if reshaped || binding.context_bucket != Some(bucket) {
            // A failure part-way leaves the binding unconfigured, never half-configured.
            (binding.shape, binding.context_bucket) = (None, None);
            for l in &mut binding.layers {
                if reshaped {
                    l.store.configure(gpu, &mut binding.params, (batch, seq))?;
                }
                l.attend
                    .configure(gpu, &mut binding.params, (batch, seq), context)?;
            }
            (binding.shape, binding.context_bucket) = (Some((batch, seq)), Some(bucket));
        }
        binding.params.flush(gpu);
        Ok(())
    }

    fn bind(&self, gpu: &Gpu, act: &Activations, spec: &KvSpec) -> Result<KvBinding> {
        let a = act.buffers();
        let capacity = AttnShape {
            batch: act.batch(),
            seq: act.capacity() / act.batch().max(1),
            slots: self.slots,
            ..spec.heads
        };
        let mask = if spec.causal {
            AttnMask::Causal
        } else {
            AttnMask::Bidirectional { lens: &a.lens }
        };
        let mut params = Params::new(gpu, "kv params", 2 * self.layers.len())?;
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, (k, v))| {
                let cache = ops::KvCache {
                    k,
                    v,
                    seqs: &a.seqs,
                };
                Ok(KvLayer {
                    store: KvStore::bind(gpu, &mut params, (&a.k, &a.v), cache, &capacity)?,
                    attend: Attention::bind(
                        gpu,
                        &mut params,
                        (&a.q, cache, &a.attn),
                        &capacity,
                        mask,
                    )?
                    .with_scale(spec.scale)
                    .with_window(spec.windows.get(i).copied().flatten()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvBinding {
            act: Arc::downgrade(act.token()),
            params,
            layers,
            shape: None,
            context_bucket: None,
        })
    }

    /// Layer `i`'s cache ops bound to `act` (after [`prepare`](Self::prepare)).
    pub(super) fn layer(&self, act: &Activations, i: usize) -> Result<&KvLayer> {
        self.find(act)
            .and_then(|b| self.bindings[b].layers.get(i))
            .ok_or_else(|| WgparError::Shape {
                op: "attention".into(),
                detail: format!(
                    "KV cache layer {i} is not prepared for this activation set \
                     (call begin_step with this cache first)"
                ),
            })
    }
}
