//! `--layers auto` and `--split auto` for the commands that place a model themselves (`run`,
//! `serve`, `bench serve`): by memory before any device opens, then by measured speed once
//! the devices are open. Says on stderr what it measured and chose.

use std::sync::Arc;

use super::{measure_stage_costs, with_measured_partition, PartitionSpec, Strategy};
use crate::device::{AdapterDesc, DType, Gpu, MAX_DEVICES};
use crate::error::{Result, WgparError};
use crate::load::ModelChoice;
use crate::model::memory::{
    split_by_memory, split_by_speed, stage_layer_limits, MemorySpec, SplitBasis, WeightFormat,
    Workload,
};
use crate::model::{ModelConfig, ModelWeights};

/// Longest list of sizes or counts read (one per device, at most [`MAX_DEVICES`]).
pub const MAX_LIST_TEXT: usize = 32 * MAX_DEVICES;

/// Parses `--gpu-memory` for `devices` selected devices: one cap each (a single size is
/// every device's).
pub fn parse_caps(text: &str, devices: usize) -> Result<Vec<u64>> {
    let bad =
        |why: String| WgparError::option("--gpu-memory", format!("--gpu-memory '{text}': {why}"));
    if text.len() > MAX_LIST_TEXT {
        return Err(WgparError::option(
            "--gpu-memory",
            format!(
            "--gpu-memory is {} characters long: give at most one size per device ({MAX_DEVICES})",
            text.len()
        ),
        ));
    }
    let caps = (text.split(','))
        .map(|part| {
            // `Mi` is read as `MiB`, which the shared size parser takes.
            let part = part.trim();
            let full = match part.ends_with(['i', 'I']) {
                true => format!("{part}B"),
                false => part.to_string(),
            };
            let bytes = crate::comm::units::parse_size(&full).map_err(|e| bad(e.to_string()))?;
            if bytes == 0 {
                return Err(bad(format!(
                    "'{}' is zero: a device must hold something",
                    part.trim()
                )));
            }
            Ok(bytes)
        })
        .collect::<Result<Vec<u64>>>()?;
    match caps.len() {
        1 => Ok(vec![caps[0]; devices]),
        n if n == devices => Ok(caps),
        n => Err(bad(format!(
            "{n} sizes for {devices} selected devices: give one per device, or one for all"
        ))),
    }
}

/// The bytes one binding may hold on each adapter (what splits the vocabulary tables).
pub fn binding_limits<'a>(adapters: impl Iterator<Item = &'a AdapterDesc>) -> Vec<u64> {
    adapters
        .map(|a| a.max_storage_binding.min(a.max_buffer_size))
        .collect()
}

/// What a command's options ask of an automatic placement: owned, so that a server's engine
/// builder can resolve it on the devices it opens.
#[derive(Clone, Debug)]
pub struct AutoPlacement {
    /// `--layers auto` or `--split auto` was given.
    asked: bool,
    /// `--split auto`: heads chosen by speed once the devices are open.
    split: bool,
    /// `--gpu-memory`, as given.
    caps: Option<String>,
}

/// The run a placement is made for, before the devices open.
pub struct Setting<'a> {
    /// The model.
    pub config: &'a ModelConfig,
    /// Its weights' dtype.
    pub dtype: DType,
    /// How the model is chosen (for its weights' storage).
    pub model: ModelChoice<'a>,
    /// The selected adapters, in order.
    pub selected: &'a [AdapterDesc],
    /// The KV-cache type each will store.
    pub kv: Vec<DType>,
    /// The batch and prompt.
    pub work: Workload,
}

impl AutoPlacement {
    /// The placement asked for: `layers_auto` (`--layers auto`), `split_auto` (`--split
    /// auto`), within `caps` (`--gpu-memory`, as given).
    pub fn new(layers_auto: bool, split_auto: bool, caps: Option<String>) -> Self {
        Self {
            asked: layers_auto || split_auto,
            split: split_auto,
            caps,
        }
    }

    /// Resolves `auto` as far as it can before the devices open: the most layers each stage's
    /// `--gpu-memory` cap holds, within which the split is balanced by measured speed
    /// ([`PartitionSpec::BalancedWithin`]); for tensor parallelism, a split that fits the caps
    /// ([`split_by_memory`]), for the checks, replaced by one by speed once the devices are
    /// open ([`Self::once_open`]). Without caps, by speed alone. Other strategies unchanged.
    pub fn before_open(&self, strategy: Strategy, run: &Setting<'_>) -> Result<Strategy> {
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
        let format = run.model.weight_format(run.config, run.dtype)?;
        let memory = AccountingParts {
            format,
            kv: run.kv.clone(),
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
pub struct AccountingParts {
    /// How the weights are stored.
    pub format: WeightFormat,
    /// Each device's KV-cache type.
    pub kv: Vec<DType>,
    /// Each device's binding limit.
    pub limits: Vec<u64>,
    /// The batch and prompt.
    pub work: Workload,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_are_one_per_device_or_one_for_all() {
        assert_eq!(parse_caps("6G,10G", 2).unwrap(), vec![6 << 30, 10 << 30]);
        assert_eq!(parse_caps("512Mi", 3).unwrap(), vec![512 << 20; 3]);
        assert_eq!(parse_caps("4096", 1).unwrap(), vec![4096]);
        for (text, needle) in [
            ("6G,10G,1G", "3 sizes for 2"),
            ("0", "zero"),
            ("six", "not a size"),
            ("99999999999999999999G", "not a size"),
            ("", "not a size"),
        ] {
            let e = parse_caps(text, 2).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let long = "1G,".repeat(MAX_DEVICES * 20);
        assert!(parse_caps(&long, 2)
            .unwrap_err()
            .to_string()
            .contains("characters"));
    }
}
