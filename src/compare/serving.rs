//! The serving section of `wgpar compare`: every strategy under the same stream of requests
//! (continuous batching, pipelines with one lane per stage in flight), side by side on
//! throughput, time to first token and time per output token, measured here and projected
//! onto each host profile by replaying the run's timeline.

use std::sync::Arc;

use serde::Serialize;

use super::{CompareOptions, Plan};
use crate::batching::{
    project_metrics, serve, Length, Rate, ServeMetrics, ServeOptions, ServeRun, WorkloadSpec,
};
use crate::comm::CommConfig;
use crate::device::Gpu;
use crate::error::{Result, WgparError};
use crate::model::{valid_tp_degrees, ModelWeights};
use crate::parallel::{
    build_step_engine, PartitionSpec, PipelineStats, Schedule, StepEngine, Strategy,
};
use crate::sim::{CollectivePolicy, ProjectOptions};
use crate::trace::{Recorder, Timeline};

/// The stream of requests every strategy serves.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServingOptions {
    /// Requests.
    pub requests: usize,
    /// Arrival rate (`inf`: all at once, the heaviest load).
    pub rate: Rate,
    /// Prompt tokens per request.
    pub prompt_len: Length,
    /// Tokens generated per request.
    pub output_len: Length,
    /// KV slots (sequences in the running batches at once).
    pub max_batch: usize,
    /// Seed of the workload.
    pub seed: u64,
}

/// One strategy projected onto one host profile.
#[derive(Debug, Clone, Serialize)]
pub struct ServingProjected {
    /// Profile name.
    pub profile: String,
    /// The run replayed there.
    pub metrics: ServeMetrics,
}

/// One strategy under the stream.
#[derive(Debug, Clone, Serialize)]
pub struct ServingMeasurement {
    /// Strategy label, e.g. `pp4 m=4`.
    pub label: String,
    /// Strategy family: single, tp, pp, hybrid.
    pub family: String,
    /// Devices used.
    pub devices: usize,
    /// Steps in flight at once (pipeline lanes).
    pub lanes: usize,
    /// Measured figures.
    pub metrics: ServeMetrics,
    /// Pipeline accounting (pipelines).
    pub pipeline: Option<PipelineStats>,
    /// Projections onto each profile.
    pub projected: Vec<ServingProjected>,
    /// The run's timeline.
    #[serde(skip)]
    pub timeline: Timeline,
    /// Every request's tokens (checked against the single device).
    #[serde(skip)]
    pub tokens: Vec<Vec<u32>>,
}

/// The serving section of a comparison.
#[derive(Debug, Clone, Serialize)]
pub struct ServingSection {
    /// The stream.
    pub options: ServingOptions,
    /// Every strategy.
    pub measurements: Vec<ServingMeasurement>,
}

/// The strategies to serve with on `n` devices: single; TP over 2 and n; PP over 2 and n
/// stages with one lane per stage; and, with 4 or more devices, TP=2 groups in n/2 stages.
pub fn serving_plans(opts: &CompareOptions, n: usize) -> Vec<Plan> {
    let config = &opts.config;
    let valid = valid_tp_degrees(config);
    let mut out = vec![Plan {
        label: "single".into(),
        family: "single",
        strategy: Strategy::Single,
        devices: 1,
        batch: 0,
        micro_batches: 1,
    }];
    let mut degrees: Vec<usize> = [2, n]
        .into_iter()
        .filter(|d| *d >= 2 && *d <= n && valid.contains(d))
        .collect();
    degrees.dedup();
    for t in degrees {
        out.push(Plan {
            label: format!("tp{t}"),
            family: "tp",
            strategy: Strategy::Tensor { split: None },
            devices: t,
            batch: 0,
            micro_batches: 1,
        });
    }
    let mut stages: Vec<usize> = [2, n]
        .into_iter()
        .filter(|p| *p >= 2 && *p <= n && *p <= config.layers)
        .collect();
    stages.dedup();
    for p in stages {
        out.push(Plan {
            label: format!("pp{p} m={p}"),
            family: "pp",
            strategy: Strategy::Pipeline {
                partition: PartitionSpec::Even,
                micro_batches: p,
                schedule: Schedule::InFlight,
            },
            devices: p,
            batch: 0,
            micro_batches: p,
        });
    }
    if n >= 4 && n.is_multiple_of(2) && valid.contains(&2) && n / 2 <= config.layers {
        out.push(Plan {
            label: format!("tp2xpp{0} m={0}", n / 2),
            family: "hybrid",
            strategy: Strategy::Hybrid {
                tp: 2,
                partition: PartitionSpec::Even,
                micro_batches: n / 2,
                schedule: Schedule::InFlight,
            },
            devices: n,
            batch: 0,
            micro_batches: n / 2,
        });
    }
    out
}

