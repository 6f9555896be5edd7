//! FLOPs and bytes of the blocks one device runs, for timeline spans (the projection's
//! roofline reads them) and for the accounting engines print. A sliding-window layer (Gemma 3)
//! is charged the keys it attends (at most its window a query), and the elementwise passes a
//! model adds to the Llama block (output norms, the embedding scale, the final soft-cap) are
//! charged as the block's other elementwise kernels are: a launch each and a read and write of
//! the row they pass over.

use std::ops::Range;

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

/// Keys one sequence's queries at positions `past..past + seq` attend, summed: position `p`
/// sees `p + 1` keys, at most `window` on a sliding-window layer.
pub fn keys_attended(past: usize, seq: usize, window: Option<usize>) -> u64 {
    // Keys of positions 0..n, summed.
    let upto = |n: u64| match window.map(|w| w as u64) {
        Some(w) if n > w => w * (w + 1) / 2 + (n - w) * w,
        _ => n * (n + 1) / 2,
    };
    upto((past + seq) as u64) - upto(past as u64)
}

/// Bytes and launches of the model's extra elementwise passes over `rows` rows of `width`
/// (f32, read and written in place), when `on`.
fn passes(on: bool, rows: usize, width: usize) -> (u64, u32) {
    match on {
        true => (2 * 4 * (rows * width) as u64, 1),
        false => (0, 0),
    }
}

/// Attention half of a layer that attends the whole context (every layer but a sliding one):
/// see [`layer_attention`].
pub fn attention(config: &ModelConfig, shard: &ShardSpec, step: &Step, dtype: DType) -> BlockCost {
    attention_over(config, shard, step, dtype, None)
}

/// Attention half of layer `layer` on a shard: norm, Q/K/V, RoPE, cache append, attention
/// over the keys the layer attends (its window on a sliding layer), output projection, and
/// the output norm where the model has one.
pub fn layer_attention(
    config: &ModelConfig,
    shard: &ShardSpec,
    step: &Step,
    dtype: DType,
    layer: usize,
) -> BlockCost {
    attention_over(config, shard, step, dtype, config.layer_window(layer))
}

/// [`layer_attention`] for a layer whose queries see at most `window` keys.
fn attention_over(
    config: &ModelConfig,
    shard: &ShardSpec,
    step: &Step,
    dtype: DType,
    window: Option<usize>,
) -> BlockCost {
    let t = step.tokens() as u64;
    let h = config.hidden as u64;
    let d = config.head_dim as u64;
    let q = shard.local_heads() as u64 * d;
    let kv = shard.local_kv_heads() as u64 * d;
    // Keys attended per token, summed over the step's positions.
    let ctx = keys_attended(step.past, step.seq, window) * step.batch as u64;
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
    let (norm_bytes, norm) = passes(config.sandwich_norms, step.tokens(), config.hidden);
    BlockCost {
        flops: proj + attn,
        bytes: weights + cache + acts + norm_bytes,
        kernels: 8 + qk_norms + rope + bias + norm,
    }
}

/// MLP half of a layer on a shard: norm, up (and gate), activation, down, and the output norm
/// where the model has one.
pub fn mlp(config: &ModelConfig, shard: &ShardSpec, step: &Step, dtype: DType) -> BlockCost {
    let t = step.tokens() as u64;
    let h = config.hidden as u64;
    let f = shard.local_ffn() as u64;
    let mats = if config.arch == crate::model::Arch::Llama {
        3
    } else {
        2
    };
    let (norm_bytes, norm) = passes(config.sandwich_norms, step.tokens(), config.hidden);
    // norm, up (gate), activation, down, (bias), residual, (output norm).
    BlockCost {
        flops: 2 * t * h * f * mats,
        bytes: mats * h * f * wbytes(dtype) + 4 * t * (3 * h + 3 * f) + norm_bytes,
        kernels: 3 + mats as u32 + u32::from(config.arch != crate::model::Arch::Llama) + norm,
    }
}

