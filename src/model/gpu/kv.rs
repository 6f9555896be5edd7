//! A device's KV cache, and the cache's ops (KV append and attention) bound to each activation
//! set that runs steps on it: made when the pair first meets, kept while both live.

use std::sync::{Arc, Weak};

use super::act::Activations;
use crate::device::{Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{self, Attention, AttnMask, AttnShape, KvStore, Params};
use crate::kernels::variants::context_bucket;

/// One device's KV cache for its layers and heads: per layer, keys and values laid out
/// `[slots][kv_heads][max_seq][head_dim]`, one slot per sequence. A step's sequence table
/// says which slot each of its rows uses.
pub struct KvCache {
    slots: usize,
    layers: Vec<(Tensor, Tensor)>,
    bindings: Vec<KvBinding>,
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
    pub(super) fn new(slots: usize, layers: Vec<(Tensor, Tensor)>) -> Self {
        Self {
            slots,
            layers,
            bindings: Vec::new(),
        }
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
