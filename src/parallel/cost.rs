//! FLOPs and bytes of the blocks one device runs, for timeline spans (the projection's
//! roofline reads them) and for the accounting engines print.

use crate::device::DType;
use crate::model::{ModelConfig, ShardSpec, Step};
use crate::trace::HeadWork;

/// Work of one block on one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockCost {
    /// Floating-point operations (2 per multiply-add).
    pub flops: u64,
    /// Bytes of weights and activations read and written.
    pub bytes: u64,
    /// Kernel launches (the projection charges a launch overhead for each).
    pub kernels: u32,
}

fn wbytes(dtype: DType) -> u64 {
    dtype.size() as u64
}

/// Attention half of a layer on a shard: norm, Q/K/V, RoPE, cache append, attention, output
/// projection.
pub fn attention(config: &ModelConfig, shard: &ShardSpec, step: &Step, dtype: DType) -> BlockCost {
    let t = step.tokens() as u64;
    let h = config.hidden as u64;
    let d = config.head_dim as u64;
    let q = shard.local_heads() as u64 * d;
    let kv = shard.local_kv_heads() as u64 * d;
    // Keys attended per token, summed over the step's positions.
    let ctx: u64 = (0..step.seq as u64)
        .map(|i| step.past as u64 + i + 1)
        .sum::<u64>()
        * step.batch as u64;
    let proj = 2 * t * h * (q + 2 * kv) + 2 * t * q * h;
    let attn = 2 * 2 * ctx * q;
    let weights = (h * (q + 2 * kv) + q * h) * wbytes(dtype);
    let cache = 2 * ctx * kv * 4;
    let acts = 4 * t * (3 * h + 2 * q + 2 * kv);
    // norm, Q, K, V, (2 Q/K head norms), (2 RoPE), cache append, attention, output
    // projection, (bias), residual.
    let rope = if config.arch == crate::model::Arch::Llama {
        2
    } else {
        0
    };
    let qk_norms = if config.qk_norm { 2 } else { 0 };
    let bias = u32::from(config.arch != crate::model::Arch::Llama);
    BlockCost {
        flops: proj + attn,
        bytes: weights + cache + acts,
        kernels: 8 + qk_norms + rope + bias,
    }
}

/// MLP half of a layer on a shard: norm, up (and gate), activation, down.
pub fn mlp(config: &ModelConfig, shard: &ShardSpec, step: &Step, dtype: DType) -> BlockCost {
    let t = step.tokens() as u64;
    let h = config.hidden as u64;
    let f = shard.local_ffn() as u64;
    let mats = if config.arch == crate::model::Arch::Llama {
        3
    } else {
        2
    };
    // norm, up (gate), activation, down, (bias), residual.
    BlockCost {
        flops: 2 * t * h * f * mats,
        bytes: mats * h * f * wbytes(dtype) + 4 * t * (3 * h + 3 * f),
        kernels: 3 + mats as u32 + u32::from(config.arch != crate::model::Arch::Llama),
    }
}

/// Final norm and LM head over each sequence's last token.
pub fn head(config: &ModelConfig, batch: usize, dtype: DType) -> BlockCost {
    let (b, h, v) = (batch as u64, config.hidden as u64, config.vocab as u64);
    // last-row copies, norm, LM head.
    BlockCost {
        flops: 2 * b * h * v,
        bytes: v * h * wbytes(dtype) + 4 * b * (2 * h + v),
        kernels: 2 + batch as u32,
    }
}

/// The LM head's share of the work of the span that holds it ([`crate::trace::Span::head`]):
/// [`head`]'s flops and bytes; `None` for an encoder, whose last block pools instead.
pub fn head_work(config: &ModelConfig, batch: usize, dtype: DType) -> Option<HeadWork> {
    (!config.is_encoder()).then(|| {
        let h = head(config, batch, dtype);
        HeadWork {
            flops: h.flops,
            bytes: h.bytes,
        }
    })
}

/// Embedding lookup.
pub fn embed(config: &ModelConfig, step: &Step) -> BlockCost {
    let t = step.tokens() as u64;
    BlockCost {
        flops: 0,
        bytes: 4 * t * config.hidden as u64 * 3,
        kernels: 1,
    }
}

/// Everything one device does for a step: the sum over its layers (and embedding/head).
pub fn total(
    config: &ModelConfig,
    shard: &ShardSpec,
    layers: usize,
    step: &Step,
    dtype: DType,
    with_embedding: bool,
    with_head: bool,
) -> BlockCost {
    let a = attention(config, shard, step, dtype);
    let m = mlp(config, shard, step, dtype);
    let mut c = BlockCost {
        flops: (a.flops + m.flops) * layers as u64,
        bytes: (a.bytes + m.bytes) * layers as u64,
        kernels: (a.kernels + m.kernels) * layers as u32,
    };
    if with_embedding {
        let e = embed(config, step);
        c.bytes += e.bytes;
        c.kernels += e.kernels;
    }
    if with_head {
        let hc = head(config, step.batch, dtype);
        c.flops += hc.flops;
        c.bytes += hc.bytes;
        c.kernels += hc.kernels;
    }
    c
}
