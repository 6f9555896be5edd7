//! Timelines of configurations that cannot run here (a 70B model on eight GPUs): the spans an
//! engine would record for its steps, built from the model's shapes, the shard specs,
//! partitions and schedules of the real engines, and the engine's formats (weights, KV cache,
//! attention tiling), with nominal times in schedule order that the projection replaces.
//! Figures from these are labelled "modeled" wherever they appear. A sliding-window layer
//! (Gemma 3) is charged the keys its window holds, and the elementwise passes a model adds to
//! the Llama block (output norms, embedding scale, final soft-cap) as the block's own
//! elementwise kernels are: a launch and a read and write of the rows each.

use crate::error::{Result, WgparError};
use crate::model::{Arch, ModelConfig, ShardSpec, Step};
use crate::parallel::cost::{keys_attended, BlockCost};
use crate::parallel::{partition, split_groups, Partition, PartitionSpec, Strategy};
use crate::sim::{Engine, NumFormat};
use crate::trace::{CollectiveOp, HeadWork, KernelFamily, SpanAttrs, SpanId, Timeline};

/// What a modeled step stores and streams, per element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Formats {
    /// Bytes per weight.
    pub weight: f64,
    /// Bytes per cached key or value.
    pub kv: f64,
    /// Bytes per activation element in device memory.
    pub activation: f64,
    /// Query tokens per pass over the KV cache (1: every token streams its context).
    pub query_block: usize,
    /// Logits go back to the host (`false`: tokens are sampled on the device).
    pub logits_to_host: bool,
}

impl Formats {
    /// The formats of `engine` with weights stored as `weights`.
    pub fn of(engine: &Engine, weights: NumFormat) -> Formats {
        Formats {
            weight: weights.bytes(),
            kv: engine.compute.kv_dtype.bytes(),
            activation: engine.wire.dtype.bytes().max(engine.compute.dtype.bytes()),
            query_block: engine.compute.attention_query_block.max(1) as usize,
            logits_to_host: !engine.compute.sample_on_device,
        }
    }
}

fn b(x: f64) -> u64 {
    x.round() as u64
}

/// Bytes and launches of an elementwise pass over `rows` rows of `width`, read and written in
/// place, when `on`.
fn pass(on: bool, rows: usize, width: usize, f: &Formats) -> (f64, u32) {
    match on {
        true => (2.0 * (rows * width) as f64 * f.activation, 1),
        false => (0.0, 0),
    }
}

/// Attention projections of layer `layer`'s first half on a shard: norm, Q/K/V, RoPE, output
/// projection, bias, output norm (Gemma 3) and residual. Layer 0's also carries the embedding
/// scale (Gemma 3): the lookup itself is no modeled span, and the scale is the first pass over
/// its rows on the device that holds the layer.
pub fn attention_projections(
    config: &ModelConfig,
    shard: &ShardSpec,
    step: &Step,
    f: &Formats,
    layer: usize,
) -> BlockCost {
    let t = step.tokens() as f64;
    let h = config.hidden as f64;
    let d = config.head_dim as f64;
    let q = shard.local_heads() as f64 * d;
    let kv = shard.local_kv_heads() as f64 * d;
    let flops = 2.0 * t * h * (q + 2.0 * kv) + 2.0 * t * q * h;
    let weights = (h * (q + 2.0 * kv) + q * h) * f.weight;
    let acts = t * (3.0 * h + 2.0 * q + 2.0 * kv) * f.activation;
    let rope = if config.arch == Arch::Llama { 2 } else { 0 };
    let qk_norms = if config.qk_norm { 2 } else { 0 };
    let bias = u32::from(config.arch != Arch::Llama);
    let tokens = step.tokens();
    let (norm_bytes, norm) = pass(config.sandwich_norms, tokens, config.hidden, f);
    let scaled = layer == 0 && config.embed_scale.is_some();
    let (scale_bytes, scale) = pass(scaled, tokens, config.hidden, f);
    BlockCost {
        flops: b(flops),
        bytes: b(weights + acts + norm_bytes + scale_bytes),
        // (embedding scale), norm, Q, K, V, (2 Q/K head norms), (2 RoPE), output projection,
        // (bias), (output norm), residual.
        kernels: 6 + qk_norms + rope + bias + norm + scale,
    }
}

