//! One rank's part of a job, what `wgpar run` and `wgpar serve` do under `mpirun`: every rank
//! checks that it runs the same job, refuses together where a rank's device cannot hold its
//! share (`--gpu-memory`), opens its devices and builds its part of the strategy; the driving
//! rank runs the timed generation; the stages' statistics and traces are gathered on rank 0.
//! The CLI parses, calls these and prints what they return on rank 0.

use std::ops::Range;
use std::sync::Arc;

use super::launch::{cpu_binding_warning, CpuBinding};
use super::{build, gather_stage_stats, rank_layers, DistDriver, DistEngine, DistError, World};
use crate::comm::CommConfig;
use crate::device::{AdapterDesc, DType, Gpu};
use crate::error::{human_bytes, Result, WgparError};
use crate::model::memory::{per_device, MemorySpec, WeightFormat, Workload};
use crate::model::{ModelConfig, ModelWeights};
use crate::parallel::timed::{storage_of, Timed, TimedRun};
use crate::parallel::{Fault, PipelineStats, StageStats, StepEngine, Strategy};
use crate::trace::{rank_keys, Recorder};

/// Checks that every rank runs this wgpar and the same `options` (a description of the model
/// and every option that shapes the job).
pub fn check_same_job(world: &World, options: &str) -> Result<()> {
    world.check_same("wgpar version", env!("CARGO_PKG_VERSION"))?;
    world.check_same("model and options", options)?;
    Ok(())
}

/// One rank's device as the memory accounting sees it: rank `rank` of `ranks` is device
/// `rank` of the strategy.
pub struct RankDevice<'a> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job (devices of the strategy).
    pub ranks: usize,
    /// This rank's adapter.
    pub adapter: &'a AdapterDesc,
    /// The KV-cache type it will store.
    pub kv: DType,
}

/// What a rank's share is accounted from.
pub struct RankShare<'a> {
    /// The model.
    pub config: &'a ModelConfig,
    /// How its weights are stored.
    pub format: &'a WeightFormat,
    /// The strategy over the ranks.
    pub strategy: &'a Strategy,
    /// The batch and prompt.
    pub work: Workload,
}

/// This rank's accounted bytes against its cap (`caps`: one per rank). `None` when they fit;
/// else what this rank needs, for the refusal every rank prints.
pub fn over_cap(
    share: &RankShare<'_>,
    caps: &[u64],
    me: &RankDevice<'_>,
) -> Result<Option<String>> {
    // Devices past the ends of the lists take this adapter's: only this rank's is read.
    let limits = [me
        .adapter
        .max_storage_binding
        .min(me.adapter.max_buffer_size)];
    let kv = [me.kv];
    let spec = MemorySpec {
        config: share.config,
        format: share.format,
        kv_dtypes: &kv,
        work: share.work,
        binding_limits: &limits,
    };
    let bytes = per_device(share.strategy, me.ranks, &spec)?;
    let (mine, cap) = (&bytes[me.rank], caps[me.rank]);
    Ok((mine.total() > cap).then(|| {
        format!(
            "needs {} of its {} cap: {}",
            human_bytes(mine.total()),
            human_bytes(cap),
            mine.describe()
        )
    }))
}

/// Gathers every rank's verdict (`own`: this rank's [`over_cap`], or why it could not be
/// accounted), so that all refuse together, naming each rank over its cap. Every rank must
/// call it, a rank whose own check failed too.
pub fn refuse_over_caps(world: &World, model: &str, own: Result<Option<String>>) -> Result<()> {
    let line = match own {
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
        "model '{model}' does not fit --gpu-memory over the ranks: {}. Lower --batch or \
         --max-seq, store the layers in fewer bits (--weights q8_0, q4_k), use more ranks, or \
         raise the cap",
        over.join("; ")
    )))
}

/// Warns (on this rank's stderr) when a rank bound to fewer CPUs drives a CPU driver.
pub fn warn_if_bound(world: &World, gpus: &[Arc<Gpu>]) {
    let cpu_adapter = gpus.iter().find(|g| g.info().is_cpu());
    let warning = CpuBinding::of_this_process()
        .and_then(|b| cpu_binding_warning(b, cpu_adapter.map(|g| g.info().name.as_str())));
    if let Some(w) = warning {
        super::launch::stderr_line(&format!(
            "warning: rank {} ({}): {w}",
            world.rank(),
            world.host()
        ));
    }
}

/// A rank's part of a strategy, built.
pub struct RankEngine {
    /// The engine: a driver, or a server of pipeline stages.
    pub engine: DistEngine,
    /// How the weights are held, with every rank's host bytes (for rank 0 to say).
    pub storage: String,
}

/// Builds this rank's part of `strategy` on its open `gpus` (warning where a bound rank
/// drives a CPU driver): `load` reads the layers the rank holds (a pipeline rank's own
/// stages' alone); the host weights are let go once the devices hold them.
pub fn rank_engine(
    world: &World,
    (gpus, dtype): (&[Arc<Gpu>], DType),
    (config, strategy): (&ModelConfig, &Strategy),
    load: impl FnOnce(Range<usize>) -> Result<ModelWeights>,
) -> Result<RankEngine> {
    warn_if_bound(world, gpus);
    let layers = rank_layers(world, strategy, gpus.len(), config.layers)?;
    let weights = load(layers.clone())?;
    let held = format!(
        "{} (layers {}..{})",
        human_bytes(weights.host_bytes()),
        layers.start,
        layers.end
    );
    let storage = format!(
        "{}, {}; host weights by rank: {}",
        storage_of(&weights, dtype),
        crate::parallel::timed::kv_of(gpus),
        world.all_gather(&held).join(", ")
    );
    let engine = build(
        world,
        strategy,
        gpus,
        &weights,
        dtype,
        &CommConfig::default(),
    )?;
    Ok(RankEngine { engine, storage })
}

