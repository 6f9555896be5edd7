//! Timelines of configurations that cannot run here (an 8B model on a CPU driver): the spans
//! an engine would record for a step, built from the same cost functions, shard specs,
//! partitions and schedules, with nominal times in schedule order that the projection
//! replaces. Figures from these are labelled "modeled" wherever they appear.

use crate::device::DType;
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, ShardSpec, Step};
use crate::parallel::cost::{self, BlockCost};
use crate::parallel::{partition, split_groups, Partition, PartitionSpec, Strategy};
use crate::trace::{CollectiveOp, KernelFamily, SpanAttrs, SpanId, Timeline};

/// Appends spans at increasing nominal times (1 µs apart), so recorded order is schedule order.
struct Builder {
    timeline: Timeline,
    clock_us: f64,
    group: u64,
}

impl Builder {
    fn push(&mut self, attrs: SpanAttrs) -> SpanId {
        let id = self.timeline.push_us(attrs, self.clock_us, 1.0);
        self.clock_us += 1.0;
        id
    }

    fn compute(
        &mut self,
        name: &'static str,
        dev: u32,
        c: BlockCost,
        family: KernelFamily,
        deps: &[SpanId],
        mb: Option<u32>,
    ) -> SpanId {
        let mut a = SpanAttrs::compute(name, dev)
            .flops(c.flops)
            .bytes(c.bytes)
            .kernels(c.kernels)
            .family(family)
            .after_all(deps);
        if let Some(k) = mb {
            a = a.microbatch(k);
        }
        self.push(a)
    }
}

fn pipeline_partition(
    spec: &PartitionSpec,
    layers: usize,
    stages: usize,
) -> Result<Vec<std::ops::Range<usize>>> {
    match spec {
        PartitionSpec::Even => partition(layers, stages, &Partition::Even),
        PartitionSpec::Explicit(v) => partition(layers, stages, &Partition::Explicit(v.clone())),
        PartitionSpec::Balanced => Err(WgparError::Config(
            "a balanced partition needs measured stage costs: model it as even or explicit".into(),
        )),
    }
}

/// One tensor-parallel group running `layers` for one micro-batch: per layer, each rank's
/// attention and MLP compute followed by an all-reduce of the group. Returns each rank's last
/// span. `first`/`last` add the embedding and the head (rank 0).
#[allow(clippy::too_many_arguments)]
fn tp_block(
    b: &mut Builder,
    config: &ModelConfig,
    shards: &[ShardSpec],
    devices: &[u32],
    layers: std::ops::Range<usize>,
    step: &Step,
    dtype: DType,
    deps: &[Vec<SpanId>],
    mb: Option<u32>,
    last: bool,
) -> Vec<SpanId> {
    let world = shards.len() as u32;
    let bytes = (step.tokens() * config.hidden * 4) as u64;
    let mut prev: Vec<Vec<SpanId>> = deps.to_vec();
    for layer in layers {
        for half in 0..2 {
            let mut computes = Vec::new();
            for (r, shard) in shards.iter().enumerate() {
                let (c, name, family) = if half == 0 {
                    (
                        cost::attention(config, shard, step, dtype),
                        "attention",
                        KernelFamily::Attention,
                    )
                } else {
                    (
                        cost::mlp(config, shard, step, dtype),
                        "mlp",
                        KernelFamily::Matmul,
                    )
                };
                computes.push(b.compute(name, devices[r], c, family, &prev[r], mb));
            }
            if shards.len() > 1 {
                let group = b.group;
                b.group += 1;
                for (r, &c) in computes.iter().enumerate() {
                    let mut a = SpanAttrs::collective(
                        "allreduce",
                        devices[r],
                        CollectiveOp::AllReduce,
                        "host-staged",
                        world,
                        bytes,
                    )
                    .layer(layer as u32)
                    .group(group)
                    .after(c);
                    if let Some(k) = mb {
                        a = a.microbatch(k);
                    }
                    prev[r] = vec![b.push(a)];
                }
            } else {
                prev[0] = vec![computes[0]];
            }
        }
    }
    let mut out: Vec<SpanId> = prev
        .iter()
        .map(|p| p.last().copied().unwrap_or(SpanId::NONE))
        .collect();
    if last {
        let head = cost::head(config, step.batch, dtype);
        out[0] = b.compute("head", devices[0], head, KernelFamily::Matmul, &prev[0], mb);
    }
    out
}

