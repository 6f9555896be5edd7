//! `wgpar run` over MPI ranks: rank 0 (or every tensor-parallel rank) drives the timed run;
//! the other pipeline ranks serve their stages; rank 0 says the model, the rates and the
//! pipeline over the ranks, and where every rank's trace went.

use super::job;
use super::options::{RankJob, RankRun};
use super::report::{render_pipeline_over_ranks, render_rank_run};
use super::{DistEngine, RankFault, World};
use crate::error::Result;
use crate::parallel::choice::StrategyChoice;
use crate::parallel::timed::{write_logits, TimedRun};
use crate::parallel::{PipelineStats, StageStats, Strategy};
use crate::trace::{DeviceTiming, Recorder};

/// What a run over ranks is made of, as a command gives it.
pub struct RanksRun<'a> {
    /// The rank's devices, model and caps.
    pub job: RankJob<'a>,
    /// The strategy over the ranks.
    pub strategy: &'a StrategyChoice,
    /// The batch, prompt and generation.
    pub run: RankRun,
    /// The timed run (with the logits `logits_out` needs kept).
    pub timed: TimedRun,
    /// Whether `--prompt` and `--pace` were given (refused over ranks).
    pub refused: (bool, bool),
    /// `--device-timestamps`.
    pub device_timestamps: &'a str,
    /// `--logits-out`, written on rank 0.
    pub logits_out: Option<&'a str>,
    /// `--trace` and a description of the run every rank's trace carries.
    pub trace: Option<(&'a str, String)>,
}

/// Runs this rank's part; `say` is called with what rank 0 reports, as it happens.
pub fn run(
    world: &World,
    r: &RanksRun<'_>,
    fault: Option<RankFault>,
    say: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<()> {
    let mut say = |text: &str| match world.rank() {
        0 => say(text.trim_end()),
        _ => Ok(()),
    };
    let (config, strategy, adapters) = r.job.plan_run(world, r.strategy, r.run, r.refused)?;
    let (built, devices) = r.job.open(world, &adapters, (&config, &strategy))?;
    say(&format!(
        "model {} ({} layers, hidden {}, {:.1}M params, {}) on {} ranks ({})",
        config.name,
        config.layers,
        config.hidden,
        config.params() as f64 / 1e6,
        built.storage,
        world.size(),
        world.hosts().join(", ")
    ))?;
    let is_pipeline = matches!(
        strategy,
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. }
    );
    let (mine, stage_fault) = RankFault::arm(fault, world.rank());
    let timing = DeviceTiming::parse(r.device_timestamps).unwrap_or_default();
    let recorder = Recorder::new().with_device_timing(timing);
    let (local, last) = match built.engine {
        DistEngine::Driver(mut e) => {
            if let (Some(f), Some(p)) = (stage_fault, e.pipeline()) {
                p.inject_fault(0, f)?;
            }
            // A tensor-parallel rank fails in the driver's loop itself.
            let tp_fault = mine.filter(|f| !is_pipeline && f.in_job());
            say(&format!("engine: {}", e.name()))?;
            r.timed.describe(&recorder, &config.name, &e.name());
            let vocab = config.vocab;
            let done = job::drive_timed(e.as_mut(), (&r.timed, vocab), &recorder, tp_fault)?;
            say(&render_rank_run(&done, r.run.batch))?;
            if let (Some(path), 0) = (r.logits_out, world.rank()) {
                write_logits(path, r.run.batch, vocab, &done.generation)?;
            }
            let last = e.pipeline_stats().filter(|_| is_pipeline);
            drop(e);
            let local = last.as_ref().map_or_else(Vec::new, |s| s.stages.clone());
            (local, last)
        }
        DistEngine::Server(mut s) => {
            if let Some(f) = stage_fault {
                s.inject_fault(0, f)?;
            }
            s.serve(world)?;
            // Its spans go into this rank's trace.
            write_trace(world, r, s.recorder(), devices, &mut say)?;
            if is_pipeline {
                job::pipeline_over_ranks(world, &s.stage_stats(), None)?;
            }
            return Ok(());
        }
    };
    write_trace(world, r, &recorder, devices, &mut say)?;
    say_pipeline(world, is_pipeline, (&local, last), &mut say)
}

/// The pipeline over every rank's stages, said on rank 0.
fn say_pipeline(
    world: &World,
    is_pipeline: bool,
    (local, last): (&[StageStats], Option<PipelineStats>),
    say: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<()> {
    if !is_pipeline {
        return Ok(());
    }
    match job::pipeline_over_ranks(world, local, last)? {
        Some(p) => say(&render_pipeline_over_ranks(&p)),
        None => Ok(()),
    }
}

/// Writes this rank's trace ([`job::write_rank_trace`]) and says where they all are.
fn write_trace(
    world: &World,
    r: &RanksRun<'_>,
    recorder: &Recorder,
    devices: usize,
    say: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<()> {
    let Some((path, run)) = &r.trace else {
        return Ok(());
    };
    let files = job::write_rank_trace(world, recorder, (path, run), devices)?;
    if files.is_empty() {
        return Ok(());
    }
    say(&format!(
        "traces: {} (project them together: wgpar project --trace {} --host PROFILE)",
        files.join(", "),
        files.join(" --trace ")
    ))
}
