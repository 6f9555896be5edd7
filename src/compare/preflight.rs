//! What `compare` checks and picks before a device opens: its counts, the devices it runs on
//! when none are named, and every run it will make against the selected adapters' limits,
//! the host's memory and `--gpu-memory`.

use super::{plans, CompareOptions};
use crate::device::{AdapterDesc, Adapters, DType, DeviceSelection};
use crate::error::{Result, WgparError};
use crate::memory_check::{check_runs_capped, check_runs_fit, PlannedRun};
use crate::model::memory::{WeightFormat, Workload};
use crate::parallel::Strategy;

/// Every distinct GPU once (preferring Vulkan/Metal/DX12 over GL); with fewer than two real
/// GPUs, four virtual devices on the preferred adapter.
pub fn default_selection(adapters: &Adapters) -> DeviceSelection {
    let mut names: Vec<&str> = Vec::new();
    let mut picks = Vec::new();
    for d in adapters.list() {
        if !d.is_cpu() && !names.contains(&d.name.as_str()) {
            names.push(&d.name);
            picks.push(d.index);
        }
    }
    if picks.len() >= 2 {
        DeviceSelection::Indices(picks)
    } else {
        DeviceSelection::Virtual {
            adapter: adapters.preferred(),
            count: 4,
        }
    }
}

/// The sweep's counts as the command line names them: zero counts would be replaced or give
/// empty rows, so they are refused.
pub struct SweepCounts<'a> {
    /// `--batches`.
    pub batches: &'a [usize],
    /// `--micro-batches`.
    pub micro_batches: &'a [usize],
    /// `--reps`.
    pub reps: usize,
    /// `--prompt-len`.
    pub prompt_len: usize,
    /// `--gen`.
    pub gen: usize,
}

impl SweepCounts<'_> {
    /// Refuses an empty or zero count, naming its option.
    pub fn check(&self) -> Result<()> {
        for (option, values) in [
            ("--batches", self.batches),
            ("--micro-batches", self.micro_batches),
        ] {
            if values.is_empty() || values.contains(&0) {
                return Err(WgparError::option(
                    option,
                    format!("{option} needs positive counts, got {values:?}"),
                ));
            }
        }
        for (option, value) in [
            ("--reps", self.reps),
            ("--prompt-len", self.prompt_len),
            ("--gen", self.gen),
        ] {
            if value == 0 {
                return Err(WgparError::option(
                    option,
                    format!("{option} must be at least 1"),
                ));
            }
        }
        Ok(())
    }
}

/// Every configuration `opts` will run on `selected`, checked against the adapters' limits,
/// the host's memory and the per-device `caps` (`--gpu-memory`'s text) before a device
/// opens; `kv` is each selected device's KV-cache type.
pub fn check_plans_fit(
    opts: &CompareOptions,
    selected: &[AdapterDesc],
    caps: Option<&str>,
    kv: &[DType],
) -> Result<()> {
    let plans = plans(&opts.config, selected.len(), opts);
    let mut runs: Vec<PlannedRun> = (plans.iter())
        .map(|p| PlannedRun {
            strategy: &p.strategy,
            adapters: &selected[..p.devices],
            step_tokens: (p.batch.div_ceil(p.micro_batches)).saturating_mul(opts.prompt_len),
            batch: p.batch,
            work: Workload {
                batch: p.batch,
                prompt: opts.prompt_len,
            },
        })
        .collect();
    if let Some(serving) = &opts.serving {
        runs.push(PlannedRun {
            strategy: &Strategy::Single,
            adapters: &selected[..1],
            step_tokens: serving.max_batch.saturating_mul(serving.prompt_len.max()),
            batch: serving.max_batch,
            work: Workload {
                batch: serving.max_batch,
                prompt: serving.prompt_len.max(),
            },
        });
    }
    check_runs_fit(&opts.config, opts.dtype, &runs)?;
    // compare runs the config's synthetic weights, dense in `dtype`.
    let format = WeightFormat::of_config(&opts.config, opts.dtype, None);
    check_runs_capped(caps, &format, &opts.config, kv, &runs)
}