/// Attention over the KV cache of layer `layer` on a shard: the cache append and the score and
/// value products. A pass reads the cached keys and values its block of `query_block` tokens
/// attends, from the first query's earliest key to the last query, so a per-token kernel reads
/// each query's keys and a flash kernel each tile's; a sliding-window layer's queries attend
/// at most its window.
pub fn attention_core(
    config: &ModelConfig,
    shard: &ShardSpec,
    step: &Step,
    f: &Formats,
    layer: usize,
) -> BlockCost {
    let d = config.head_dim as f64;
    let q = shard.local_heads() as f64 * d;
    let kv = shard.local_kv_heads() as f64 * d;
    let seq = step.seq as f64;
    let window = config.layer_window(layer);
    // Keys attended, summed over the step's query positions, per sequence.
    let ctx = keys_attended(step.past, step.seq, window) as f64;
    // Keys read, summed over the passes of one sequence: a pass over positions first..=last
    // reads keys from first + 1 - window (or 0) to last.
    let qb = f.query_block.max(1);
    let passes = step.seq.div_ceil(qb);
    let read: f64 = (0..passes)
        .map(|j| {
            let (first, last) = (
                step.past + j * qb,
                step.past + ((j + 1) * qb).min(step.seq) - 1,
            );
            window.map_or(last + 1, |w| (last + 1).min(last - first + w)) as f64
        })
        .sum();
    let batch = step.batch as f64;
    let flops = 4.0 * batch * ctx * q;
    let cache = batch * 2.0 * kv * f.kv * (read + seq);
    let acts = step.tokens() as f64 * 2.0 * q * f.activation;
    BlockCost {
        flops: b(flops),
        bytes: b(cache + acts),
        // cache append, attention.
        kernels: 2,
    }
}

/// MLP half of a layer on a shard: norm, up (and gate), activation, down, bias, output norm
/// (Gemma 3), residual.
pub fn mlp(config: &ModelConfig, shard: &ShardSpec, step: &Step, f: &Formats) -> BlockCost {
    let t = step.tokens() as f64;
    let h = config.hidden as f64;
    let ffn = shard.local_ffn() as f64;
    let mats = if config.arch == Arch::Llama { 3.0 } else { 2.0 };
    let (norm_bytes, norm) = pass(config.sandwich_norms, step.tokens(), config.hidden, f);
    BlockCost {
        flops: b(2.0 * t * h * ffn * mats),
        bytes: b(mats * h * ffn * f.weight + t * (3.0 * h + 3.0 * ffn) * f.activation + norm_bytes),
        kernels: 3 + mats as u32 + u32::from(config.arch != Arch::Llama) + norm,
    }
}

/// Name of the modeled span of the final norm and LM head.
const HEAD: &str = "head";

/// Final norm and LM head over each sequence's last token, and the final soft-cap of the
/// logits where the model has one.
pub fn head(config: &ModelConfig, batch: usize, f: &Formats) -> BlockCost {
    let (bt, h, v) = (batch as f64, config.hidden as f64, config.vocab as f64);
    let (cap_bytes, cap) = pass(config.final_softcap.is_some(), batch, config.vocab, f);
    BlockCost {
        flops: b(2.0 * bt * h * v),
        bytes: b(v * h * f.weight + bt * (2.0 * h + v) * f.activation + cap_bytes),
        // last-row copies, norm, LM head, (soft-cap).
        kernels: 2 + batch as u32 + cap,
    }
}

/// Appends spans at increasing nominal times (1 µs apart), so recorded order is schedule order.
struct Builder {
    timeline: Timeline,
    clock_us: f64,
    group: u64,
    /// Hidden width of the model the compute spans run (see `Span::width`).
    width: usize,
}

