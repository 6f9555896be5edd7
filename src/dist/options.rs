//! A command's choices as one rank of an MPI job takes them: what ranks refuse (by name),
//! the checks every rank makes together before any opens its device (the same job, each
//! rank's `--gpu-memory` cap), the rank's devices opened and its part built; and the
//! all-reduce benchmark's options across ranks.

use std::ops::Range;

use super::bench::MpiBenchOptions;
use super::job::{self, RankDevice, RankEngine, RankShare};
use super::{DistError, World};
use crate::comm::bench::parse_dtype;
use crate::comm::units::parse_size;
use crate::comm::{Algorithm, CommConfig, CommError, LinkPrecision};
use crate::device::{Adapters, DType, DeviceChoice};
use crate::error::{Result, WgparError};
use crate::load::ModelChoice;
use crate::memory_check::check_context;
use crate::model::memory::Workload;
use crate::model::ModelConfig;
use crate::parallel::auto::parse_caps;
use crate::parallel::choice::StrategyChoice;
use crate::parallel::Strategy;

/// Refuses the first option of `refused` (given, option, why) that is given, by name.
pub fn refuse_given(refused: &[(bool, &str, &str)]) -> Result<()> {
    match refused.iter().find(|(given, _, _)| *given) {
        Some((_, option, why)) => Err(DistError::Unsupported {
            option: option.to_string(),
            why: why.to_string(),
        }
        .into()),
        None => Ok(()),
    }
}

/// The devices, model and caps of one rank's part of a job.
#[derive(Debug, Clone)]
pub struct RankJob<'a> {
    /// The rank's devices.
    pub devices: DeviceChoice,
    /// The model.
    pub model: ModelChoice<'a>,
    /// `--gpu-memory`: one cap per rank, or one for all.
    pub gpu_memory: Option<&'a str>,
}

/// A run on synthetic prompts over ranks: sequences, prompt tokens, generated tokens.
#[derive(Debug, Clone, Copy)]
pub struct RankRun {
    /// Sequences per batch.
    pub batch: usize,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    pub gen: usize,
}

impl RankJob<'_> {
    /// `--gpu-memory` over ranks, before any rank opens its device: each rank accounts its
    /// own device on its own adapter ([`job::over_cap`]), and all refuse together.
    pub fn check_caps(
        &self,
        world: &World,
        (config, strategy, work): (&ModelConfig, &Strategy, Workload),
        adapters: &Adapters,
    ) -> Result<()> {
        let Some(caps) = self.gpu_memory else {
            return Ok(());
        };
        let own = || -> Result<Option<String>> {
            let caps = parse_caps(caps, world.size())?;
            let selected = self.devices.selected(adapters)?;
            let dtype = self.model.dtype_for(&selected, self.devices.force_f32)?;
            let format = self.model.weight_format(config, dtype)?;
            let me = RankDevice {
                rank: world.rank(),
                ranks: world.size(),
                adapter: &selected[0],
                kv: self.devices.kv_dtypes(&selected)[0],
            };
            let share = RankShare {
                config,
                format: &format,
                strategy,
                work,
            };
            job::over_cap(&share, &caps, &me)
        };
        job::refuse_over_caps(world, &config.name, own())
    }

    /// This rank's devices opened and its part of `strategy` built from its own layers;
    /// with the count of devices it opened.
    pub fn open(
        &self,
        world: &World,
        adapters: &Adapters,
        (config, strategy): (&ModelConfig, &Strategy),
    ) -> Result<(RankEngine, usize)> {
        let gpus = self.devices.open(adapters)?;
        let dtype = self.model.dtype(&gpus)?;
        let load = |layers: Range<usize>| self.model.weights_of_layers(config, layers);
        let built = job::rank_engine(world, (&gpus, dtype), (config, strategy), load)?;
        Ok((built, gpus.len()))
    }

    /// Checks that every rank runs the same job: the model, its dtype and seed, `strategy`,
    /// `work` (what the command does with it) and the memory caps.
    pub fn check_same_job(
        &self,
        world: &World,
        config: &ModelConfig,
        strategy: &Strategy,
        work: &str,
    ) -> Result<()> {
        let m = &self.model;
        job::check_same_job(
            world,
            &format!(
                "{} layers {} hidden {} vocab {} dtype {} seed {} strategy {strategy:?} {work} \
                 gpu-memory {:?}",
                config.name,
                config.layers,
                config.hidden,
                config.vocab,
                m.dtype,
                m.seed,
                self.gpu_memory
            ),
        )
    }

    /// What every rank checks of `wgpar run` before any opens its device: the options ranks
    /// refuse (`prompt`: `--prompt` given; `pace`: `--pace` given) and the counts, the model
    /// and its context, the strategy, the same job on every rank, and each rank's cap. Returns
    /// the model, the strategy and the adapters found.
    pub fn plan_run(
        &self,
        world: &World,
        strategy: &StrategyChoice,
        run: RankRun,
        (prompt, pace): (bool, bool),
    ) -> Result<(ModelConfig, Strategy, Adapters)> {
        refuse_given(&[
            (prompt, "--prompt", "text generation runs in one process"),
            (
                pace,
                "--pace",
                "ranks talk over a real link; project a trace onto a profile instead",
            ),
        ])?;
        let config = self.model.config()?;
        if run.batch == 0 || run.prompt_len == 0 || run.gen == 0 {
            return Err(WgparError::option(
                "--batch",
                "--batch, --prompt-len and --gen must be positive".into(),
            ));
        }
        check_context(run.prompt_len, run.gen, &config)?;
        let strategy = strategy.over_ranks(1)?;
        self.check_same_job(world, &config, &strategy, &format!("{run:?}"))?;
        let work = Workload {
            batch: run.batch,
            prompt: run.prompt_len,
        };
        let adapters = Adapters::discover()?;
        self.check_caps(world, (&config, &strategy, work), &adapters)?;
        Ok((config, strategy, adapters))
    }
}

