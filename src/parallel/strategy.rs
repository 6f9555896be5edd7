//! Strategies by name, and building the engine for one: how the CLI, the comparison and the
//! examples all get an engine.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::balance::measure_stage_costs;
use super::partition::Partition;
use super::{Engine, PipelineEngine, Schedule, SingleEngine, StepEngine, TensorParallelEngine};
use crate::comm::CommConfig;
use crate::device::{AdapterDesc, DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{budget, ModelConfig, ModelWeights, Placement, ShardSpec};

/// How layers are assigned to pipeline stages, as the user says it.
#[derive(Debug, Clone, PartialEq)]
pub enum PartitionSpec {
    /// Equal layer counts.
    Even,
    /// Given layer counts.
    Explicit(Vec<usize>),
    /// Measured per-device layer, embedding and head times (for unequal devices).
    Balanced,
    /// As `Balanced`, with stage `s` holding at most `limits[s]` layers: the most its memory
    /// caps allow (`--layers auto` with `--gpu-memory`), so memory bounds the split first and
    /// measured speed chooses within it.
    BalancedWithin(Vec<usize>),
}

/// A way to spread the model over the devices.
#[derive(Debug, Clone, PartialEq)]
pub enum Strategy {
    /// The whole model on the first device.
    Single,
    /// Tensor parallelism over all devices, with relative shares (`None`: even).
    Tensor {
        /// Relative shares per device.
        split: Option<Vec<usize>>,
    },
    /// Pipeline parallelism, one stage per device.
    Pipeline {
        /// Layer assignment.
        partition: PartitionSpec,
        /// Micro-batches per batch.
        micro_batches: usize,
        /// How decode is scheduled (in flight unless asked for GPipe).
        schedule: Schedule,
    },
    /// Pipeline stages that are each a tensor-parallel group of `tp` devices.
    Hybrid {
        /// Devices per stage (tensor-parallel degree).
        tp: usize,
        /// Layer assignment.
        partition: PartitionSpec,
        /// Micro-batches per batch.
        micro_batches: usize,
        /// How decode is scheduled (in flight unless asked for GPipe).
        schedule: Schedule,
    },
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Single => write!(f, "single"),
            Strategy::Tensor { .. } => write!(f, "tp"),
            Strategy::Pipeline {
                micro_batches,
                schedule,
                ..
            } => write!(f, "pp(m={micro_batches}, {schedule})"),
            Strategy::Hybrid {
                tp,
                micro_batches,
                schedule,
                ..
            } => write!(f, "tp{tp}xpp(m={micro_batches}, {schedule})"),
        }
    }
}

/// Builds the engine for `strategy` on `gpus`.
pub fn build_engine(
    strategy: &Strategy,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    comm: &CommConfig,
    probe: (usize, usize),
) -> Result<Box<dyn Engine>> {
    let engine: Box<dyn Engine> = build_step_engine(strategy, gpus, weights, dtype, comm, probe)?;
    Ok(engine)
}

/// Builds the engine for `strategy` on `gpus` as a [`StepEngine`], for continuous batching
/// (every engine is one).
pub fn build_step_engine(
    strategy: &Strategy,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    comm: &CommConfig,
    probe: (usize, usize),
) -> Result<Box<dyn StepEngine>> {
    let first = gpus
        .first()
        .ok_or_else(|| WgparError::option("--devices", "no devices".into()))?;
    Ok(match strategy {
        Strategy::Single => Box::new(SingleEngine::new(first.clone(), weights, dtype)?),
        Strategy::Tensor { split } => Box::new(TensorParallelEngine::new(
            gpus,
            weights,
            dtype,
            split.as_deref(),
            comm.clone(),
        )?),
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => {
            Box::new(build_pipeline(strategy, gpus, weights, dtype, comm, probe)?)
        }
    })
}

/// Builds the pipeline engine for a [`Strategy::Pipeline`] or [`Strategy::Hybrid`], as
/// itself (its schedule, stage statistics and faults are reachable).
pub fn build_pipeline(
    strategy: &Strategy,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    comm: &CommConfig,
    probe: (usize, usize),
) -> Result<PipelineEngine> {
    let mut engine = match strategy {
        Strategy::Pipeline {
            partition,
            micro_batches,
            ..
        } => PipelineEngine::new(
            gpus,
            weights,
            dtype,
            &resolve(partition, gpus, weights, dtype, probe)?,
            *micro_batches,
            comm.clone(),
        )?,
        Strategy::Hybrid {
            tp,
            partition,
            micro_batches,
            ..
        } => {
            // Balance on one device per stage: the stage's devices run shards of the same
            // layers, so the first stands for its group.
            let leaders = stage_leaders(gpus, *tp);
            PipelineEngine::hybrid(
                gpus,
                weights,
                dtype,
                *tp,
                &resolve(partition, &leaders, weights, dtype, probe)?,
                *micro_batches,
                comm.clone(),
            )?
        }
        other => {
            return Err(WgparError::WrongStrategy {
                strategy: other.to_string(),
                expected: "pipeline".into(),
            })
        }
    };
    if let Strategy::Pipeline { schedule, .. } | Strategy::Hybrid { schedule, .. } = strategy {
        engine.set_schedule(*schedule);
    }
    Ok(engine)
}