impl Builder {
    fn push(&mut self, attrs: SpanAttrs) -> SpanId {
        let id = self.timeline.push_us(attrs, self.clock_us, 1.0);
        self.clock_us += 1.0;
        id
    }

    /// A compute span of `k` on device `dev`, after `deps`, in layer `layer` of micro-batch
    /// `mb`.
    fn compute(&mut self, dev: u32, k: Kernel, deps: &[SpanId], (layer, mb): Place) -> SpanId {
        let c = k.cost;
        let mut a = SpanAttrs::compute(k.name, dev)
            .flops(c.flops)
            .bytes(c.bytes)
            .kernels(c.kernels)
            .family(k.family)
            .blocks_of(self.width, k.shards)
            .after_all(deps);
        if let Some(l) = layer {
            a = a.layer(l as u32);
        }
        if let Some(m) = mb {
            a = a.microbatch(m);
        }
        // The head span is all head, which a profile with a measured head rate prices so.
        if k.name == HEAD {
            a = a.head_part(HeadWork {
                flops: c.flops,
                bytes: c.bytes,
            });
        }
        self.push(a)
    }
}

/// What a modeled compute span runs: its name, cost, kernel family, and the number of
/// shards its matrices are split into.
struct Kernel {
    name: &'static str,
    cost: BlockCost,
    family: KernelFamily,
    shards: usize,
}

/// Where a span sits: its layer (none for the head) and micro-batch.
type Place = (Option<usize>, Option<u32>);

/// One tensor-parallel group of a modeled step: the model, each rank's shard and device, the
/// micro-batch's step and formats.
struct Group<'a> {
    config: &'a ModelConfig,
    shards: &'a [ShardSpec],
    devices: &'a [u32],
    step: &'a Step,
    formats: &'a Formats,
    mb: Option<u32>,
}

fn pipeline_partition(
    spec: &PartitionSpec,
    layers: usize,
    stages: usize,
) -> Result<Vec<std::ops::Range<usize>>> {
    match spec {
        PartitionSpec::Even => partition(layers, stages, &Partition::Even),
        PartitionSpec::Explicit(v) => partition(layers, stages, &Partition::Explicit(v.clone())),
        PartitionSpec::Balanced | PartitionSpec::BalancedWithin(_) => Err(WgparError::unsupported(
            "a balanced partition needs measured stage costs: model it as even or explicit".into(),
        )),
    }
}

/// One tensor-parallel group running `layers` for one micro-batch: per layer, each rank's
/// attention projections, attention and MLP, with an all-reduce of the group after the
/// attention and after the MLP. Returns each rank's last span. `last` adds the head (rank 0).
fn tp_block(
    b: &mut Builder,
    g: &Group<'_>,
    layers: std::ops::Range<usize>,
    deps: &[Vec<SpanId>],
    last: bool,
) -> Vec<SpanId> {
    let mut prev: Vec<Vec<SpanId>> = deps.to_vec();
    for layer in layers {
        for half in [Half::Attention, Half::Mlp] {
            let ends: Vec<SpanId> = (0..g.shards.len())
                .map(|r| g.rank_half(b, r, (layer, half), &prev[r]))
                .collect();
            if g.shards.len() > 1 {
                prev = g.all_reduce(b, layer, &ends);
            } else {
                prev[0] = vec![ends[0]];
            }
        }
    }
    let mut out: Vec<SpanId> = prev
        .iter()
        .map(|p| p.last().copied().unwrap_or(SpanId::NONE))
        .collect();
    if last {
        let k = Kernel {
            name: HEAD,
            cost: head(g.config, g.step.batch, g.formats),
            family: KernelFamily::Matmul,
            // The head is one device's whole matrix.
            shards: 1,
        };
        out[0] = b.compute(g.devices[0], k, &prev[0], (None, g.mb));
    }
    out
}

/// The two halves of a layer, each ending in the group's all-reduce.
#[derive(Clone, Copy, PartialEq)]
enum Half {
    Attention,
    Mlp,
}