/// Final norm and LM head over each sequence's last token, and the final soft-cap over the
/// logits where the model has one.
pub fn head(config: &ModelConfig, batch: usize, dtype: DType) -> BlockCost {
    let (b, h, v) = (batch as u64, config.hidden as u64, config.vocab as u64);
    let (cap_bytes, cap) = passes(config.final_softcap.is_some(), batch, config.vocab);
    // last-row copies, norm, LM head, (soft-cap).
    BlockCost {
        flops: 2 * b * h * v,
        bytes: v * h * wbytes(dtype) + 4 * b * (2 * h + v) + cap_bytes,
        kernels: 2 + batch as u32 + cap,
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

/// Embedding lookup, and its scale where the model has one.
pub fn embed(config: &ModelConfig, step: &Step) -> BlockCost {
    let t = step.tokens() as u64;
    let (scale_bytes, scale) = passes(config.embed_scale.is_some(), step.tokens(), config.hidden);
    BlockCost {
        flops: 0,
        bytes: 4 * t * config.hidden as u64 * 3 + scale_bytes,
        kernels: 1 + scale,
    }
}

/// Everything one device does for a step: the sum over its `layers` (and embedding/head).
pub fn total(
    config: &ModelConfig,
    shard: &ShardSpec,
    layers: Range<usize>,
    step: &Step,
    dtype: DType,
    with_embedding: bool,
    with_head: bool,
) -> BlockCost {
    let m = mlp(config, shard, step, dtype);
    let mut c = BlockCost::default();
    for layer in layers {
        let a = layer_attention(config, shard, step, dtype, layer);
        c.flops += a.flops + m.flops;
        c.bytes += a.bytes + m.bytes;
        c.kernels += a.kernels + m.kernels;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn full(c: &ModelConfig) -> ShardSpec {
        ShardSpec::full(c)
    }

    #[test]
    fn keys_attended_counts_each_position_within_its_window() {
        for (past, seq) in [(0, 1), (0, 9), (3, 1), (4, 7), (11, 20), (0, 40)] {
            for window in [None, Some(1), Some(5), Some(64)] {
                let want: u64 = (past..past + seq)
                    .map(|p| window.map_or(p + 1, |w| (p + 1).min(w)) as u64)
                    .sum();
                assert_eq!(
                    keys_attended(past, seq, window),
                    want,
                    "{past} {seq} {window:?}"
                );
            }
        }
    }

    /// Gemma 3 1B at a prefill of 1536 tokens (three windows of 512): its 22 sliding layers
    /// are charged the keys of their window, the 4 global ones the whole context.
    #[test]
    fn sliding_layers_cost_their_window_and_nothing_else_changes() {
        let g = ModelConfig::gemma3_1b();
        let off = ModelConfig {
            sliding: None,
            ..g.clone()
        };
        let step = Step {
            batch: 2,
            seq: 1536,
            past: 0,
        };
        let cost = |c: &ModelConfig| total(c, &full(c), 0..c.layers, &step, DType::F16, true, true);
        let (windowed, whole) = (cost(&g), cost(&off));
        // Per sliding layer and sequence, 1536 x 1537 / 2 keys become 512 x 513 / 2 + 1024 x 512.
        let saved = (1536 * 1537 / 2 - (512 * 513 / 2 + 1024 * 512)) * 2 * 22;
        let (q, kv) = (
            (g.heads * g.head_dim) as u64,
            (g.kv_heads * g.head_dim) as u64,
        );
        assert_eq!(whole.flops - windowed.flops, 4 * saved * q);
        assert_eq!(whole.bytes - windowed.bytes, 2 * saved * kv * 4);
        assert_eq!(whole.kernels, windowed.kernels);
        // Within the window the two agree.
        let short = Step { seq: 512, ..step };
        let at = |c: &ModelConfig| total(c, &full(c), 0..c.layers, &short, DType::F16, true, true);
        assert_eq!(at(&g), at(&off));
        // A global layer is charged the whole context either way.
        assert_eq!(
            layer_attention(&g, &full(&g), &step, DType::F16, 5),
            attention(&off, &full(&off), &step, DType::F16)
        );
    }

    /// Output norms, the embedding scale and the soft-cap: a launch each and a read and write
    /// of their rows (f32).
    #[test]
    fn gemma_elementwise_passes_are_charged() {
        let g = ModelConfig {
            final_softcap: Some(30.0),
            ..ModelConfig::gemma3_1b()
        };
        let plain = ModelConfig {
            sandwich_norms: false,
            embed_scale: None,
            final_softcap: None,
            ..g.clone()
        };
        let step = Step {
            batch: 3,
            seq: 5,
            past: 2,
        };
        let (t, h, v) = (15u64, g.hidden as u64, g.vocab as u64);
        let pass = |rows: u64, width: u64| BlockCost {
            flops: 0,
            bytes: 8 * rows * width,
            kernels: 1,
        };
        let diff = |a: BlockCost, b: BlockCost| BlockCost {
            flops: a.flops - b.flops,
            bytes: a.bytes - b.bytes,
            kernels: a.kernels - b.kernels,
        };
        let (s, d) = (full(&g), DType::F16);
        let half = |c: &ModelConfig| layer_attention(c, &s, &step, d, 0);
        assert_eq!(diff(half(&g), half(&plain)), pass(t, h));
        assert_eq!(
            diff(mlp(&g, &s, &step, d), mlp(&plain, &s, &step, d)),
            pass(t, h)
        );
        assert_eq!(diff(embed(&g, &step), embed(&plain, &step)), pass(t, h));
        assert_eq!(diff(head(&g, 3, d), head(&plain, 3, d)), pass(3, v));
    }

    /// A Llama model is charged as before: every layer as [`attention`], the total their sum.
    #[test]
    fn llama_layers_are_charged_alike() {
        let c = ModelConfig::preset("llama-1b").unwrap();
        let step = Step {
            batch: 2,
            seq: 7,
            past: 30,
        };
        let (s, d) = (full(&c), DType::F16);
        let a = attention(&c, &s, &step, d);
        for l in 0..c.layers {
            assert_eq!(layer_attention(&c, &s, &step, d, l), a);
        }
        let m = mlp(&c, &s, &step, d);
        let t = total(&c, &s, 2..6, &step, d, false, false);
        assert_eq!(t.flops, 4 * (a.flops + m.flops));
        assert_eq!(t.bytes, 4 * (a.bytes + m.bytes));
        assert_eq!(t.kernels, 4 * (a.kernels + m.kernels));
        // The old sum over positions, written out.
        let ctx: u64 = (0..7u64).map(|i| 30 + i + 1).sum::<u64>() * 2;
        let q = (c.heads * c.head_dim) as u64;
        let proj = 2 * 14 * c.hidden as u64 * (q + 2 * (c.kv_heads * c.head_dim) as u64)
            + 2 * 14 * q * c.hidden as u64;
        assert_eq!(a.flops, proj + 4 * ctx * q);
    }
}
