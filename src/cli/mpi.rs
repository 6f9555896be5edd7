//! Running as MPI ranks: `mpirun -np N wgpar devices | run | allreduce`.
//!
//! Without the `mpi` feature this module only detects a launch and refuses it (N independent
//! copies of a run would each use every device and report N times).

use clap::Args;
use wgpar::dist::launch::CpuBinding;
use wgpar::dist::{launch, DistError};
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

/// How a rank is told to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
enum FaultKind {
    Error,
    Panic,
    Kill,
    Hang,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
struct Fault {
    rank: usize,
    kind: FaultKind,
    after: u64,
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
    fn fault(&self) -> Result<Option<Fault>> {
        let Some(text) = &self.mpi_fault else {
            return Ok(None);
        };
        let bad = || {
            wgpar::WgparError::option(
                "--mpi-fault",
                format!(
                "--mpi-fault {text}: expected RANK:KIND[:AFTER] with KIND error, panic, kill or \
                 hang, e.g. 1:error or 1:kill:500"
            ),
            )
        };
        let mut parts = text.split(':');
        let rank = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
        let kind = match parts.next() {
            Some("error") => FaultKind::Error,
            Some("panic") => FaultKind::Panic,
            Some("kill") => FaultKind::Kill,
            Some("hang") => FaultKind::Hang,
            _ => return Err(bad()),
        };
        let after = match parts.next() {
            Some(a) => a.parse().map_err(|_| bad())?,
            None => 0,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Some(Fault { rank, kind, after }))
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

/// The warning a rank prints when its launcher bound it to fewer CPUs than it may use while one
/// of its adapters is a CPU driver, whose worker threads then run on the rank's CPUs alone
/// (measured 1.6x slower per stage on this project's 2-core machine, docs/MULTINODE.md).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn cpu_binding_warning(binding: CpuBinding, cpu_adapter: Option<&str>) -> Option<String> {
    let adapter = cpu_adapter?;
    binding.is_restricted().then(|| {
        format!(
            "this rank may run on {} of the {} CPUs its launcher may use (it bound the rank), and its \
             adapter '{adapter}' is a CPU driver whose threads share those CPUs; to let them \
             use every core, start the ranks with `mpirun --bind-to none` (Open MPI), and \
             calibrate with the same launch",
            binding.allowed, binding.launcher
        )
    })
}

#[cfg(feature = "mpi")]
pub use ranks::main;

#[cfg(not(feature = "mpi"))]
/// Unreachable without the feature: [`MpiArgs::active`] refuses first.
pub fn main(_cli: super::Cli) -> Result<()> {
    Err(DistError::FeatureMissing.into())
}

#[cfg(feature = "mpi")]
mod ranks {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::Arc;
    use std::time::Instant;

    use wgpar::comm::bench::parse_dtype;
    use wgpar::comm::units::parse_size;
    use wgpar::comm::{Algorithm, CommConfig, LinkPrecision};
    use wgpar::device::{Adapters, DType, Gpu};
    use wgpar::dist::bench::{run_bench, MpiBenchOptions};
    use wgpar::dist::{build, calibrate_ranks, gather_stage_stats, DistEngine, DistError, World};
    use wgpar::error::human_bytes;
    use wgpar::model::ModelWeights;
    use wgpar::parallel::{
        generate, generate_keeping, Fault as StageFault, FaultKind as StageFaultKind,
        PipelineStats, StageStats, Strategy,
    };
    use wgpar::trace::{rank_keys, DeviceTiming, Recorder};
    use wgpar::{Result, WgparError};

    use super::{Fault, FaultKind};
    use crate::cli::allreduce::AllreduceArgs;
    use crate::cli::calibrate::CalibrateArgs;
    use crate::cli::memory::{MemoryArgs, RankDevice};
    use crate::cli::run::RunArgs;
    use crate::cli::server::{self, Prepared, ServerArgs};
    use crate::cli::{Cli, Command};
    use wgpar::model::memory::Workload;
    use wgpar::parallel::StepEngine;
    use wgpar::server::EngineBuilder;

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