/// Refuses a strategy a server cannot run over ranks: only pipeline stages (pp or hybrid)
/// span them, since only rank 0 hears the requests (`given` names the strategy option).
pub fn check_serving_strategy(strategy: &Strategy, given: &str) -> Result<()> {
    if matches!(
        strategy,
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. }
    ) {
        return Ok(());
    }
    Err(DistError::Unsupported {
        option: given.into(),
        why: "under mpirun the server runs pipeline stages over ranks (pp or hybrid): only \
              rank 0 hears the requests, and tensor parallelism would need every rank to run \
              the steps its scheduler picks"
            .into(),
    }
    .into())
}

/// Serves a rank's part of a pipeline: rank 0 (the driver) hands its serving engine to
/// `serve` (which listens until it is stopped); the other ranks serve their stages until
/// rank 0 stops the pipeline, ignoring SIGTERM and SIGINT, which mpirun passes to every rank.
/// `stage_fault` is injected into this rank's first stage.
pub fn serve_rank(
    world: &World,
    engine: DistEngine,
    stage_fault: Option<Fault>,
    serve: impl FnOnce(Box<dyn StepEngine + Send>) -> Result<()>,
) -> Result<()> {
    match engine {
        DistEngine::Driver(mut d) => {
            if let (Some(f), Some(p)) = (stage_fault, d.pipeline()) {
                p.inject_fault(0, f)?;
            }
            // Only a pipeline's driver serves (`check_serving_strategy` refuses the others
            // before any device opens); a caller that skipped it gets the strategy named.
            let name = d.name();
            let engine = d.into_serving().ok_or(WgparError::WrongStrategy {
                strategy: name,
                expected: "pipeline or hybrid".into(),
            })?;
            serve(engine)
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

/// A stage rank ignores SIGTERM and SIGINT and keeps serving until rank 0, which drains its
/// requests first, stops the pipeline.
fn leave_shutdown_to_rank_0() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code; it is done
    // before this rank starts serving and races with nothing.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
}

/// The driving rank's timed run ([`TimedRun`]): the untimed warm-up on every rank, then the
/// recorded prefill and generation. `tp_fault` (tensor parallelism) fails this rank's run
/// right after the prefill, with an error or a panic.
pub fn drive_timed(
    e: &mut dyn DistDriver,
    (run, vocab): (&TimedRun, usize),
    recorder: &Recorder,
    tp_fault: Option<super::RankFault>,
) -> Result<Timed> {
    let prompts = run.prompts(vocab);
    run.warm_up(e, vocab)?;
    e.set_recorder(recorder.clone());
    let start = std::time::Instant::now();
    let prefill = run.prefill(e, &prompts)?;
    if let Some(f) = tp_fault {
        if f.kind == super::RankFaultKind::Panic {
            panic!("injected panic");
        }
        return Err(WgparError::InjectedFault {
            kind: "error".into(),
            at: format!("tp rank {}, after the prefill", f.rank),
        });
    }
    let generation = run.generate(e, &prompts)?;
    Ok(Timed {
        prefill,
        generation,
        decode: e.last_step(),
        wall_s: start.elapsed().as_secs_f64(),
    })
}

/// The pipeline over every rank's stages, on rank 0 (`last`: its own pipeline's statistics
/// of the run; `None` elsewhere): each rank's `local` stages gathered and combined.
pub fn pipeline_over_ranks(
    world: &World,
    local: &[StageStats],
    last: Option<PipelineStats>,
) -> Result<Option<PipelineStats>> {
    let all = gather_stage_stats(world, local)?;
    Ok(last.map(|last| {
        PipelineStats::from_stages(
            all,
            last.schedule,
            last.makespan_s,
            last.tokens,
            last.microbatches,
            last.chain,
        )
    }))
}

/// Writes this rank's trace as `STEM.rankR.json`, with the rank, host and clock offset that
/// a merge needs and `run` (what every rank of one job shares, so that traces of different
/// runs do not merge); returns every rank's file on rank 0 (empty elsewhere).
pub fn write_rank_trace(
    world: &World,
    recorder: &Recorder,
    (path, run): (&str, &str),
    devices: usize,
) -> Result<Vec<String>> {
    let offset_us = recorder
        .epoch()
        .map(|e| e.saturating_duration_since(world.epoch()).as_secs_f64() * 1e6)
        .unwrap_or(0.0);
    recorder.set_meta(rank_keys::RANK, world.rank().to_string());
    recorder.set_meta(rank_keys::SIZE, world.size().to_string());
    recorder.set_meta(rank_keys::HOST, world.host());
    recorder.set_meta(rank_keys::CLOCK_OFFSET_US, format!("{offset_us:.3}"));
    recorder.set_meta(rank_keys::DEVICES, devices.to_string());
    recorder.set_meta(rank_keys::RUN, run.to_string());
    let file = crate::trace::rank_trace_path(path, world.rank());
    recorder.timeline().write_chrome_trace(&file)?;
    let files = world.gather_to_root(&file);
    Ok(if world.rank() == 0 { files } else { Vec::new() })
}