impl Group<'_> {
    /// Rank `r`'s compute spans of one half of a layer, after `prev`; returns its last span.
    fn rank_half(
        &self,
        b: &mut Builder,
        r: usize,
        (layer, half): (usize, Half),
        prev: &[SpanId],
    ) -> SpanId {
        let (config, step, f) = (self.config, self.step, self.formats);
        let shard = &self.shards[r];
        let dev = self.devices[r];
        let kernel = |name, cost, family| Kernel {
            name,
            cost,
            family,
            shards: shard.world,
        };
        let at = (Some(layer), self.mb);
        match half {
            Half::Attention => {
                let projections = attention_projections(config, shard, step, f, layer);
                let p = b.compute(
                    dev,
                    kernel("attention.projections", projections, KernelFamily::Matmul),
                    prev,
                    at,
                );
                let core = attention_core(config, shard, step, f, layer);
                b.compute(
                    dev,
                    kernel("attention", core, KernelFamily::Attention),
                    &[p],
                    at,
                )
            }
            Half::Mlp => {
                let cost = mlp(config, shard, step, f);
                b.compute(dev, kernel("mlp", cost, KernelFamily::Matmul), prev, at)
            }
        }
    }

    /// The group's all-reduce after each rank's `ends`: the span each rank waits on next.
    fn all_reduce(&self, b: &mut Builder, layer: usize, ends: &[SpanId]) -> Vec<Vec<SpanId>> {
        let world = self.shards.len() as u32;
        // Recorded as f32 payloads; each engine scales them to its wire format.
        let bytes = (self.step.tokens() * self.config.hidden * 4) as u64;
        let group = b.group;
        b.group += 1;
        ends.iter()
            .enumerate()
            .map(|(r, &c)| {
                // "auto": each engine runs its preferred collective on the machine.
                let mut a = SpanAttrs::collective(
                    "allreduce",
                    self.devices[r],
                    CollectiveOp::AllReduce,
                    "auto",
                    world,
                    bytes,
                )
                .layer(layer as u32)
                .group(group)
                .after(c);
                if let Some(k) = self.mb {
                    a = a.microbatch(k);
                }
                vec![b.push(a)]
            })
            .collect()
    }
}

/// Tensor-parallel degree, pipeline stages, micro-batches and partition of a strategy on
/// `devices` devices.
pub fn shape_of(
    strategy: &Strategy,
    devices: usize,
) -> Result<(usize, usize, usize, PartitionSpec)> {
    let (tp, pp, m, spec) = match strategy {
        Strategy::Single => (1, 1, 1, PartitionSpec::Even),
        Strategy::Tensor { .. } => (devices, 1, 1, PartitionSpec::Even),
        Strategy::Pipeline {
            partition,
            micro_batches,
            ..
        } => (1, devices, *micro_batches, partition.clone()),
        Strategy::Hybrid {
            tp,
            partition,
            micro_batches,
            ..
        } => (
            *tp,
            devices / (*tp).max(1),
            *micro_batches,
            partition.clone(),
        ),
    };
    if tp * pp != devices || tp == 0 {
        return Err(WgparError::unsupported(format!(
            "{devices} devices do not fit {strategy}"
        )));
    }
    Ok((tp, pp, m.max(1), spec))
}