/// `strategy` with a measured partition (`Balanced`, `BalancedWithin`) resolved on `gpus` into
/// the layer counts it gives, so that what the engine runs is also what accounting and reports
/// see; other strategies unchanged. Measures as building the engine would (one device per
/// stage: a hybrid stage's first device stands for its group).
pub fn with_measured_partition(
    strategy: &Strategy,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    probe: (usize, usize),
) -> Result<Strategy> {
    let (partition, tp) = match strategy {
        Strategy::Pipeline { partition, .. } => (partition, 1),
        Strategy::Hybrid { partition, tp, .. } => (partition, (*tp).max(1)),
        _ => return Ok(strategy.clone()),
    };
    if !matches!(
        partition,
        PartitionSpec::Balanced | PartitionSpec::BalancedWithin(_)
    ) {
        return Ok(strategy.clone());
    }
    let leaders = stage_leaders(gpus, tp);
    let how = resolve(partition, &leaders, weights, dtype, probe)?;
    let ranges = super::partition::partition(weights.config.layers, leaders.len(), &how)?;
    let counts = PartitionSpec::Explicit(ranges.iter().map(|r| r.len()).collect());
    let mut resolved = strategy.clone();
    if let Strategy::Pipeline { partition, .. } | Strategy::Hybrid { partition, .. } = &mut resolved
    {
        *partition = counts;
    }
    Ok(resolved)
}

/// The first device of each stage of `tp` devices: the one a measured partition times for
/// its group (the group's devices run shards of the same layers).
fn stage_leaders(gpus: &[Arc<Gpu>], tp: usize) -> Vec<Arc<Gpu>> {
    gpus.iter().step_by(tp.max(1)).cloned().collect()
}

/// The layer ranges of `p` pipeline stages as `partition` splits them, checked without a
/// device: a balanced partition is sized as an even one (its split is measured later; every
/// layer has the same shapes, so the largest buffer is the same), and one within bounds as
/// the even split within them (any split within the bounds fits: a stage's bytes follow its
/// own layers).
fn stage_ranges(
    config: &ModelConfig,
    p: usize,
    partition: &PartitionSpec,
) -> Result<Vec<Range<usize>>> {
    let how = match partition {
        PartitionSpec::Explicit(v) => Partition::Explicit(v.clone()),
        PartitionSpec::BalancedWithin(most) if most.len() == p => {
            Partition::Explicit(crate::model::memory::even_within(config.layers, most))
        }
        _ => Partition::Even,
    };
    super::partition::partition(config.layers, p, &how)
}

fn check_micro_batches(m: usize) -> Result<()> {
    if m == 0 {
        return Err(WgparError::option(
            "--micro-batches",
            "--micro-batches must be at least 1".into(),
        ));
    }
    Ok(())
}

/// Tensor-parallel placements over `devices` with relative shares `split` (even by default).
fn tensor_placements(
    config: &ModelConfig,
    devices: usize,
    split: Option<&[usize]>,
) -> Result<Vec<Placement>> {
    let even = vec![1; devices];
    let split = split.unwrap_or(&even);
    if split.len() != devices {
        return Err(WgparError::option(
            "--split",
            format!("--split has {} shares for {devices} devices", split.len()),
        ));
    }
    Ok((ShardSpec::tensor_parallel(config, split)?.into_iter())
        .map(|shard| Placement {
            head: shard.rank == 0,
            shard,
            ..Placement::whole(config)
        })
        .collect())
}

/// Placements of pipeline stages that are each a tensor-parallel group of `tp` devices.
fn hybrid_placements(
    config: &ModelConfig,
    devices: usize,
    tp: usize,
    partition: &PartitionSpec,
) -> Result<Vec<Placement>> {
    if tp == 0 || !devices.is_multiple_of(tp) {
        return Err(WgparError::unsupported(format!(
            "{devices} devices do not form pipeline stages of {tp} tensor-parallel devices \
             (--tp {tp})"
        )));
    }
    let shards = ShardSpec::tensor_parallel(config, &vec![1; tp])?;
    let ranges = stage_ranges(config, devices / tp, partition)?;
    let p = ranges.len();
    Ok((ranges.into_iter().enumerate())
        .flat_map(|(i, layers)| {
            shards.iter().map(move |shard| Placement {
                layers: layers.clone(),
                shard: shard.clone(),
                embedding: i == 0,
                head: i + 1 == p && shard.rank == 0,
            })
        })
        .collect())
}