    fn dispatch(cli: &Cli, world: &World, fault: Option<Fault>) -> Result<()> {
        if let Some(f) = fault {
            if f.rank >= world.size() {
                return Err(WgparError::option(
                    "--mpi-fault",
                    format!(
                        "--mpi-fault names rank {} of a {}-rank job",
                        f.rank,
                        world.size()
                    ),
                ));
            }
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

    /// `wgpar serve` over ranks: a pipeline (or hybrid) whose stages span the ranks. Rank 0
    /// listens and schedules; the other ranks serve their stages until it stops.
    fn serve(world: &World, args: &ServerArgs, fault: Option<Fault>) -> Result<()> {
        let Prepared { config, text, opts } = server::prepare(args)?;
        refuse_for_ranks(args)?;
        let strategy = serving_pipeline(world, args, &config, opts.batch.slots)?;
        let placed = RankPlacement {
            config: &config,
            strategy: &strategy,
            work: server::serving_work(args, &config).1,
        };
        let adapters = Adapters::discover()?;
        let devices = (&args.devices, &args.model);
        check_rank_caps(world, &args.memory, (&adapters, devices), &placed)?;
        let (engine, ..) = rank_engine(world, (&adapters, devices), &config, &strategy)?;
        let mine = fault.filter(|f| f.rank == world.rank());
        let stage_fault = mine.and_then(|f| match f.kind {
            FaultKind::Error | FaultKind::Panic => Some(stage_fault_of(f)),
            FaultKind::Kill | FaultKind::Hang => {
                self_signal(f.kind, f.after);
                None
            }
        });
        match engine {
            DistEngine::Driver(mut d) => {
                if let (Some(f), Some(p)) = (stage_fault, d.pipeline()) {
                    p.inject_fault(0, f)?;
                }
                let engine = d.into_serving().ok_or_else(|| {
                    WgparError::Internal("a pipeline's driver cannot serve".into())
                })?;
                let batch = opts.batch;
                let build: EngineBuilder = Box::new(move || {
                    let mut engine: Box<dyn StepEngine> = engine;
                    server::warm_up(engine.as_mut(), batch)?;
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
            }
            DistEngine::Server(mut s) => {
                if let Some(f) = stage_fault {
                    s.inject_fault(0, f)?;
                }
                leave_shutdown_to_rank_0();
                s.serve(world)
            }
        }
    }

    /// mpirun passes SIGTERM and SIGINT to every rank; a stage rank ignores them and keeps
    /// serving until rank 0, which drains its requests first, stops the pipeline.
    fn leave_shutdown_to_rank_0() {
        // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code; it is
        // done before this rank starts serving and races with nothing.
        unsafe {
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
            libc::signal(libc::SIGINT, libc::SIG_IGN);
        }
    }

    /// This rank's devices opened (warning where a bound rank drives a CPU driver), its
    /// weights loaded (a pipeline rank's own layers alone) and its part of `strategy` built,
    /// and how the weights are held (with every rank's host bytes); the weights are let go
    /// after.
    fn rank_engine(
        world: &World,
        (adapters, (devices, model)): (&Adapters, RankOptions<'_>),
        config: &wgpar::model::ModelConfig,
        strategy: &Strategy,
    ) -> Result<(DistEngine, Vec<Arc<Gpu>>, String)> {
        let gpus: Vec<Arc<Gpu>> = devices.open(adapters)?;
        warn_if_bound(world, &gpus);
        let dtype = model.dtype(&gpus)?;
        // A pipeline rank reads its own stages' layers alone.
        let layers = wgpar::dist::rank_layers(world, strategy, gpus.len(), config.layers)?;
        let weights = model.weights_of_layers(config, layers.clone())?;
        let held = format!(
            "{} (layers {}..{})",
            human_bytes(weights.host_bytes()),
            layers.start,
            layers.end
        );
        let storage = format!(
            "{}, {}; host weights by rank: {}",
            crate::cli::run::storage_of(&weights, dtype),
            crate::cli::run::kv_of(&gpus),
            world.all_gather(&held).join(", ")
        );
        let engine = build(
            world,
            strategy,
            &gpus,
            &weights,
            dtype,
            &CommConfig::default(),
        )?;
        Ok((engine, gpus, storage))
    }

    /// A rank's device and model options.
    type RankOptions<'a> = (&'a crate::cli::DeviceArgs, &'a crate::cli::ModelArgs);

    /// What a rank's share of a run is accounted from.
    struct RankPlacement<'a> {
        config: &'a wgpar::model::ModelConfig,
        strategy: &'a Strategy,
        work: Workload,
    }

    /// `--gpu-memory` over ranks, before any rank opens its device: each rank accounts its own
    /// device (rank r is device r of the strategy) on its own adapter, and every rank gathers
    /// the verdicts, so that all refuse together, naming each rank over its cap.
    fn check_rank_caps(
        world: &World,
        memory: &MemoryArgs,
        (adapters, (devices, model)): (&Adapters, RankOptions<'_>),
        placed: &RankPlacement<'_>,
    ) -> Result<()> {
        if memory.gpu_memory.is_none() {
            return Ok(());
        }
        let own = || -> Result<Option<String>> {
            let selected = devices.selected(adapters)?;
            let dtype = model.dtype_for(&selected, devices.force_f32)?;
            let format = model.weight_format(placed.config, dtype)?;
            let me = RankDevice {
                rank: world.rank(),
                ranks: world.size(),
                adapter: &selected[0],
                kv: devices.kv_dtypes(&selected)[0],
            };
            let parts = (placed.config, &format);
            memory.rank_over(parts, placed.strategy, placed.work, &me)
        };
        // Every rank takes part in the gather, a rank whose own check failed too.
        let line = match own() {
            Ok(verdict) => verdict.unwrap_or_default(),
            Err(e) => format!("cannot be accounted: {e}"),
        };
        let over: Vec<String> = (world.all_gather(&line).into_iter().enumerate())
            .filter(|(_, l)| !l.is_empty())
            .map(|(r, l)| format!("rank {r} ({}) {l}", world.hosts()[r]))
            .collect();
        if over.is_empty() {
            return Ok(());
        }
        Err(WgparError::Config(format!(
            "model '{}' does not fit --gpu-memory over the ranks: {}. Lower --batch or \
             --max-seq, store the layers in fewer bits (--weights q8_0, q4_k), use more ranks, \
             or raise the cap",
            placed.config.name,
            over.join("; ")
        )))
    }

    /// The pipeline a server runs over the ranks (tensor parallelism refused: only rank 0
    /// hears the requests), one lane per rank, checked the same on every rank.
    fn serving_pipeline(
        world: &World,
        args: &ServerArgs,
        config: &wgpar::model::ModelConfig,
        slots: usize,
    ) -> Result<Strategy> {
        // One lane per rank keeps every rank's stages busy (more with --micro-batches).
        let lanes = world.size().clamp(1, slots);
        let strategy = args.strategy.strategy_with(lanes)?;
        if !matches!(
            strategy,
            Strategy::Pipeline { .. } | Strategy::Hybrid { .. }
        ) {
            return Err(DistError::Unsupported {
                option: format!("--strategy {}", args.strategy.strategy),
                why: "under mpirun the server runs pipeline stages over ranks (pp or hybrid): \
                      only rank 0 hears the requests, and tensor parallelism would need every \
                      rank to run the steps its scheduler picks"
                    .into(),
            }
            .into());
        }
        crate::cli::bench_serve::check_lanes_have_slots(&strategy, slots)?;
        world.check_same("wgpar version", env!("CARGO_PKG_VERSION"))?;
        world.check_same(
            "model and options",
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
        Ok(strategy)
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

    /// A stage fault from `--mpi-fault` (error or panic after that many micro-batches).
    fn stage_fault_of(f: Fault) -> StageFault {
        StageFault {
            after: f.after as usize,
            kind: if f.kind == FaultKind::Panic {
                StageFaultKind::Panic
            } else {
                StageFaultKind::Error
            },
        }
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
        let parsed: Vec<serde_json::Value> = all
            .iter()
            .map(|t| serde_json::from_str(t).unwrap_or(serde_json::Value::Null))
            .collect();
        if json {
            let out: Vec<serde_json::Value> = parsed
                .into_iter()
                .enumerate()
                .map(|(r, a)| serde_json::json!({ "rank": r, "host": world.hosts()[r], "adapters": a }))
                .collect();
            outln!(
                "{}",
                serde_json::to_string_pretty(&out).map_err(|source| WgparError::Json {
                    what: "the ranks' adapters".into(),
                    source,
                })?
            )?;
            return Ok(());
        }
        for (r, list) in parsed.iter().enumerate() {
            outln!("rank {r} on {}:", world.hosts()[r])?;
            outln!(
                "  {:>3}  {:<40} {:<7} {:<13} {:>10} {:>12}",
                "idx",
                "name",
                "backend",
                "type",
                "max buffer",
                "max storage"
            )?;
            for d in list.as_array().into_iter().flatten() {
                let s = |k: &str| d[k].as_str().unwrap_or("").to_string();
                let n = |k: &str| d[k].as_u64().unwrap_or(0);
                let name: String = s("name").chars().take(40).collect();
                outln!(
                    "  {:>3}  {:<40} {:<7} {:<13} {:>10} {:>12}",
                    n("index"),
                    name,
                    s("backend"),
                    s("device_type"),
                    human_bytes(n("max_buffer_size")),
                    human_bytes(n("max_storage_binding"))
                )?;
                outln!("       driver: {} {}", s("driver"), s("driver_info"))?;
            }
        }
        Ok(())
    }

    /// Every rank calibrates its devices; rank 0 writes one profile of the job's machine(s).
    fn calibrate(world: &World, args: &CalibrateArgs) -> Result<()> {
        let config = args.model().config()?;
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
        warn_if_bound(world, &gpus);
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
        warn_if_bound(world, &gpus);
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

    /// Says something on rank 0 only.
    macro_rules! say {
        ($world:expr, $($t:tt)*) => {
            if $world.rank() == 0 {
                outln!($($t)*)?;
            }
        };
    }

    /// Warns (on this rank's stderr) when a bound rank drives a CPU driver.
    fn warn_if_bound(world: &World, gpus: &[Arc<Gpu>]) {
        let cpu_adapter = gpus.iter().find(|g| g.info().is_cpu());
        let warning = super::CpuBinding::of_this_process().and_then(|b| {
            super::cpu_binding_warning(b, cpu_adapter.map(|g| g.info().name.as_str()))
        });
        if let Some(w) = warning {
            wgpar::dist::launch::stderr_line(&format!(
                "warning: rank {} ({}): {w}",
                world.rank(),
                world.host()
            ));
        }
    }

    fn self_signal(kind: FaultKind, after_ms: u64) {
        let signal = if kind == FaultKind::Kill {
            "-KILL"
        } else {
            "-STOP"
        };
        let pid = std::process::id().to_string();
        let _ = std::thread::Builder::new()
            .name("mpi-fault".into())
            .spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(after_ms));
                let _ = std::process::Command::new("kill")
                    .args([signal, &pid])
                    .status();
            });
    }

    fn run(world: &World, args: &RunArgs, fault: Option<Fault>) -> Result<()> {
        let (config, strategy, adapters) = planned_run(world, args)?;
        let devices = (&args.devices, &args.model);
        let (engine, gpus, storage) = rank_engine(world, (&adapters, devices), &config, &strategy)?;
        say!(
            world,
            "model {} ({} layers, hidden {}, {:.1}M params, {storage}) on {} ranks ({})",
            config.name,
            config.layers,
            config.hidden,
            config.params() as f64 / 1e6,
            world.size(),
            world.hosts().join(", ")
        );
        let is_pipeline = matches!(
            strategy,
            Strategy::Pipeline { .. } | Strategy::Hybrid { .. }
        );
        let (mine, stage_fault) = rank_fault(world, fault);
        let recorder = Recorder::new()
            .with_device_timing(DeviceTiming::parse(&args.device_timestamps).unwrap_or_default());
        let run_stats = match engine {
            DistEngine::Driver(mut e) => {
                if let (Some(f), Some(p)) = (stage_fault, e.pipeline()) {
                    p.inject_fault(0, f)?;
                }
                // A tensor-parallel rank fails in the driver's loop itself.
                let tp_fault = mine.filter(|f| {
                    !is_pipeline && matches!(f.kind, FaultKind::Error | FaultKind::Panic)
                });
                let job = DriverJob {
                    world,
                    args,
                    config: &config,
                    recorder: &recorder,
                };
                let stats = job.drive(e.as_mut(), tp_fault)?;
                drop(e);
                stats.filter(|_| is_pipeline)
            }
            DistEngine::Server(mut s) => {
                if let Some(f) = stage_fault {
                    s.inject_fault(0, f)?;
                }
                s.serve(world)?;
                let local_stats = s.stage_stats();
                // Its spans go into this rank's trace.
                write_trace(world, args, s.recorder(), gpus.len())?;
                if is_pipeline {
                    let _ = gather_stage_stats(world, &local_stats)?;
                }
                return Ok(());
            }
        };
        write_trace(world, args, &recorder, gpus.len())?;
        if is_pipeline {
            let local = (run_stats.as_ref()).map_or_else(Vec::new, |s| s.stages.clone());
            let all = gather_stage_stats(world, &local)?;
            if let Some(last) = run_stats {
                say_pipeline(world, all, last)?;
            }
        }
        Ok(())
    }

    /// This rank's `--mpi-fault`, if it names this rank: a kill or hang is armed now (a signal
    /// to itself); an error or panic is returned as the stage fault it injects.
    fn rank_fault(world: &World, fault: Option<Fault>) -> (Option<Fault>, Option<StageFault>) {
        let mine = fault.filter(|f| f.rank == world.rank());
        if let Some(f) = mine {
            if matches!(f.kind, FaultKind::Kill | FaultKind::Hang) {
                self_signal(f.kind, f.after);
            }
        }
        let stage_fault = mine
            .filter(|f| matches!(f.kind, FaultKind::Error | FaultKind::Panic))
            .map(stage_fault_of);
        (mine, stage_fault)
    }

    /// The model and strategy of a run over the ranks, checked the same on every rank and,
    /// with `--gpu-memory`, against each rank's cap, before any rank opens its device; and
    /// the adapters found, once, for the rank to open its devices on.
    fn planned_run(
        world: &World,
        args: &RunArgs,
    ) -> Result<(wgpar::model::ModelConfig, Strategy, Adapters)> {
        let config = checked_run(args)?;
        let strategy = args.strategy.strategy_with(1)?;
        // Every rank must run the same model, options and wgpar.
        world.check_same("wgpar version", env!("CARGO_PKG_VERSION"))?;
        world.check_same(
            "model and options",
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
        let placed = RankPlacement {
            config: &config,
            strategy: &strategy,
            work,
        };
        let adapters = Adapters::discover()?;
        let devices = (&args.devices, &args.model);
        check_rank_caps(world, &args.memory, (&adapters, devices), &placed)?;
        Ok((config, strategy, adapters))
    }

    /// `run`'s options checked against what ranks do and the model's context; the model.
    fn checked_run(args: &RunArgs) -> Result<wgpar::model::ModelConfig> {
        if args.text.prompt.is_some() {
            return Err(DistError::Unsupported {
                option: "--prompt".into(),
                why: "text generation runs in one process".into(),
            }
            .into());
        }
        args.text.refuse_tokenizer()?;
        if args.pace.is_some() {
            return Err(DistError::Unsupported {
                option: "--pace".into(),
                why: "ranks talk over a real link; project a trace onto a profile instead".into(),
            }
            .into());
        }
        let config = args.model.config()?;
        if args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
            return Err(WgparError::option(
                "--batch",
                "--batch, --prompt-len and --gen must be positive".into(),
            ));
        }
        crate::cli::check_context(args.prompt_len, args.gen, &config)?;
        Ok(config)
    }

    /// What the driving rank's measured run needs.
    struct DriverJob<'a> {
        world: &'a World,
        args: &'a RunArgs,
        config: &'a wgpar::model::ModelConfig,
        recorder: &'a Recorder,
    }

    impl DriverJob<'_> {
        /// An untimed pass, then the recorded prefill and decode, said on rank 0; the
        /// pipeline's statistics of the run (pipelines only).
        fn drive(
            &self,
            e: &mut dyn wgpar::dist::DistDriver,
            tp_fault: Option<Fault>,
        ) -> Result<Option<PipelineStats>> {
            let (world, args, config) = (self.world, self.args, self.config);
            say!(world, "engine: {}", e.name());
            let prompts = crate::cli::run::synthetic_prompts(args, config.vocab);
            // One untimed pass compiles pipelines and allocates buffers on every rank.
            generate(e, &prompts, 2)?;
            let processed = args.batch * (2 * args.prompt_len + args.gen - 1);
            let recorder = self.recorder;
            recorder.set_meta("model", config.name.clone());
            recorder.set_meta("strategy", e.name());
            recorder.set_meta("batch", args.batch.to_string());
            recorder.set_meta("prompt_len", args.prompt_len.to_string());
            recorder.set_meta("gen", args.gen.to_string());
            recorder.set_meta("tokens", processed.to_string());
            e.set_recorder(recorder.clone());
            let start = Instant::now();
            e.prefill(&prompts)?;
            let prefill_stats = e.last_step();
            if let Some(f) = tp_fault {
                if f.kind == FaultKind::Panic {
                    panic!("injected panic");
                }
                return Err(WgparError::InjectedFault {
                    kind: "error".into(),
                    at: format!("tp rank {}, after the prefill", f.rank),
                });
            }
            let keep = crate::cli::run::keep_for(args);
            let g = generate_keeping(e, &prompts, args.gen, keep)?;
            let wall = start.elapsed().as_secs_f64();
            self.say_run(&g, (prefill_stats, e.last_step()), wall)?;
            if let Some(path) = &args.logits_out {
                if world.rank() == 0 {
                    crate::cli::run::write_logits(path, args.batch, config.vocab, &g)?;
                }
            }
            Ok(e.pipeline_stats())
        }

        /// The run's prefill and decode rates, the first sequence's tokens and the recorded
        /// phase's time (rank 0).
        fn say_run(
            &self,
            g: &wgpar::parallel::Generation,
            (prefill, decode): (
                Option<wgpar::parallel::StepStats>,
                Option<wgpar::parallel::StepStats>,
            ),
            wall: f64,
        ) -> Result<()> {
            let world = self.world;
            say!(
                world,
                "prefill: {} tokens in {:.1} ms = {:.1} tokens/s",
                g.prompt_tokens,
                g.prefill_s * 1e3,
                g.prefill_tokens_per_s()
            );
            if let Some(s) = &prefill {
                say!(world, "  {}", s.per_token_line());
            }
            let per_step_ms = g.decode_s / g.decode_steps.max(1) as f64 * 1e3;
            say!(
                world,
                "decode: {} steps x {} sequences, {:.2} ms per step = {:.1} tokens/s",
                g.decode_steps,
                self.args.batch,
                per_step_ms,
                g.decode_tokens_per_s()
            );
            if let Some(s) = &decode {
                say!(world, "  {}", s.per_token_line());
            }
            say!(world, "first sequence's tokens: {:?}", g.tokens[0]);
            say!(world, "recorded phase: {:.1} ms", wall * 1e3);
            Ok(())
        }
    }

    /// The pipeline over every rank's stages (rank 0).
    fn say_pipeline(world: &World, all: Vec<StageStats>, last: PipelineStats) -> Result<()> {
        let combined = PipelineStats::from_stages(
            all,
            last.schedule,
            last.makespan_s,
            last.tokens,
            last.microbatches,
            last.chain,
        );
        say!(
            world,
            "pipeline over ranks (last run, {} passes per stage, {} lanes, {}): {:.1} tokens/s, makespan {:.1} ms; ideal from the measured stage times {:.1} ms: {:.0} % of ideal throughput; bubble {:.0} % measured vs {:.0} % for a perfect pipeline",
            combined.passes,
            combined.microbatches,
            combined.schedule,
            combined.tokens_per_s(),
            combined.makespan_s * 1e3,
            combined.ideal_makespan_s * 1e3,
            combined.ideal_makespan_s / combined.makespan_s * 100.0,
            combined.measured_bubble * 100.0,
            combined.theoretical_bubble * 100.0
        );
        for (i, st) in combined.stages.iter().enumerate() {
            say!(
                world,
                "  stage {i}: layers {}..{} on {}: busy {:.1} ms, hand-off {:.1} ms, {} micro-batches",
                st.layers.start,
                st.layers.end,
                st.device,
                st.busy_s * 1e3,
                st.handoff_s() * 1e3,
                st.microbatches
            );
        }
        Ok(())
    }

    /// Writes this rank's trace as `STEM.rankR.json` (with the rank, host and clock offset that
    /// a merge needs).
    fn write_trace(
        world: &World,
        args: &RunArgs,
        recorder: &Recorder,
        devices: usize,
    ) -> Result<()> {
        let Some(path) = &args.trace else {
            return Ok(());
        };
        let offset_us = recorder
            .epoch()
            .map(|e| e.saturating_duration_since(world.epoch()).as_secs_f64() * 1e6)
            .unwrap_or(0.0);
        recorder.set_meta(rank_keys::RANK, world.rank().to_string());
        recorder.set_meta(rank_keys::SIZE, world.size().to_string());
        recorder.set_meta(rank_keys::HOST, world.host());
        recorder.set_meta(rank_keys::CLOCK_OFFSET_US, format!("{offset_us:.3}"));
        recorder.set_meta(rank_keys::DEVICES, devices.to_string());
        // What every rank of one job shares, so that traces of different runs do not merge.
        recorder.set_meta(
            rank_keys::RUN,
            format!(
                "--model {} --strategy {} --dtype {} --batch {} --prompt-len {} --gen {} --seed {}",
                args.model.model,
                args.strategy.strategy,
                args.model.dtype,
                args.batch,
                args.prompt_len,
                args.gen,
                args.model.seed
            ),
        );
        let file = wgpar::trace::rank_trace_path(path, world.rank());
        let timeline = recorder.timeline();
        timeline.write_chrome_trace(&file)?;
        let files = world.gather_to_root(&file);
        say!(
            world,
            "traces: {} (project them together: wgpar project --trace {} --host PROFILE)",
            files.join(", "),
            files.join(" --trace ")
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_rank_with_a_cpu_driver_is_warned() {
        let bound = CpuBinding {
            allowed: 1,
            launcher: 2,
        };
        let free = CpuBinding {
            allowed: 2,
            launcher: 2,
        };
        let w = cpu_binding_warning(bound, Some("llvmpipe")).unwrap();
        assert!(
            w.contains("1 of the 2 CPUs") && w.contains("--bind-to none"),
            "{w}"
        );
        assert!(w.contains("'llvmpipe'"), "{w}");
        assert_eq!(cpu_binding_warning(free, Some("llvmpipe")), None);
        // A GPU rank bound to a core is what launchers intend.
        assert_eq!(cpu_binding_warning(bound, None), None);
    }
}
