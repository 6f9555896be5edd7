//! Strategies by name, and building the engine for one: how the CLI, the comparison and the
//! examples all get an engine.

use std::fmt;
use std::sync::Arc;

use super::balance::measure_stage_costs;
use super::partition::Partition;
use super::{Engine, PipelineEngine, Schedule, SingleEngine, TensorParallelEngine};
use crate::comm::CommConfig;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::ModelWeights;

/// How layers are assigned to pipeline stages, as the user says it.
#[derive(Debug, Clone, PartialEq)]
pub enum PartitionSpec {
    /// Equal layer counts.
    Even,
    /// Given layer counts.
    Explicit(Vec<usize>),
    /// Measured per-device layer, embedding and head times (for unequal devices).
    Balanced,
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
    let first = gpus
        .first()
        .ok_or_else(|| WgparError::Config("no devices".into()))?;
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

/// Builds the pipeline engine for a [`Strategy::Pipeline`] or [`Strategy::Hybrid`] (the
/// serving loop needs the engine itself, not a `dyn Engine`).
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
            let leaders: Vec<Arc<Gpu>> = gpus.iter().step_by((*tp).max(1)).cloned().collect();
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
            return Err(WgparError::Config(format!(
                "{other} is not a pipeline strategy"
            )))
        }
    };
    if let Strategy::Pipeline { schedule, .. } | Strategy::Hybrid { schedule, .. } = strategy {
        engine.set_schedule(*schedule);
    }
    Ok(engine)
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
    })
}