fn resolve(
    spec: &PartitionSpec,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    probe: (usize, usize),
) -> Result<Partition> {
    Ok(match spec {
        PartitionSpec::Even => Partition::Even,
        PartitionSpec::Explicit(v) => Partition::Explicit(v.clone()),
        PartitionSpec::Balanced => Partition::Balanced(measure_stage_costs(
            gpus, weights, dtype, probe.0, probe.1, 3,
        )?),
        PartitionSpec::BalancedWithin(limits) => {
            if limits.len() != gpus.len() {
                return Err(WgparError::LengthMismatch {
                    what: "stage layer limits, one per stage".into(),
                    got: limits.len(),
                    expected: gpus.len(),
                });
            }
            let mut costs = measure_stage_costs(gpus, weights, dtype, probe.0, probe.1, 3)?;
            for (cost, &most) in costs.iter_mut().zip(limits) {
                // Counted in layers: one "byte" per layer against a budget of `most`.
                cost.memory = Some((1, most as u64));
            }
            Partition::Balanced(costs)
        }
    })
}

impl Strategy {
    /// Devices the strategy runs on, given `available` selected devices: one for `Single`,
    /// all of them otherwise.
    pub fn devices_used(&self, available: usize) -> usize {
        match self {
            Strategy::Single => 1.min(available),
            _ => available,
        }
    }

    /// What each of `devices` devices will hold of `config`, checked without opening a device
    /// or building a weight: the tensor-parallel degree and split against the heads, the stage
    /// count and layer split against the layers, the hybrid grouping, the micro-batch count.
    /// A balanced partition is sized as an even one (its split is measured later; every layer
    /// has the same shapes, so the largest buffer is the same).
    pub fn placements(&self, config: &ModelConfig, devices: usize) -> Result<Vec<Placement>> {
        if devices == 0 {
            return Err(WgparError::option(
                "--devices",
                "no devices selected".into(),
            ));
        }
        match self {
            Strategy::Single => Ok(vec![Placement::whole(config)]),
            Strategy::Tensor { split } => tensor_placements(config, devices, split.as_deref()),
            Strategy::Pipeline {
                partition,
                micro_batches,
                ..
            } => {
                check_micro_batches(*micro_batches)?;
                let ranges = stage_ranges(config, devices, partition)?;
                let p = ranges.len();
                Ok((ranges.into_iter().enumerate())
                    .map(|(i, layers)| Placement {
                        layers,
                        shard: ShardSpec::full(config),
                        embedding: i == 0,
                        head: i + 1 == p,
                    })
                    .collect())
            }
            Strategy::Hybrid {
                tp,
                partition,
                micro_batches,
                ..
            } => {
                check_micro_batches(*micro_batches)?;
                hybrid_placements(config, devices, *tp, partition)
            }
        }
    }

    /// Checks, before any device is opened or weight built, that the strategy fits `config`
    /// on `adapters` (one description per selected device): every buffer a device will
    /// allocate for steps of `tokens` new tokens over `batch` sequences stays within its
    /// adapter's buffer and storage-binding limits, and a step's rows fit one dispatch.
    pub fn check_fits(
        &self,
        config: &ModelConfig,
        dtype: DType,
        adapters: &[AdapterDesc],
        tokens: usize,
        batch: usize,
    ) -> Result<()> {
        let placements = self.placements(config, self.devices_used(adapters.len()))?;
        for (i, (placement, adapter)) in placements.iter().zip(adapters).enumerate() {
            let buffers = budget::device_buffers(config, placement, dtype, tokens, batch);
            budget::check_buffers(&buffers, adapter, &format!("gpu{i}"))?;
            let rows = crate::kernels::ops::MAX_ROWS_PER_DISPATCH
                .min(adapter.max_workgroups_per_dimension as usize);
            if tokens > rows {
                return Err(WgparError::limit(
                    "rows per dispatch",
                    (tokens as u64, rows as u64),
                    format!(
                        "one step of {tokens} tokens (batch x prompt length) exceeds the {rows} \
                     rows a kernel dispatch takes on '{}': lower --batch or --prompt-len, or \
                     split the batch with --strategy pp --micro-batches",
                        adapter.label()
                    ),
                ));
            }
        }
        Ok(())
    }
}