/// The modeled timeline of `steps` consecutive forward steps (the first is `step`; later ones
/// are decode steps of one token) for `strategy` on `devices` devices.
pub fn modeled_timeline(
    strategy: &Strategy,
    devices: usize,
    config: &ModelConfig,
    dtype: DType,
    step: Step,
    steps: usize,
) -> Result<Timeline> {
    let mut b = Builder {
        timeline: Timeline::new(),
        clock_us: 0.0,
        group: 0,
    };
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
        return Err(WgparError::Config(format!(
            "{devices} devices do not fit {strategy}"
        )));
    }
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
            let mb_step = Step {
                batch: range.len(),
                seq,
                past,
            };
            let mb = (groups.len() > 1 || pp > 1).then_some(g as u32);
            let mut deps: Vec<Vec<SpanId>> = vec![vec![returned[g]]; tp];
            let hidden = (mb_step.tokens() * config.hidden * 4) as u64;
            for (stage, layers) in ranges.iter().enumerate() {
                let devs: Vec<u32> = (0..tp).map(|r| (stage * tp + r) as u32).collect();
                if stage > 0 {
                    for r in 0..tp {
                        let mut a =
                            SpanAttrs::h2d("activations", devs[r], hidden).after_all(&deps[r]);
                        if let Some(k) = mb {
                            a = a.microbatch(k);
                        }
                        deps[r] = vec![b.push(a)];
                    }
                }
                let last_stage = stage + 1 == ranges.len();
                let ends = tp_block(
                    &mut b,
                    config,
                    &shards,
                    &devs,
                    layers.clone(),
                    &mb_step,
                    dtype,
                    &deps,
                    mb,
                    last_stage,
                );
                let out_bytes = if last_stage {
                    (mb_step.batch * config.vocab * 4) as u64
                } else {
                    hidden
                };
                let mut a = SpanAttrs::d2h(
                    if last_stage { "logits" } else { "activations" },
                    devs[0],
                    out_bytes,
                )
                .after(ends[0]);
                if let Some(k) = mb {
                    a = a.microbatch(k);
                }
                let d2h = b.push(a);
                deps = vec![vec![d2h]; tp];
                if last_stage {
                    returned[g] = d2h;
                }
            }
        }
        past += seq;
    }
    Ok(b.timeline)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> ModelConfig {
        ModelConfig::preset("llama-1b").unwrap()
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
            DType::F16,
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
            c.layers,
            &step,
            DType::F16,
            false,
            true,
        );
        // Shards add up to the whole model's work.
        assert_eq!(flops, single.flops);
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
        let tl = modeled_timeline(&strategy, 4, &c, DType::F16, step, 3).unwrap();
        let h2d = tl
            .spans
            .iter()
            .filter(|s| s.name == "activations" && s.kind == crate::trace::SpanKind::HostToDevice)
            .count();
        // 3 boundaries x 4 micro-batches x 3 steps.
        assert_eq!(h2d, 3 * 4 * 3);
        assert!(modeled_timeline(&strategy, 3, &c, DType::F16, step, 1).is_ok());
        let bad = Strategy::Hybrid {
            tp: 2,
            partition: PartitionSpec::Even,
            micro_batches: 1,
            schedule: crate::parallel::Schedule::InFlight,
        };
        assert!(modeled_timeline(&bad, 3, &c, DType::F16, step, 1).is_err());
    }
}
