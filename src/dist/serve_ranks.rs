//! `wgpar serve` over MPI ranks: a pipeline (or hybrid) whose stages span the ranks, one
//! lane per rank. Rank 0 listens and schedules; the other ranks serve their stages until it
//! stops.

use super::job;
use super::options::RankJob;
use super::{RankFault, World};
use crate::device::Adapters;
use crate::error::Result;
use crate::model::memory::Workload;
use crate::model::ModelConfig;
use crate::parallel::choice::{check_lanes_have_slots, StrategyChoice};
use crate::parallel::StepEngine;
use crate::server::{EngineBuilder, ServerOptions, TextModel};

/// What a server over ranks is built from: the rank's job, the strategy, and what the server
/// needs besides its engine (all checked by the caller).
pub struct RankServe<'a> {
    /// The rank's devices, model and caps.
    pub job: RankJob<'a>,
    /// The strategy over the ranks.
    pub strategy: &'a StrategyChoice,
    /// The model.
    pub config: ModelConfig,
    /// Its text side.
    pub text: TextModel,
    /// The listener's and the scheduler's options.
    pub opts: ServerOptions,
    /// The work the memory accounting sizes.
    pub work: Workload,
}

/// Serves over the ranks until rank 0 is stopped (SIGINT or SIGTERM); `fault` fails a rank
/// (tests of the failure path).
pub fn serve(world: &World, serve: RankServe<'_>, fault: Option<RankFault>) -> Result<()> {
    let RankServe {
        job: rank,
        strategy: choice,
        config,
        text,
        opts,
        work,
    } = serve;
    let slots = opts.batch.slots;
    // One lane per rank keeps every rank's stages busy (more with --micro-batches).
    let strategy = choice.over_ranks(world.size().clamp(1, slots))?;
    job::check_serving_strategy(&strategy, &format!("--strategy {}", choice.strategy))?;
    check_lanes_have_slots(&strategy, slots)?;
    rank.check_same_job(world, &config, &strategy, &format!("slots {slots}"))?;
    let adapters = Adapters::discover()?;
    rank.check_caps(world, (&config, &strategy, work), &adapters)?;
    let (built, _) = rank.open(world, &adapters, (&config, &strategy))?;
    let (_, stage_fault) = RankFault::arm(fault, world.rank());
    let batch = opts.batch;
    job::serve_rank(world, built.engine, stage_fault, |engine| {
        let build: EngineBuilder = Box::new(move || {
            let mut engine: Box<dyn StepEngine> = engine;
            crate::server::setup::warm_up(engine.as_mut(), batch)?;
            Ok(engine)
        });
        // mpirun answers SIGTERM by killing the job; rank 0 drains its requests first.
        eprintln!(
            "serving over {} ranks ({}); to drain and stop, SIGTERM rank 0: pid {}",
            world.size(),
            world.hosts().join(", "),
            std::process::id()
        );
        crate::server::run(opts, text, build)
    })
}