/// Checks the stream against the model before any device work.
pub(super) fn validate(opts: &CompareOptions, serving: &ServingOptions) -> Result<()> {
    if serving.requests == 0 || serving.max_batch == 0 {
        return Err(WgparError::option(
            "--requests",
            "the serving section needs at least one request and one KV slot".into(),
        ));
    }
    let need = serving.prompt_len.max() + serving.output_len.max() - 1;
    if need > opts.config.max_seq {
        return Err(WgparError::limit(
            "context (tokens)",
            (need as u64, opts.config.max_seq as u64),
            format!(
            "serving requests of up to {} prompt + {} generated tokens need {need} tokens of KV \
             cache; model '{}' holds {} per sequence",
            serving.prompt_len.max(),
            serving.output_len.max(),
            opts.config.name,
            opts.config.max_seq
        ),
        ));
    }
    Ok(())
}

/// Serves the stream with `plan`'s strategy (after an untimed warm-up) and projects the run
/// onto every profile with enough devices.
pub(super) fn measure_serving(
    plan: &Plan,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    opts: &CompareOptions,
    serving: &ServingOptions,
) -> Result<ServingMeasurement> {
    let spec = WorkloadSpec {
        requests: serving.requests,
        rate: serving.rate,
        prompt_len: serving.prompt_len,
        output_len: serving.output_len,
        seed: serving.seed,
    };
    let serve_opts = ServeOptions {
        max_batch: serving.max_batch,
        ..ServeOptions::default()
    };
    let mut engine = build_step_engine(
        &plan.strategy,
        &gpus[..plan.devices],
        weights,
        opts.dtype,
        &CommConfig::default(),
        (serving.max_batch, serving.prompt_len.max()),
    )?;
    let requests = spec.generate(opts.config.vocab);
    warm_up(engine.as_mut(), &spec, &serve_opts, opts.config.vocab)?;
    let run = serve(
        engine.as_mut(),
        &requests,
        &serve_opts,
        Recorder::new(),
        &mut |_, _| {},
    )?;
    let projected = project_serving(&run, plan, opts)?;
    Ok(ServingMeasurement {
        label: plan.label.clone(),
        family: plan.family.into(),
        devices: plan.devices,
        lanes: run.lanes,
        metrics: run.metrics,
        pipeline: run.pipeline,
        projected,
        tokens: run.outcomes.iter().map(|o| o.tokens.clone()).collect(),
        timeline: run.timeline,
    })
}

/// An untimed burst of short requests like the stream's: two per lane, at most the stream's
/// count, of at most two output tokens.
fn warm_up(
    engine: &mut dyn StepEngine,
    spec: &WorkloadSpec,
    serve_opts: &ServeOptions,
    vocab: usize,
) -> Result<()> {
    let warm = WorkloadSpec {
        requests: (2 * engine.lanes()).clamp(2, spec.requests),
        rate: Rate::Burst,
        output_len: Length::Fixed(2.min(spec.output_len.max())),
        ..*spec
    }
    .generate(vocab);
    serve(
        engine,
        &warm,
        serve_opts,
        Recorder::disabled(),
        &mut |_, _| {},
    )?;
    Ok(())
}

/// The serving run replayed on every profile with enough devices for `plan`.
fn project_serving(
    run: &ServeRun,
    plan: &Plan,
    opts: &CompareOptions,
) -> Result<Vec<ServingProjected>> {
    let popts = ProjectOptions {
        collectives: CollectivePolicy::Best,
        ..ProjectOptions::default()
    };
    opts.profiles
        .iter()
        .filter(|p| p.device_count() >= plan.devices)
        .map(|p| {
            project_metrics(run, p, &popts)
                .map(|metrics| ServingProjected {
                    profile: p.name.clone(),
                    metrics,
                })
                .map_err(|source| WgparError::Projection {
                    what: format!("the {} serving run", plan.label),
                    profile: p.name.clone(),
                    source,
                })
        })
        .collect()
}
