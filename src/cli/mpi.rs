//! Running as MPI ranks: `mpirun -np N wgpar devices | run | allreduce`.
//!
//! Without the `mpi` feature this module only detects a launch and refuses it (N independent
//! copies of a run would each use every device and report N times).

use clap::Args;
use wgpar::dist::{launch, DistError, RankFault};
use wgpar::Result;

/// Options of every command about MPI ranks.
#[derive(Args, Clone, Debug)]
pub struct MpiArgs {
    /// Run as MPI ranks even if no launcher is detected (it is detected from the variables
    /// mpirun sets: OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK). Needs a build with `--features
    /// mpi`.
    #[arg(long, global = true)]
    mpi: bool,
    /// Under MPI: seconds any wait on another rank may take before the run fails with an
    /// error naming that rank.
    #[arg(long, global = true, default_value_t = 120.0, value_name = "SECS")]
    mpi_timeout: f64,
    /// Under MPI, for tests and demonstrations of the failure path: make RANK fail with KIND
    /// (error, panic, kill, hang) after AFTER micro-batches (error, panic in a pipeline; steps
    /// of tensor parallelism) or milliseconds (kill: SIGKILL; hang: SIGSTOP).
    #[arg(long, global = true, value_name = "RANK:KIND[:AFTER]")]
    mpi_fault: Option<String>,
}

