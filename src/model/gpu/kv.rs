//! A device's KV cache, and the cache's ops (KV append and attention) bound to each activation
//! set that runs steps on it: made when the pair first meets, kept while both live.

use std::sync::{Arc, Weak};

use super::act::Activations;
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::ops::{
    self, blocks_per_slot, Attention, AttnMask, AttnShape, KvAddress, KvStore, Params, KV_BLOCK,
};
use crate::kernels::variants::context_bucket;
use crate::parallel::{KvCopy, SlotTable};

/// One device's KV cache for its layers and heads: per layer, keys and values laid out
/// `[slots][kv_heads][max_seq][head_dim]`, read as a pool of blocks of [`KV_BLOCK`]
/// positions through a block table (see [`SlotTable`]), one slot per sequence; or, on a
/// sliding-window layer, `[slots][kv_heads][ring][head_dim]`, a ring per slot (position p at
/// row p % ring) that no table addresses and nothing shares. A step's sequence table says
/// which slot each of its rows uses.
pub struct KvCache {
    slots: usize,
    layout: KvLayout,
    layers: Vec<(Tensor, Tensor)>,
    /// Per layer: its ring's rows, where it is a ring layer.
    rings: Vec<Option<usize>>,
    /// The block table on the device (`slots x blocks_per_slot(max_seq)` u32), bound to
    /// every KV op, and its host mirror (which plans copies).
    blocks: Tensor,
    mirror: Vec<u32>,
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

/// One copy's byte ranges in a layer's buffer: (source, target, bytes) of each run of
/// positions that is contiguous in both slots' blocks (one per head under identity tables).
struct CopyPlan {
    ranges: Vec<(u64, u64, u64)>,
}

impl CopyPlan {
    /// Source ranges into `scratch` (packed), then `scratch` into the target ranges: wgpu
    /// orders copies within an encoder, and copies no buffer onto itself.
    fn encode(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &wgpu::Buffer,
        scratch: &wgpu::Buffer,
    ) {
        let mut at = 0;
        for &(from, _, bytes) in &self.ranges {
            encoder.copy_buffer_to_buffer(cache, from, scratch, at, bytes);
            at += bytes;
        }
        at = 0;
        for &(_, to, bytes) in &self.ranges {
            encoder.copy_buffer_to_buffer(scratch, at, cache, to, bytes);
            at += bytes;
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
    /// A cache of `slots` over `layers`, with identity block tables.
    pub(super) fn new(
        gpu: &Gpu,
        slots: usize,
        layout: KvLayout,
        (layers, rings): (Vec<(Tensor, Tensor)>, Vec<Option<usize>>),
    ) -> Result<Self> {
        let mirror = ops::identity_blocks(slots, layout.max_seq);
        Ok(Self {
            slots,
            layout,
            layers,
            rings,
            blocks: gpu.upload_u32("kv blocks", &mirror)?,
            mirror,
            bindings: Vec::new(),
            scratch: None,
        })
    }

    /// The block tables of every slot (`slots x blocks_per_slot(max_seq)`), as applied.
    pub fn block_tables(&self) -> &[u32] {
        &self.mirror
    }

    /// Applies `tables`, then encodes `copies`, in order, into `encoder`: for each copy,
    /// positions `0..tokens` of slot `from` into slot `to` (through their new tables), every
    /// layer and KV head of this device. A ring layer copies the source's whole ring: the
    /// target holds the window before `tokens` as long as the source has written no
    /// position past `tokens + ring - window` (it computed the prefix and at most one step
    /// more). Checks them all before applying any. The tables
    /// reach the device at the next submit, ahead of its commands; commands encoded after
    /// the copies see the copied KV, and they see every earlier submission's.
    pub fn apply_edits(
        &mut self,
        gpu: &Gpu,
        encoder: &mut wgpu::CommandEncoder,
        (tables, copies): (&[SlotTable], &[KvCopy]),
    ) -> Result<()> {
        let mut mirror = self.mirror.clone();
        let bps = blocks_per_slot(self.layout.max_seq);
        for t in tables {
            t.check(self.slots, self.layout.max_seq)?;
            let row = t.slot * bps;
            mirror[row..row + t.blocks.len()].copy_from_slice(&t.blocks);
        }
        let plans = (copies.iter())
            .map(|c| Ok((self.plan_copy(&mirror, c)?, self.plan_ring_copy(c))))
            .collect::<Result<Vec<_>>>()?;
        if mirror != self.mirror {
            gpu.write_u32(&self.blocks, &mirror)?;
            self.mirror = mirror;
        }
        if plans.iter().all(|(p, _)| p.ranges.is_empty()) {
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
        for (paged, ring) in &plans {
            for ((k, v), r) in self.layers.iter().zip(&self.rings) {
                let own;
                let plan = match r {
                    Some(rows) => {
                        own = ring(*rows);
                        &own
                    }
                    None => paged,
                };
                for cache in [k, v] {
                    plan.encode(encoder, cache.buffer(), scratch.buffer());
                }
            }
        }
        Ok(())
    }

    /// The copy of one ring layer of `rows` rows a slot: the source slot's rings (every
    /// head, contiguous) onto the target's, for a `copy` already checked by
    /// [`plan_copy`](Self::plan_copy). Rows are whole KV blocks, so 4-byte aligned.
    fn plan_ring_copy(&self, copy: &KvCopy) -> impl Fn(usize) -> CopyPlan {
        let l = self.layout;
        let elem = self.layers.first().map_or(4, |(k, _)| k.dtype().size());
        let (from, to, tokens) = (copy.from as u64, copy.to as u64, copy.tokens);
        move |rows: usize| {
            let slot = (l.kv_heads * rows * l.head_dim * elem) as u64;
            let ranges = if tokens == 0 {
                Vec::new()
            } else {
                vec![(from * slot, to * slot, slot)]
            };
            CopyPlan { ranges }
        }
    }

    /// [`apply_edits`](Self::apply_edits) in a submission of their own (none when there
    /// is nothing to do): queue order puts them after every earlier submission on this
    /// device and before every later one.
    pub fn submit_edits(&mut self, gpu: &Gpu, edits: (&[SlotTable], &[KvCopy])) -> Result<()> {
        if edits.0.is_empty() && edits.1.is_empty() {
            return Ok(());
        }
        let mut enc = gpu.encoder();
        self.apply_edits(gpu, &mut enc, edits)?;
        gpu.submit(enc);
        Ok(())
    }

    /// Byte ranges of `copy` in one layer's buffer under the block tables `mirror`, checked
    /// against the cache and wgpu's 4-byte copy alignment.
    fn plan_copy(&self, mirror: &[u32], copy: &KvCopy) -> Result<CopyPlan> {
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
        let position = (l.head_dim * elem) as u64;
        let head = l.max_seq as u64 * position;
        let bps = blocks_per_slot(l.max_seq);
        // Byte offset of logical position `pos` (a block's first) of head `h` of `slot`.
        let at = |slot: usize, h: usize, pos: usize| {
            let b = mirror[slot * bps + pos / KV_BLOCK] as usize;
            (b / bps * l.kv_heads + h) as u64 * head + ((b % bps) * KV_BLOCK) as u64 * position
        };
        let mut ranges: Vec<(u64, u64, u64)> = Vec::new();
        for h in 0..l.kv_heads {
            for start in (0..tokens.min(l.max_seq)).step_by(KV_BLOCK) {
                let n = (tokens - start).min(KV_BLOCK) as u64;
                let (from, to) = (at(copy.from, h, start), at(copy.to, h, start));
                match ranges.last_mut() {
                    // Runs contiguous in both slots travel as one copy.
                    Some(r) if r.0 + r.2 == from && r.1 + r.2 == to => r.2 += n * position,
                    _ => ranges.push((from, to, n * position)),
                }
            }
        }
        let aligned = (ranges.iter()).all(|&(f, t, b)| (f | t | b).is_multiple_of(4));
        if tokens > l.max_seq || !aligned {
            // `copy.check` above refused every copy and layout that could land here.
            return Err(WgparError::Internal(format!(
                "KV copy of {tokens} positions of {} x {} bytes is not 4-byte aligned",
                l.head_dim, elem
            )));
        }
        Ok(CopyPlan { ranges })
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
                let address = KvAddress {
                    blocks: Some(&self.blocks),
                    ring: self.rings.get(i).copied().flatten(),
                };
                Ok(KvLayer {
                    store: KvStore::bind_paged(
                        gpu,
                        &mut params,
                        (&a.k, &a.v),
                        (cache, address),
                        &capacity,
                    )?,
                    attend: Attention::bind_paged(
                        gpu,
                        &mut params,
                        (&a.q, cache, &a.attn),
                        address,
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
