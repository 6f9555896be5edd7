//! `compare`'s choices as a command gives them ([`CompareChoice`]), resolved and checked
//! before a device opens ([`CompareChoice::plan`]): the sweep's counts, the model, the host
//! profiles and engines named, the devices, the weights' dtype, and every run against the
//! adapters' limits and `--gpu-memory`.

use std::sync::Arc;

use super::preflight::{check_plans_fit, default_selection, SweepCounts};
use super::{CompareOptions, ServingOptions};
use crate::batching::{Length, Rate};
use crate::device::{open_devices, Adapters, BindingChoice, DType, DeviceSelection, Gpu};
use crate::error::{Result, WgparError};
use crate::load::ModelChoice;
use crate::model::ModelConfig;
use crate::parallel::Schedule;
use crate::sim::{Engine, HostProfile};

/// The serving section's choices (`--serve-*`).
#[derive(Debug, Clone, Copy)]
pub struct ServeChoice {
    /// Requests every strategy serves (0: skip the section).
    pub requests: usize,
    /// Arrival rate.
    pub rate: Rate,
    /// Prompt tokens per request (`None`: the sweep's prompt length).
    pub prompt_len: Option<Length>,
    /// Tokens generated per request (`None`: the sweep's `gen`).
    pub output_len: Option<Length>,
    /// KV slots.
    pub max_batch: usize,
}

/// What `wgpar compare` was asked, as the command line names it.
#[derive(Debug, Clone)]
pub struct CompareChoice<'a> {
    /// The model.
    pub model: ModelChoice<'a>,
    /// `--devices`: adapter indices.
    pub devices: Option<&'a str>,
    /// `--virtual N`: virtual devices on one adapter.
    pub virtual_count: Option<usize>,
    /// The binding cap and KV type.
    pub binding: BindingChoice,
    /// `--gpu-memory`.
    pub gpu_memory: Option<&'a str>,
    /// Batch sizes to sweep.
    pub batches: &'a [usize],
    /// Micro-batch counts to sweep.
    pub micro_batches: &'a [usize],
    /// `--schedule`: in-flight or gpipe.
    pub schedule: &'a str,
    /// Prompt length.
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    pub gen: usize,
    /// Timed repetitions.
    pub reps: usize,
    /// The serving section.
    pub serve: ServeChoice,
    /// Host profiles (shipped names or TOML paths).
    pub profiles: &'a [String],
    /// Engines (shipped names or TOML paths).
    pub engines: &'a [String],
    /// Add the modeled section at scale.
    pub at_scale: bool,
}

/// What the names of a [`CompareChoice`] stand for, resolved before any adapter is looked at.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The model's config.
    pub config: ModelConfig,
    /// The host profiles.
    pub profiles: Vec<HostProfile>,
    /// The engines.
    pub engines: Vec<Engine>,
}

/// A comparison checked before a device opens: what to run, and on which devices.
pub struct ComparePlan {
    /// The library's options.
    pub options: CompareOptions,
    /// The adapters found.
    pub adapters: Adapters,
    /// The devices to open.
    pub selection: DeviceSelection,
    /// The binding cap and KV type they open with.
    pub binding: BindingChoice,
}

impl CompareChoice<'_> {
    /// Checks the counts and resolves the names (model, profiles, engines), before any
    /// adapter is looked at.
    pub fn resolve(&self) -> Result<Resolved> {
        SweepCounts {
            batches: self.batches,
            micro_batches: self.micro_batches,
            reps: self.reps,
            prompt_len: self.prompt_len,
            gen: self.gen,
        }
        .check()?;
        self.schedule()?;
        let config = self.model.config()?;
        let profiles = (self.profiles.iter())
            .map(|p| HostProfile::resolve(p).map_err(WgparError::from))
            .collect::<Result<Vec<_>>>()?;
        let engines = (self.engines.iter())
            .map(|e| {
                Engine::resolve(e)
                    .map_err(|e| WgparError::option("--engines", format!("--engines: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Resolved {
            config,
            profiles,
            engines,
        })
    }

    /// `--schedule`, refused by name unless in-flight or gpipe.
    fn schedule(&self) -> Result<Schedule> {
        Schedule::parse(self.schedule).ok_or_else(|| {
            WgparError::option(
                "--schedule",
                format!("--schedule '{}': use in-flight or gpipe", self.schedule),
            )
        })
    }

    /// The devices `--devices` or `--virtual` name, else [`default_selection`].
    pub fn selection(&self, adapters: &Adapters) -> Result<DeviceSelection> {
        if self.devices.is_some() || self.virtual_count.is_some() {
            return DeviceSelection::from_options(self.devices, self.virtual_count, adapters);
        }
        Ok(default_selection(adapters))
    }

    /// The library's options: `resolved` names, weights stored as `dtype`, the serving
    /// section's lengths defaulting to the sweep's.
    pub fn options(&self, resolved: Resolved, dtype: DType) -> Result<CompareOptions> {
        let serve = self.serve;
        Ok(CompareOptions {
            config: resolved.config,
            dtype,
            batches: self.batches.to_vec(),
            micro_batches: self.micro_batches.to_vec(),
            schedule: self.schedule()?,
            prompt_len: self.prompt_len,
            gen: self.gen,
            reps: self.reps,
            profiles: resolved.profiles,
            engines: resolved.engines,
            seed: self.model.seed,
            serving: (serve.requests > 0).then(|| ServingOptions {
                requests: serve.requests,
                rate: serve.rate,
                prompt_len: (serve.prompt_len).unwrap_or(Length::Fixed(self.prompt_len.max(1))),
                output_len: (serve.output_len).unwrap_or(Length::Fixed(self.gen.max(1))),
                max_batch: serve.max_batch,
                seed: self.model.seed,
            }),
            at_scale: self.at_scale,
        })
    }

    /// Everything checked before a device opens ([`Self::resolve`], then the adapters, the
    /// dtype and every planned run against the adapters' limits and `--gpu-memory`).
    pub fn plan(&self) -> Result<ComparePlan> {
        let resolved = self.resolve()?;
        let adapters = Adapters::discover()?;
        let selection = self.selection(&adapters)?;
        let selected = self.binding.described(&selection, &adapters)?;
        let dtype = self.model.dtype_for(&selected, false)?;
        let options = self.options(resolved, dtype)?;
        let kv = self.binding.kv_dtypes(&selected, false);
        check_plans_fit(&options, &selected, self.gpu_memory, &kv)?;
        Ok(ComparePlan {
            options,
            adapters,
            selection,
            binding: self.binding,
        })
    }
}

impl ComparePlan {
    /// Opens the planned devices.
    pub fn open(&self) -> Result<Vec<Arc<Gpu>>> {
        open_devices(&self.adapters, &self.selection, &self.binding.gpu_options())
    }
}
