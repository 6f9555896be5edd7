//! `--gpu-memory`: the caps of [`MemoryArgs`] checked by [`wgpar::memory_check`] before any
//! device is opened or weight built.

use wgpar::device::DType;
use wgpar::model::memory::WeightFormat;
use wgpar::model::ModelConfig;
use wgpar::Result;

pub(crate) use wgpar::memory_check::{check_context, check_runs_fit, PlannedRun};

use super::options::{MemoryArgs, ModelArgs};

impl MemoryArgs {
    /// Refuses, before anything is opened, a planned run whose tensor-parallel shards would
    /// cut a packed matrix's blocks, or whose accounted bytes exceed a device's cap
    /// ([`wgpar::memory_check::check_runs_capped`]); the weights stored as `model` says.
    pub(super) fn check_runs(
        &self,
        model: &ModelArgs,
        (config, dtype): (&ModelConfig, DType),
        kv: &[DType],
        runs: &[PlannedRun<'_>],
    ) -> Result<()> {
        let format = model.choice().weight_format(config, dtype)?;
        self.check_runs_with(&format, config, kv, runs)
    }

    /// [`Self::check_runs`] with the weights stored as `format`.
    pub(super) fn check_runs_with(
        &self,
        format: &WeightFormat,
        config: &ModelConfig,
        kv: &[DType],
        runs: &[PlannedRun<'_>],
    ) -> Result<()> {
        let caps = self.gpu_memory.as_deref();
        wgpar::memory_check::check_runs_capped(caps, format, config, kv, runs)
    }
}
