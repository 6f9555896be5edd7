//! Running as MPI ranks: `mpirun -np N wgpar devices | run | allreduce`.
//!
//! Without the `mpi` feature this module only detects a launch and refuses it (N independent
//! copies of a run would each use every device and report N times).

#[cfg(feature = "mpi")]
pub use ranks::main;

#[cfg(not(feature = "mpi"))]
/// Unreachable without the feature: `MpiArgs::active` refuses first.
pub fn main(_cli: super::commands::Cli) -> wgpar::Result<()> {
    Err(wgpar::dist::DistError::FeatureMissing.into())
}

/// The commands under `mpirun`: each parses as in one process, calls the rank's part of the
/// job in [`wgpar::dist`] and says the result on rank 0.
#[cfg(feature = "mpi")]
mod ranks {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use wgpar::device::Adapters;
    use wgpar::dist::bench::run_bench;
    use wgpar::dist::job;
    use wgpar::dist::options::{refuse_given, AllreduceChoice, RankJob, RankRun};
    use wgpar::dist::report::render_rank_adapters;
    use wgpar::dist::run_ranks::{self, RanksRun};
    use wgpar::dist::serve_ranks::{self, RankServe};
    use wgpar::dist::{calibrate_ranks, DistError, RankFault, World};
    use wgpar::model::ModelWeights;
    use wgpar::{Result, WgparError};

    use crate::cli::allreduce::AllreduceArgs;
    use crate::cli::calibrate::CalibrateArgs;
    use crate::cli::commands::{Cli, Command};
    use crate::cli::options::{DeviceArgs, MemoryArgs, ModelArgs, RunArgs};
    use crate::cli::server::{self, Prepared, ServerArgs};

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

    /// A rank's devices, model and caps from the options.
    fn rank_job<'a>(
        devices: &DeviceArgs,
        model: &'a ModelArgs,
        memory: &'a MemoryArgs,
    ) -> RankJob<'a> {
        RankJob {
            devices: devices.choice(),
            model: model.choice(),
            gpu_memory: memory.gpu_memory.as_deref(),
        }
    }

    /// `wgpar serve` over ranks ([`serve_ranks::serve`]).
    fn serve(world: &World, args: &ServerArgs, fault: Option<RankFault>) -> Result<()> {
        let Prepared { config, text, opts } = server::prepare(args)?;
        refuse_given(&[
            (args.pace.is_some(), "--pace", "ranks talk over a real link"),
            (
                args.inject_fault.is_some(),
                "--inject-fault",
                "over ranks, faults are --mpi-fault RANK:KIND[:AFTER]",
            ),
        ])?;
        let strategy = args.strategy.choice();
        let served = RankServe {
            job: rank_job(&args.devices, &args.model, &args.memory),
            strategy: &strategy,
            work: args.limits().serving_work(&config).1,
            config,
            text,
            opts,
        };
        serve_ranks::serve(world, served, fault)
    }

    /// `wgpar run` over ranks ([`run_ranks::run`]); rank 0 says what it reports.
    fn run(world: &World, args: &RunArgs, fault: Option<RankFault>) -> Result<()> {
        if args.text.prompt.is_none() {
            args.text.refuse_tokenizer()?;
        }
        let trace = args.trace.as_deref().map(|path| {
            let (m, s) = (&args.model, &args.strategy.strategy);
            let run = format!(
                "--model {} --strategy {s} --dtype {} --batch {} --prompt-len {} --gen {} \
                 --seed {}",
                m.model,
                m.dtype,
                args.batch,
                args.prompt_len,
                args.gen,
                m.choice().seed
            );
            (path, run)
        });
        let strategy = args.strategy.choice();
        let r = RanksRun {
            job: rank_job(&args.devices, &args.model, &args.memory),
            strategy: &strategy,
            run: RankRun {
                batch: args.batch,
                prompt_len: args.prompt_len,
                gen: args.gen,
            },
            timed: args.timed(),
            refused: (args.text.prompt.is_some(), args.pace.is_some()),
            device_timestamps: &args.device_timestamps,
            logits_out: args.logits_out.as_deref(),
            trace,
        };
        run_ranks::run(world, &r, fault, &mut |text| outln!("{text}"))
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
        // One device per rank unless told otherwise, as a pipeline over ranks runs.
        let devices = args.devices().choice().one_unless_named();
        args.check_fits(&config, &devices.selected(&adapters)?)?;
        let gpus = devices.open(&adapters)?;
        job::warn_if_bound(world, &gpus);
        let weights = ModelWeights::synthetic(&config, args.model().choice().seed);
        let calibration =
            calibrate_ranks(world, &gpus, &weights, &options, &mut std::io::stdout())?;
        match calibration {
            Some(c) => args.write(&c),
            None => Ok(()),
        }
    }

    fn allreduce(world: &World, args: &AllreduceArgs) -> Result<()> {
        let opts = AllreduceChoice {
            op: &args.op,
            dtype: &args.dtype,
            algorithm: &args.algorithm,
            chunk: args.chunk.as_deref(),
            link: &args.link,
            sizes: (&args.min, &args.max),
            factor: args.factor,
            iters: (args.iters, args.warmup),
        }
        .options()?;
        let adapters = Adapters::discover()?;
        let gpus = args.devices.choice().one_unless_named().open(&adapters)?;
        job::warn_if_bound(world, &gpus);
        if gpus.len() != 1 {
            return Err(DistError::Layout(format!(
                "the all-reduce across ranks uses one device per rank; rank {} opened {}",
                world.rank(),
                gpus.len()
            ))
            .into());
        }
        if let Some(report) = run_bench(world, &gpus[0], &opts)? {
            if args.json {
                let text =
                    serde_json::to_string_pretty(&report).map_err(|source| WgparError::Json {
                        what: "the all-reduce report".into(),
                        source,
                    })?;
                outln!("{text}")?;
            } else {
                out!("{report}")?;
            }
        }
        Ok(())
    }
}