impl MpiArgs {
    /// True when this process is one of several MPI ranks (or `--mpi` asks for it). A binary
    /// without the feature refuses a parallel launch here, before anything else runs.
    pub fn active(&self) -> Result<bool> {
        let detected = launch::detect();
        if cfg!(feature = "mpi") {
            return Ok(self.mpi || detected.is_some_and(|l| l.is_parallel()));
        }
        if self.mpi {
            return Err(DistError::FeatureMissing.into());
        }
        match detected {
            Some(l) if l.is_parallel() => Err(DistError::NotBuilt {
                launcher: l.launcher,
                rank: l.rank,
                size: l.size,
            }
            .into()),
            _ => Ok(false),
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn fault(&self) -> Result<Option<RankFault>> {
        self.mpi_fault.as_deref().map(RankFault::parse).transpose()
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn timeout(&self) -> Result<std::time::Duration> {
        if !(self.mpi_timeout.is_finite() && self.mpi_timeout > 0.0) {
            return Err(wgpar::WgparError::option(
                "--mpi-timeout",
                format!(
                    "--mpi-timeout {}: must be a positive number of seconds",
                    self.mpi_timeout
                ),
            ));
        }
        Ok(std::time::Duration::from_secs_f64(self.mpi_timeout))
    }
}

#[cfg(feature = "mpi")]
pub use ranks::main;

#[cfg(not(feature = "mpi"))]
/// Unreachable without the feature: [`MpiArgs::active`] refuses first.
pub fn main(_cli: super::Cli) -> Result<()> {
    Err(DistError::FeatureMissing.into())
}

/// The commands under `mpirun`: each parses as in one process, calls the rank's part of the
/// job in [`wgpar::dist::job`] and says the result on rank 0.
#[cfg(feature = "mpi")]
mod ranks {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use wgpar::comm::bench::parse_dtype;
    use wgpar::comm::units::parse_size;
    use wgpar::comm::{Algorithm, CommConfig, LinkPrecision};
    use wgpar::device::{Adapters, DType};
    use wgpar::dist::bench::{run_bench, MpiBenchOptions};
    use wgpar::dist::job::{self, RankDevice, RankEngine, RankShare};
    use wgpar::dist::report::{render_pipeline_over_ranks, render_rank_adapters, render_rank_run};
    use wgpar::dist::{calibrate_ranks, DistEngine, DistError, RankFault, World};
    use wgpar::model::memory::Workload;
    use wgpar::model::{ModelConfig, ModelWeights};
    use wgpar::parallel::timed::write_logits;
    use wgpar::parallel::{StepEngine, Strategy};
    use wgpar::server::EngineBuilder;
    use wgpar::trace::{DeviceTiming, Recorder};
    use wgpar::{Result, WgparError};

    use crate::cli::allreduce::AllreduceArgs;
    use crate::cli::calibrate::CalibrateArgs;
    use crate::cli::memory::check_context;
    use crate::cli::options::{check_lanes_have_slots, DeviceArgs, ModelArgs, RunArgs};
    use crate::cli::server::{self, Prepared, ServerArgs};
    use crate::cli::{Cli, Command};
    use wgpar::parallel::auto::parse_caps;

    /// Runs the command as one rank of the job. A failure is reported to every other rank
    /// (which stop at once, naming this one) and ends the job; never returns an error.
    pub fn main(cli: Cli) -> Result<()> {
        let timeout = cli.mpi.timeout()?;
        let fault = cli.mpi.fault()?;
        let mut world = World::init(timeout)?;
        if matches!(cli.command, Some(Command::Serve(_))) {
            // A server's pipeline idles between requests.
            world.serve_requests();
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| dispatch(&cli, &world, fault)));
        let message = match outcome {
            Ok(Ok(())) => {
                world.finish();
                return Ok(());
            }
            Ok(Err(e)) => e.to_string(),
            Err(payload) => format!(
                "panicked: {}",
                wgpar::threads::panic_message(&*payload).unwrap_or("?")
            ),
        };
        wgpar::dist::launch::stderr_line(&format!(
            "error: rank {} ({}): {message}",
            world.rank(),
            world.host()
        ));
        world.fail(&message)
    }

    fn dispatch(cli: &Cli, world: &World, fault: Option<RankFault>) -> Result<()> {
        if let Some(f) = fault {
            f.check(world.size())?;
        }
        match &cli.command {
            Some(Command::Devices { json }) => devices(world, *json),
            Some(Command::Run(args)) => run(world, args, fault),
            Some(Command::Allreduce(args)) => allreduce(world, args),
            Some(Command::Calibrate(args)) => calibrate(world, args),
            Some(Command::Serve(args)) => serve(world, args, fault),
            _ => Err(DistError::Unsupported {
                option: "this command".into(),
                why: "under mpirun wgpar runs `devices`, `run`, `allreduce`, `calibrate` and \
                      `serve`; run the others without mpirun"
                    .into(),
            }
            .into()),
        }
    }

    /// Says something on rank 0 only.
    macro_rules! say {
        ($world:expr, $($t:tt)*) => {
            if $world.rank() == 0 {
                outln!($($t)*)?;
            }
        };
    }

    /// A rank's device and model options.
    type RankOptions<'a> = (&'a DeviceArgs, &'a ModelArgs);

    /// `--gpu-memory` over ranks, before any rank opens its device: each rank accounts its
    /// own device on its own adapter ([`job::over_cap`]), and all refuse together.
    fn check_rank_caps(
        world: &World,
        (caps, (devices, model)): (Option<&String>, RankOptions<'_>),
        (config, strategy, work): (&ModelConfig, &Strategy, Workload),
        adapters: &Adapters,
    ) -> Result<()> {
        let Some(caps) = caps else {
            return Ok(());
        };
        let own = || -> Result<Option<String>> {
            let caps = parse_caps(caps, world.size())?;
            let selected = devices.selected(adapters)?;
            let dtype = model.choice().dtype_for(&selected, devices.force_f32)?;
            let format = model.choice().weight_format(config, dtype)?;
            let me = RankDevice {
                rank: world.rank(),
                ranks: world.size(),
                adapter: &selected[0],
                kv: devices.kv_dtypes(&selected)[0],
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

    /// This rank's devices opened and its part of `strategy` built from its own layers.
    fn open_rank(
        world: &World,
        (adapters, (devices, model)): (&Adapters, RankOptions<'_>),
        config: &ModelConfig,
        strategy: &Strategy,
    ) -> Result<(RankEngine, usize)> {
        let gpus = devices.open(adapters)?;
        let dtype = model.choice().dtype(&gpus)?;
        let load = |layers| model.choice().weights_of_layers(config, layers);
        let built = job::rank_engine(world, (&gpus, dtype), (config, strategy), load)?;
        Ok((built, gpus.len()))
    }

    /// `wgpar serve` over ranks: a pipeline (or hybrid) whose stages span the ranks, one lane
    /// per rank. Rank 0 listens and schedules; the other ranks serve their stages until it
    /// stops.
    fn serve(world: &World, args: &ServerArgs, fault: Option<RankFault>) -> Result<()> {
        let Prepared { config, text, opts } = server::prepare(args)?;
        refuse_for_ranks(args)?;
        let slots = opts.batch.slots;
        // One lane per rank keeps every rank's stages busy (more with --micro-batches).
        let strategy = args.strategy.strategy_with(world.size().clamp(1, slots))?;
        job::check_serving_strategy(&strategy, &format!("--strategy {}", args.strategy.strategy))?;
        check_lanes_have_slots(&strategy, slots)?;
        job::check_same_job(
            world,
            &format!(
                "{} layers {} hidden {} vocab {} dtype {} seed {} strategy {strategy:?} slots {} \
                 gpu-memory {:?}",
                config.name,
                config.layers,
                config.hidden,
                config.vocab,
                args.model.dtype,
                args.model.seed,
                slots,
                args.memory.gpu_memory
            ),
        )?;
        let adapters = Adapters::discover()?;
        let devices = (&args.devices, &args.model);
        let work = args.limits().serving_work(&config).1;
        let caps = (args.memory.gpu_memory.as_ref(), devices);
        check_rank_caps(world, caps, (&config, &strategy, work), &adapters)?;
        let (built, _) = open_rank(world, (&adapters, devices), &config, &strategy)?;
        let (_, stage_fault) = RankFault::arm(fault, world.rank());
        let batch = opts.batch;
        job::serve_rank(world, built.engine, stage_fault, |engine| {
            let build: EngineBuilder = Box::new(move || {
                let mut engine: Box<dyn StepEngine> = engine;
                wgpar::server::setup::warm_up(engine.as_mut(), batch)?;
                Ok(engine)
            });
            // mpirun answers SIGTERM by killing the job; rank 0 drains its requests first.
            eprintln!(
                "serving over {} ranks ({}); to drain and stop, SIGTERM rank 0: pid {}",
                world.size(),
                world.hosts().join(", "),
                std::process::id()
            );
            wgpar::server::run(opts, text, build)
        })
    }

    /// What `serve` takes in one process but not over ranks.
    fn refuse_for_ranks(args: &ServerArgs) -> Result<()> {
        let refused = [
            (args.pace.is_some(), "--pace", "ranks talk over a real link"),
            (
                args.inject_fault.is_some(),
                "--inject-fault",
                "over ranks, faults are --mpi-fault RANK:KIND[:AFTER]",
            ),
        ];
        match refused.into_iter().find(|(given, _, _)| *given) {
            Some((_, option, why)) => Err(DistError::Unsupported {
                option: option.into(),
                why: why.into(),
            }
            .into()),
            None => Ok(()),
        }
    }

    /// `wgpar run` over ranks: rank 0 (or every tensor-parallel rank) drives the timed run;
    /// the other pipeline ranks serve their stages; rank 0 says the rates and the pipeline.
    fn run(world: &World, args: &RunArgs, fault: Option<RankFault>) -> Result<()> {
        let (config, strategy, adapters) = planned_run(world, args)?;
        let devices = (&args.devices, &args.model);
        let (built, devices) = open_rank(world, (&adapters, devices), &config, &strategy)?;
        say!(
            world,
            "model {} ({} layers, hidden {}, {:.1}M params, {}) on {} ranks ({})",
            config.name,
            config.layers,
            config.hidden,
            config.params() as f64 / 1e6,
            built.storage,
            world.size(),
            world.hosts().join(", ")
        );
        let is_pipeline = matches!(
            strategy,
            Strategy::Pipeline { .. } | Strategy::Hybrid { .. }
        );
        let (mine, stage_fault) = RankFault::arm(fault, world.rank());
        let recorder = Recorder::new()
            .with_device_timing(DeviceTiming::parse(&args.device_timestamps).unwrap_or_default());
        let (local, last) = match built.engine {
            DistEngine::Driver(mut e) => {
                if let (Some(f), Some(p)) = (stage_fault, e.pipeline()) {
                    p.inject_fault(0, f)?;
                }
                // A tensor-parallel rank fails in the driver's loop itself.
                let tp_fault = mine.filter(|f| !is_pipeline && f.in_job());
                say!(world, "engine: {}", e.name());
                let timed = args.timed();
                timed.describe(&recorder, &config.name, &e.name());
                let done =
                    job::drive_timed(e.as_mut(), (&timed, config.vocab), &recorder, tp_fault)?;
                say!(world, "{}", render_rank_run(&done, args.batch).trim_end());
                if let (Some(path), 0) = (&args.logits_out, world.rank()) {
                    write_logits(path, args.batch, config.vocab, &done.generation)?;
                }
                let last = e.pipeline_stats().filter(|_| is_pipeline);
                drop(e);
                (
                    last.as_ref().map_or_else(Vec::new, |s| s.stages.clone()),
                    last,
                )
            }
            DistEngine::Server(mut s) => {
                if let Some(f) = stage_fault {
                    s.inject_fault(0, f)?;
                }
                s.serve(world)?;
                // Its spans go into this rank's trace.
                write_trace(world, args, s.recorder(), devices)?;
                if is_pipeline {
                    job::pipeline_over_ranks(world, &s.stage_stats(), None)?;
                }
                return Ok(());
            }
        };
        write_trace(world, args, &recorder, devices)?;
        if is_pipeline {
            if let Some(p) = job::pipeline_over_ranks(world, &local, last)? {
                say!(world, "{}", render_pipeline_over_ranks(&p).trim_end());
            }
        }
        Ok(())
    }

    /// The model and strategy of a run over the ranks, checked the same on every rank and,
    /// with `--gpu-memory`, against each rank's cap, before any rank opens its device; and
    /// the adapters found, once, for the rank to open its devices on.
    fn planned_run(world: &World, args: &RunArgs) -> Result<(ModelConfig, Strategy, Adapters)> {
        let config = checked_run(args)?;
        let strategy = args.strategy.strategy_with(1)?;
        job::check_same_job(
            world,
            &format!(
                "{} layers {} hidden {} vocab {} dtype {} seed {} strategy {strategy:?} batch {} prompt {} gen {} gpu-memory {:?}",
                config.name, config.layers, config.hidden, config.vocab, args.model.dtype, args.model.seed,
                args.batch, args.prompt_len, args.gen, args.memory.gpu_memory
            ),
        )?;
        let work = Workload {
            batch: args.batch,
            prompt: args.prompt_len,
        };
        let adapters = Adapters::discover()?;
        let caps = (
            args.memory.gpu_memory.as_ref(),
            (&args.devices, &args.model),
        );
        check_rank_caps(world, caps, (&config, &strategy, work), &adapters)?;
        Ok((config, strategy, adapters))
    }

    /// `run`'s options checked against what ranks do and the model's context; the model.
    fn checked_run(args: &RunArgs) -> Result<ModelConfig> {
        let refused = [
            (
                args.text.prompt.is_some(),
                "--prompt",
                "text generation runs in one process",
            ),
            (
                args.pace.is_some(),
                "--pace",
                "ranks talk over a real link; project a trace onto a profile instead",
            ),
        ];
        if let Some((_, option, why)) = refused.into_iter().find(|(given, _, _)| *given) {
            return Err(DistError::Unsupported {
                option: option.into(),
                why: why.into(),
            }
            .into());
        }
        args.text.refuse_tokenizer()?;
        let config = args.model.choice().config()?;
        if args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
            return Err(WgparError::option(
                "--batch",
                "--batch, --prompt-len and --gen must be positive".into(),
            ));
        }
        check_context(args.prompt_len, args.gen, &config)?;
        Ok(config)
    }

    /// Writes this rank's trace ([`job::write_rank_trace`]) and says where they all are.
    fn write_trace(
        world: &World,
        args: &RunArgs,
        recorder: &Recorder,
        devices: usize,
    ) -> Result<()> {
        let Some(path) = &args.trace else {
            return Ok(());
        };
        let run = format!(
            "--model {} --strategy {} --dtype {} --batch {} --prompt-len {} --gen {} --seed {}",
            args.model.model,
            args.strategy.strategy,
            args.model.dtype,
            args.batch,
            args.prompt_len,
            args.gen,
            args.model.seed
        );
        let files = job::write_rank_trace(world, recorder, (path, &run), devices)?;
        say!(
            world,
            "traces: {} (project them together: wgpar project --trace {} --host PROFILE)",
            files.join(", "),
            files.join(" --trace ")
        );
        Ok(())
    }

    fn devices(world: &World, json: bool) -> Result<()> {
        let adapters = Adapters::discover()?;
        let text = serde_json::to_string(adapters.list()).map_err(|source| WgparError::Json {
            what: "the adapter list".into(),
            source,
        })?;
        let all = world.gather_to_root(&text);
        if world.rank() != 0 {
            return Ok(());
        }
        out!("{}", render_rank_adapters(world.hosts(), &all, json)?)
    }

    /// Every rank calibrates its devices; rank 0 writes one profile of the job's machine(s).
    fn calibrate(world: &World, args: &CalibrateArgs) -> Result<()> {
        let config = args.model().choice().config()?;
        let options = args.options()?;
        // Every rank must measure the same shapes for one profile.
        world.check_same("wgpar version", env!("CARGO_PKG_VERSION"))?;
        world.check_same("calibration options", &format!("{config:?} {options:?}"))?;
        let adapters = Adapters::discover()?;
        let mut devices = args.devices().clone();
        if devices.devices.is_none() && devices.virtual_count.is_none() {
            // One device per rank unless told otherwise, as a pipeline over ranks runs.
            devices.virtual_count = Some(1);
        }
        args.check_fits(&config, &devices.selected(&adapters)?)?;
        let gpus = devices.open(&adapters)?;
        job::warn_if_bound(world, &gpus);
        let weights = ModelWeights::synthetic(&config, args.model().seed);
        let calibration =
            calibrate_ranks(world, &gpus, &weights, &options, &mut std::io::stdout())?;
        match calibration {
            Some(c) => args.write(&c),
            None => Ok(()),
        }
    }

    fn allreduce(world: &World, args: &AllreduceArgs) -> Result<()> {
        let cfg_err = |e: wgpar::comm::CommError| WgparError::option("allreduce", e.to_string());
        if args.op != "allreduce" {
            return Err(DistError::Unsupported {
                option: format!("--op {}", args.op),
                why: "across ranks wgpar measures the all-reduce".into(),
            }
            .into());
        }
        if parse_dtype(&args.dtype).map_err(cfg_err)? != DType::F32 {
            return Err(DistError::Unsupported {
                option: format!("-d {}", args.dtype),
                why: "the cross-process all-reduce sums f32 tensors (use --link f16 to halve \
                      the bytes on the link)"
                    .into(),
            }
            .into());
        }
        if args.algorithm.parse::<Algorithm>().map_err(cfg_err)? != Algorithm::Auto {
            return Err(DistError::Unsupported {
                option: format!("-a {}", args.algorithm),
                why: "across ranks the chunk size decides (--chunk)".into(),
            }
            .into());
        }
        let adapters = Adapters::discover()?;
        let mut devices = args.devices.clone();
        if devices.devices.is_none() && devices.virtual_count.is_none() {
            devices.virtual_count = Some(1);
        }
        let gpus = devices.open(&adapters)?;
        job::warn_if_bound(world, &gpus);
        if gpus.len() != 1 {
            return Err(DistError::Layout(format!(
                "the all-reduce across ranks uses one device per rank; rank {} opened {}",
                world.rank(),
                gpus.len()
            ))
            .into());
        }
        let mut config = CommConfig::default();
        if let Some(c) = &args.chunk {
            config.chunk_bytes = parse_size(c).map_err(cfg_err)?;
        }
        config.link = args.link.parse::<LinkPrecision>().map_err(cfg_err)?;
        config.validate()?;
        let opts = MpiBenchOptions {
            min_bytes: parse_size(&args.min).map_err(cfg_err)?,
            max_bytes: parse_size(&args.max).map_err(cfg_err)?,
            factor: args.factor,
            iters: args.iters,
            warmup: args.warmup,
            seed: 42,
            config,
        };
        if let Some(report) = run_bench(world, &gpus[0], &opts)? {
            if args.json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&report).map_err(|source| WgparError::Json {
                        what: "the all-reduce report".into(),
                        source,
                    })?
                )?;
            } else {
                out!("{report}")?;
            }
        }
        Ok(())
    }
}