/// The modeled timeline of `steps` consecutive forward steps (the first is `step`; later ones
/// are decode steps of one token) for `strategy` on `devices` devices, in `formats`. Device `i`
/// of the timeline is device `i` of the profile it is projected onto: stage `s`, rank `r` is
/// device `s * tp + r`.
pub fn modeled_timeline(
    strategy: &Strategy,
    devices: usize,
    config: &ModelConfig,
    formats: &Formats,
    step: Step,
    steps: usize,
) -> Result<Timeline> {
    let mut b = Builder {
        timeline: Timeline::new(),
        clock_us: 0.0,
        group: 0,
        width: config.hidden,
    };
    let (tp, pp, m, spec) = shape_of(strategy, devices)?;
    let split = match strategy {
        Strategy::Tensor { split: Some(s) } => s.clone(),
        _ => vec![1; tp],
    };
    let shards = ShardSpec::tensor_parallel(config, &split)?;
    let ranges = pipeline_partition(&spec, config.layers, pp)?;
    let groups = split_groups(step.batch, m);
    // Per micro-batch: the span that returned its last output (the next step waits on it).
    let mut returned: Vec<SpanId> = vec![SpanId::NONE; groups.len()];
    let mut past = step.past;
    for s in 0..steps.max(1) {
        let seq = if s == 0 { step.seq } else { 1 };
        for (g, range) in groups.iter().enumerate() {
            let pass = Pass {
                config,
                shards: &shards,
                formats,
                step: Step {
                    batch: range.len(),
                    seq,
                    past,
                },
                mb: (groups.len() > 1 || pp > 1).then_some(g as u32),
            };
            returned[g] = pass.through(&mut b, &ranges, returned[g]);
        }
        past += seq;
    }
    Ok(b.timeline)
}

/// One micro-batch of one step passing through every pipeline stage.
struct Pass<'a> {
    config: &'a ModelConfig,
    shards: &'a [ShardSpec],
    formats: &'a Formats,
    step: Step,
    mb: Option<u32>,
}

