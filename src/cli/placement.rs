//! `--layers auto` and `--split auto` for the commands that place a model themselves (`run`,
//! `serve`, `bench serve`): by memory before any device opens, then by measured speed once
//! the devices are open. Says on stderr what it measured and chose.

use std::sync::Arc;

use wgpar::device::{AdapterDesc, DType, Gpu};
use wgpar::model::memory::{
    split_by_memory, split_by_speed, stage_layer_limits, MemorySpec, SplitBasis, WeightFormat,
    Workload,
};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{measure_stage_costs, with_measured_partition, PartitionSpec, Strategy};
use wgpar::Result;

use super::memory::binding_limits;
use super::options::{parse_caps, Counts, DeviceArgs, MemoryArgs, ModelArgs, StrategyArgs};

/// What a command's options ask of an automatic placement: owned, so that a server's engine
/// builder can resolve it on the devices it opens.
#[derive(Clone, Debug)]
pub(super) struct AutoPlacement {
    /// `--layers auto` or `--split auto` was given.
    asked: bool,
    /// `--split auto`: heads chosen by speed once the devices are open.
    split: bool,
    /// `--gpu-memory`, as given.
    caps: Option<String>,
}

/// The run a placement is made for, before the devices open.
pub(super) struct Setting<'a> {
    pub config: &'a ModelConfig,
    pub dtype: DType,
    pub selected: &'a [AdapterDesc],
    pub work: Workload,
}

impl AutoPlacement {
    /// The placement `strategy` and `memory` ask for.
    pub fn of(strategy: &StrategyArgs, memory: &MemoryArgs) -> Self {
        Self {
            asked: strategy.layers == Some(Counts::Auto) || strategy.split == Some(Counts::Auto),
            split: strategy.split == Some(Counts::Auto),
            caps: memory.gpu_memory.clone(),
        }
    }

    /// Resolves `auto` as far as it can before the devices open: the most layers each stage's
    /// `--gpu-memory` cap holds, within which the split is balanced by measured speed
    /// ([`PartitionSpec::BalancedWithin`]); for tensor parallelism, a split that fits the caps
    /// ([`split_by_memory`]), for the checks, replaced by one by speed once the devices are
    /// open ([`Self::once_open`]). Without caps, by speed alone. Other strategies unchanged.
    pub fn before_open(
        &self,
        strategy: Strategy,
        model: &ModelArgs,
        devices: &DeviceArgs,
        run: &Setting<'_>,
    ) -> Result<Strategy> {
        if !self.asked {
            return Ok(strategy);
        }
        let Some(text) = &self.caps else {
            eprintln!(
                "note: auto placement without --gpu-memory (no device reports its memory \
                 size): by measured speed alone"
            );
            return Ok(with_partition(strategy, PartitionSpec::Balanced));
        };
        let caps = parse_caps(text, run.selected.len())?;
        let format = model.choice().weight_format(run.config, run.dtype)?;
        let memory = AccountingParts {
            format,
            kv: devices.kv_dtypes(run.selected),
            limits: binding_limits(run.selected.iter()),
            work: run.work,
        };
        let spec = memory.spec(run.config);
        let n = strategy.devices_used(run.selected.len());
        if let Strategy::Tensor { .. } = strategy {
            let split = split_by_memory(n, &spec, &caps)?;
            return Ok(Strategy::Tensor { split: Some(split) });
        }
        let most = stage_layer_limits(&strategy, n, &spec, &caps)?;
        eprintln!(
            "note: --layers auto: the --gpu-memory caps hold at most {most:?} layers per \
             stage; the split within them is balanced by measured speed"
        );
        Ok(with_partition(
            strategy,
            PartitionSpec::BalancedWithin(most),
        ))
    }

    /// `strategy` with its measured placement resolved on the open `gpus`: a balanced
    /// partition into layer counts ([`with_measured_partition`]), and `--split auto` into
    /// heads by each device's measured layer time, within the caps ([`split_by_speed`]).
    pub fn once_open(
        &self,
        strategy: &Strategy,
        gpus: &[Arc<Gpu>],
        (weights, dtype): (&ModelWeights, DType),
        work: Workload,
    ) -> Result<Strategy> {
        let probe = (work.batch, work.prompt);
        let strategy = with_measured_partition(strategy, gpus, weights, dtype, probe)?;
        if !self.split || !matches!(strategy, Strategy::Tensor { .. }) {
            return Ok(strategy);
        }
        let costs = measure_stage_costs(gpus, weights, dtype, work.batch, work.prompt, 7)?;
        let layer_s: Vec<f64> = costs.iter().map(|c| c.layer_s).collect();
        let caps = (self.caps.as_deref())
            .map(|text| parse_caps(text, gpus.len()))
            .transpose()?;
        let memory = AccountingParts::of(gpus, WeightFormat::of_weights(weights, dtype), work);
        let split = split_by_speed(&layer_s, &memory.spec(&weights.config), caps.as_deref())?;
        let times: Vec<String> = layer_s
            .iter()
            .map(|t| format!("{:.2} ms", t * 1e3))
            .collect();
        let why = match split.basis {
            SplitBasis::Speed if caps.is_some() => "by speed within the --gpu-memory caps",
            SplitBasis::Speed => "by speed",
            SplitBasis::EvenForBlocks => "evenly: the split by speed would cut packed blocks",
            SplitBasis::Memory => "by the --gpu-memory caps: no split by speed fits them",
        };
        eprintln!(
            "note: --split auto: a layer takes {} on the devices; query heads {:?} {why}",
            times.join(", "),
            split.heads
        );
        Ok(Strategy::Tensor {
            split: Some(split.heads),
        })
    }
}

/// A pipeline or hybrid `strategy` with its stages split by `partition` (others unchanged).
fn with_partition(mut strategy: Strategy, partition: PartitionSpec) -> Strategy {
    if let Strategy::Pipeline { partition: p, .. } | Strategy::Hybrid { partition: p, .. } =
        &mut strategy
    {
        *p = partition;
    }
    strategy
}

/// What the memory accounting reads beside the config: the weights' storage, each device's
/// KV type and binding limit, the work.
pub(super) struct AccountingParts {
    format: WeightFormat,
    kv: Vec<DType>,
    limits: Vec<u64>,
    work: Workload,
}

impl AccountingParts {
    /// The parts of a run on the open `gpus`.
    pub fn of(gpus: &[Arc<Gpu>], format: WeightFormat, work: Workload) -> Self {
        Self {
            format,
            kv: gpus.iter().map(|g| g.kv_dtype()).collect(),
            limits: binding_limits(gpus.iter().map(|g| g.info())),
            work,
        }
    }

    /// The accounting's input for `config`.
    pub fn spec<'a>(&'a self, config: &'a ModelConfig) -> MemorySpec<'a> {
        MemorySpec {
            config,
            format: &self.format,
            kv_dtypes: &self.kv,
            work: self.work,
            binding_limits: &self.limits,
        }
    }
}