/// The all-reduce benchmark's options as a command gives them.
#[derive(Debug, Clone, Copy)]
pub struct AllreduceChoice<'a> {
    /// The collective (`--op`): only allreduce runs across ranks.
    pub op: &'a str,
    /// The element type (`-d`): only f32 across ranks.
    pub dtype: &'a str,
    /// The algorithm (`-a`): only auto across ranks.
    pub algorithm: &'a str,
    /// Bytes per chunk on the link (`--chunk`).
    pub chunk: Option<&'a str>,
    /// The link's precision (`--link`).
    pub link: &'a str,
    /// The smallest and largest sizes (`-b`, `-e`).
    pub sizes: (&'a str, &'a str),
    /// The size's factor between rows (`-f`).
    pub factor: u64,
    /// Timed and warm-up iterations.
    pub iters: (usize, usize),
}

impl AllreduceChoice<'_> {
    /// The benchmark across ranks, with what does not apply there refused by name.
    pub fn options(&self) -> Result<MpiBenchOptions> {
        let cfg_err = |e: CommError| WgparError::option("allreduce", e.to_string());
        let (op, d, a) = (self.op, self.dtype, self.algorithm);
        let why = "across ranks wgpar measures the all-reduce";
        refuse_given(&[(op != "allreduce", format!("--op {op}").as_str(), why)])?;
        let f32_only = parse_dtype(d).map_err(cfg_err)? != DType::F32;
        let why = "the cross-process all-reduce sums f32 tensors (use --link f16 to halve the \
                   bytes on the link)";
        refuse_given(&[(f32_only, format!("-d {d}").as_str(), why)])?;
        let not_auto = a.parse::<Algorithm>().map_err(cfg_err)? != Algorithm::Auto;
        let why = "across ranks the chunk size decides (--chunk)";
        refuse_given(&[(not_auto, format!("-a {a}").as_str(), why)])?;
        let mut config = CommConfig::default();
        if let Some(c) = self.chunk {
            config.chunk_bytes = parse_size(c).map_err(cfg_err)?;
        }
        config.link = self.link.parse::<LinkPrecision>().map_err(cfg_err)?;
        config.validate()?;
        Ok(MpiBenchOptions {
            min_bytes: parse_size(self.sizes.0).map_err(cfg_err)?,
            max_bytes: parse_size(self.sizes.1).map_err(cfg_err)?,
            factor: self.factor,
            iters: self.iters.0,
            warmup: self.iters.1,
            seed: 42,
            config,
        })
    }
}