impl Pass<'_> {
    /// Pushes the pass's spans, stage after stage, after `after`; returns the span that
    /// brought its output back from the last stage (`after` when there is no stage).
    fn through(&self, b: &mut Builder, ranges: &[std::ops::Range<usize>], after: SpanId) -> SpanId {
        let tp = self.shards.len();
        let mut returned = after;
        let mut deps: Vec<Vec<SpanId>> = vec![vec![after]; tp];
        for (stage, layers) in ranges.iter().enumerate() {
            let devs: Vec<u32> = (0..tp).map(|r| (stage * tp + r) as u32).collect();
            if stage > 0 {
                deps = self.inputs(b, &devs, &deps);
            }
            let last_stage = stage + 1 == ranges.len();
            let group = Group {
                config: self.config,
                shards: self.shards,
                devices: &devs,
                step: &self.step,
                formats: self.formats,
                mb: self.mb,
            };
            let ends = tp_block(b, &group, layers.clone(), &deps, last_stage);
            let d2h = self.output(b, devs[0], ends[0], last_stage);
            deps = vec![vec![d2h]; tp];
            if last_stage {
                returned = d2h;
            }
        }
        returned
    }

    /// Bytes of the hidden state between stages (f32).
    fn hidden_bytes(&self) -> u64 {
        (self.step.tokens() * self.config.hidden * 4) as u64
    }

    /// Each rank of a later stage receives the activations, after its `deps`.
    fn inputs(&self, b: &mut Builder, devs: &[u32], deps: &[Vec<SpanId>]) -> Vec<Vec<SpanId>> {
        devs.iter()
            .zip(deps)
            .map(|(&dev, after)| {
                let mut a =
                    SpanAttrs::h2d("activations", dev, self.hidden_bytes()).after_all(after);
                if let Some(k) = self.mb {
                    a = a.microbatch(k);
                }
                vec![b.push(a)]
            })
            .collect()
    }

    /// A stage's output goes back to the host from rank 0: activations, or the logits (a
    /// token id per sequence when sampled on the device) after the last stage.
    fn output(&self, b: &mut Builder, dev: u32, end: SpanId, last_stage: bool) -> SpanId {
        let out_bytes = match (last_stage, self.formats.logits_to_host) {
            (true, true) => (self.step.batch * self.config.vocab * 4) as u64,
            // Sampled on the device: one token id per sequence comes back.
            (true, false) => (self.step.batch * 4) as u64,
            (false, _) => self.hidden_bytes(),
        };
        let name = if last_stage { "output" } else { "activations" };
        let mut a = SpanAttrs::d2h(name, dev, out_bytes).after(end);
        if let Some(k) = self.mb {
            a = a.microbatch(k);
        }
        b.push(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DType;
    use crate::parallel::cost;

    fn llama() -> ModelConfig {
        ModelConfig::preset("llama-1b").unwrap()
    }

    fn wgpar_f16() -> Formats {
        Formats {
            weight: 2.0,
            kv: 4.0,
            activation: 4.0,
            query_block: 1,
            logits_to_host: true,
        }
    }

    #[test]
    fn tensor_parallel_has_two_allreduces_per_layer_per_rank() {
        let c = llama();
        let step = Step {
            batch: 2,
            seq: 8,
            past: 0,
        };
        let tl = modeled_timeline(
            &Strategy::Tensor { split: None },
            4,
            &c,
            &wgpar_f16(),
            step,
            1,
        )
        .unwrap();
        let collectives = tl.spans.iter().filter(|s| s.collective.is_some()).count();
        assert_eq!(collectives, 2 * c.layers * 4);
        let flops: u64 = tl.spans.iter().map(|s| s.flops).sum();
        let single = cost::total(
            &c,
            &ShardSpec::full(&c),
            0..c.layers,
            &step,
            DType::F16,
            false,
            true,
        );
        // Shards add up to the whole model's work, as the engines' own accounting counts it.
        let rel = (flops as f64 - single.flops as f64).abs() / single.flops as f64;
        assert!(rel < 1e-9, "{flops} vs {}", single.flops);
        // Compute spans record the model's width and their 4 shards; the head, one device's
        // whole matrix, 1.
        for s in tl.spans.iter().filter(|s| s.flops > 0) {
            let shards = if s.name == "head" { 1 } else { 4 };
            assert_eq!(
                (s.width, s.shards),
                (Some(c.hidden as u32), shards),
                "{}",
                s.name
            );
            // Only the head span is marked as head work, all of it.
            let head = (s.name == "head").then_some(HeadWork {
                flops: s.flops,
                bytes: s.bytes,
            });
            assert_eq!(s.head, head, "{}", s.name);
        }
    }

    #[test]
    fn flash_tiles_read_the_cache_once_per_tile() {
        let c = llama();
        let shard = ShardSpec::full(&c);
        let step = Step {
            batch: 1,
            seq: 256,
            past: 0,
        };
        let per_token = attention_core(&c, &shard, &step, &wgpar_f16(), 0);
        let tiled = attention_core(
            &c,
            &shard,
            &step,
            &Formats {
                query_block: 128,
                ..wgpar_f16()
            },
            0,
        );
        assert_eq!(per_token.flops, tiled.flops);
        // Per token: sum over 256 positions of (i + 1) keys; tiled: 128 + 256 keys.
        let kv = (c.kv_heads * c.head_dim) as f64;
        let cache = |read: f64| (2.0 * kv * 4.0 * (read + 256.0)) as u64;
        let acts = (256.0 * 2.0 * (c.heads * c.head_dim) as f64 * 4.0) as u64;
        assert_eq!(per_token.bytes, cache(256.0 * 257.0 / 2.0) + acts);
        assert_eq!(tiled.bytes, cache(384.0) + acts);
    }

    /// Gemma 3 1B (window 512): a sliding layer's queries attend and read at most the window,
    /// per token and per 128-token tile; a global layer the whole context.
    #[test]
    fn sliding_layers_attend_and_read_their_window() {
        let c = ModelConfig::gemma3_1b();
        let shard = ShardSpec::full(&c);
        let step = Step {
            batch: 1,
            seq: 1536,
            past: 0,
        };
        let tiled = Formats {
            query_block: 128,
            ..wgpar_f16()
        };
        let (q, kv) = (
            (c.heads * c.head_dim) as f64,
            (c.kv_heads * c.head_dim) as f64,
        );
        let cache = |read: f64| (2.0 * kv * 4.0 * (read + 1536.0)) as u64;
        let acts = (1536.0 * 2.0 * q * 4.0) as u64;
        // Layer 0 slides, layer 5 is global.
        let (sliding, global) = (
            attention_core(&c, &shard, &step, &tiled, 0),
            attention_core(&c, &shard, &step, &tiled, 5),
        );
        let window_keys = 512.0 * 513.0 / 2.0 + 1024.0 * 512.0;
        assert_eq!(sliding.flops, (4.0 * window_keys * q) as u64);
        assert_eq!(global.flops, (4.0 * 1536.0 * 1537.0 / 2.0 * q) as u64);
        // Tiles end at 128, 256, 384, 512 keys, then each of the other 8 reads its 128
        // queries' windows: 127 + 512 keys.
        assert_eq!(sliding.bytes, cache(1280.0 + 8.0 * 639.0) + acts);
        let global_read: f64 = (1..=12).map(|j| 128.0 * j as f64).sum();
        assert_eq!(global.bytes, cache(global_read) + acts);
        let per_token = attention_core(&c, &shard, &step, &wgpar_f16(), 0);
        assert_eq!(per_token.bytes, cache(window_keys) + acts);
    }

    /// The modeled Gemma 3 timeline's work adds up to the engines' own accounting, windows,
    /// output norms, embedding scale and soft-cap included.
    #[test]
    fn a_gemma3_timeline_adds_up_to_the_engines_accounting() {
        let c = ModelConfig {
            final_softcap: Some(30.0),
            ..ModelConfig::gemma3_1b()
        };
        let step = Step {
            batch: 2,
            seq: 1024,
            past: 0,
        };
        // Two pipeline stages: each charges its own layers' windows (Gemma 3 1B's single KV
        // head would be replicated by a tensor split, which the engines' sum does not count).
        let strategy = Strategy::Pipeline {
            partition: PartitionSpec::Even,
            micro_batches: 1,
            schedule: crate::parallel::Schedule::InFlight,
        };
        let tl = modeled_timeline(&strategy, 2, &c, &wgpar_f16(), step, 1).unwrap();
        let flops: u64 = tl.spans.iter().map(|s| s.flops).sum();
        let whole = cost::total(
            &c,
            &ShardSpec::full(&c),
            0..c.layers,
            &step,
            DType::F16,
            false,
            true,
        );
        let rel = (flops as f64 - whole.flops as f64).abs() / whole.flops as f64;
        assert!(rel < 1e-9, "{flops} vs {}", whole.flops);
        // Per rank: 26 layers of two output norms, the embedding scale, and the soft-cap.
        let kernels = |c: &ModelConfig| -> u32 {
            let tl = modeled_timeline(&Strategy::Single, 1, c, &wgpar_f16(), step, 1).unwrap();
            tl.spans.iter().map(|s| s.kernels).sum()
        };
        let plain = ModelConfig {
            sandwich_norms: false,
            embed_scale: None,
            final_softcap: None,
            ..c.clone()
        };
        assert_eq!(kernels(&c) - kernels(&plain), 2 * 26 + 1 + 1);
    }

    #[test]
    fn pipeline_moves_activations_between_stages_per_microbatch() {
        let c = llama();
        let step = Step {
            batch: 8,
            seq: 4,
            past: 0,
        };
        let strategy = Strategy::Pipeline {
            partition: PartitionSpec::Even,
            micro_batches: 4,
            schedule: crate::parallel::Schedule::InFlight,
        };
        let tl = modeled_timeline(&strategy, 4, &c, &wgpar_f16(), step, 3).unwrap();
        let h2d = tl
            .spans
            .iter()
            .filter(|s| s.name == "activations" && s.kind == crate::trace::SpanKind::HostToDevice)
            .count();
        // 3 boundaries x 4 micro-batches x 3 steps.
        assert_eq!(h2d, 3 * 4 * 3);
        assert!(modeled_timeline(&strategy, 3, &c, &wgpar_f16(), step, 1).is_ok());
        let bad = Strategy::Hybrid {
            tp: 2,
            partition: PartitionSpec::Even,
            micro_batches: 1,
            schedule: crate::parallel::Schedule::InFlight,
        };
        assert!(modeled_timeline(&bad, 3, &c, &wgpar_f16(), step, 1).is_err());
    }
}
