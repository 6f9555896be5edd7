//! `wgpar compare`: run single, TP, PP and hybrid on the same model and devices, sweeping batch
//! size and micro-batches; measure llama-bench style (mean +- stddev over repetitions), check
//! every strategy against the single-device output, project each run onto host profiles, and
//! say which strategy wins where, and why.

mod charts;
pub mod choice;
mod files;
mod memory;
mod modeled;
mod plan;
pub mod plan_request;
pub mod preflight;
mod presets;
mod report;
mod scale;
mod serving;
mod verdict;

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::comm::CommConfig;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{valid_tp_degrees, ModelConfig, ModelWeights};
use crate::parallel::{
    build_engine, generate, generate_keeping, Engine, KeepLogits, PartitionSpec, Schedule, Strategy,
};
use crate::sim::{project_engine, HostProfile, ProjectOptions};
use crate::trace::{Recorder, Timeline};

pub use charts::{breakdown_svg, scale_svg, throughput_svg};
pub use choice::{CompareChoice, ComparePlan, ServeChoice};
pub use files::{write_report, ReportFiles};
pub use memory::{memory_per_device, runtime_format, DeviceMemory, WeightsSpec, Workload};
pub use modeled::{modeled_timeline, Formats};
pub use plan::{
    default_strategies, plan, plan_markdown, plan_model, PlanOptions, PlanRow, PlanStrategy,
};
pub use presets::{plan_preset, PLAN_PRESETS};
pub use report::{markdown, table};
pub use scale::{modeled_at_scale, ScaleCase, ScaleSection};
pub use serving::{
    serving_plans, ServingMeasurement, ServingOptions, ServingProjected, ServingSection,
};
pub use verdict::{question_lines, verdicts, UnderLoad, Verdict};

/// What to compare.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// The model.
    pub config: ModelConfig,
    /// Weight storage.
    pub dtype: DType,
    /// Batch sizes to sweep.
    pub batches: Vec<usize>,
    /// Micro-batch counts to sweep for pipelines (capped at the batch size).
    pub micro_batches: Vec<usize>,
    /// How pipelines decode (in flight unless GPipe is asked for).
    pub schedule: Schedule,
    /// Prompt length.
    pub prompt_len: usize,
    /// Tokens generated per sequence (the first comes from the prefill).
    pub gen: usize,
    /// Timed repetitions per configuration.
    pub reps: usize,
    /// Host profiles to project onto.
    pub profiles: Vec<HostProfile>,
    /// Engines each run is projected with, per profile: wgpar as it runs here, and others (CUDA
    /// + NCCL) modeled on the same machine.
    pub engines: Vec<crate::sim::Engine>,
    /// Seed of the synthetic weights.
    pub seed: u64,
    /// The serving section: every strategy under one stream of requests (`None`: skip it).
    pub serving: Option<ServingOptions>,
    /// Add the modeled section at realistic scale ([`modeled_at_scale`]) on `engines`.
    pub at_scale: bool,
}

/// Mean and standard deviation over repetitions.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Stat {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 for one sample).
    pub std: f64,
}

impl Stat {
    fn of(v: &[f64]) -> Self {
        let n = v.len().max(1) as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = if v.len() > 1 {
            v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        Self {
            mean,
            std: var.sqrt(),
        }
    }
}

/// One configuration projected onto one host profile, as one engine would run it.
#[derive(Debug, Clone, Serialize)]
pub struct Projected {
    /// Profile name.
    pub profile: String,
    /// Engine label (`wgpar`, `CUDA+NCCL`).
    pub engine: String,
    /// Whether this is wgpar's own run replayed (`projected`) or another engine's costs applied
    /// to the same work (`modeled`).
    pub kind: &'static str,
    /// Collective paths the engine took there.
    pub collectives_via: Vec<String>,
    /// Whether this configuration's weights, KV cache and activations fit every device of the
    /// profile in the engine's formats (the times are still the run's, projected).
    pub fits: bool,
    /// Memory of the fullest device, bytes, and what the engine may use of it.
    pub memory: (u64, u64),
    /// Projected time to first token (the prefill), ms.
    pub ttft_ms: f64,
    /// Projected per-token latency (one decode step), ms.
    pub per_token_ms: f64,
    /// Projected prompt tokens/s.
    pub pp_tps: f64,
    /// Projected generated tokens/s.
    pub tg_tps: f64,
    /// Communication share of device-time (decode).
    pub comm_share: f64,
    /// Bubble share of device-time (decode).
    pub bubble_share: f64,
    /// Communication share of device-time (prefill).
    pub prefill_comm_share: f64,
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// Strategy label, e.g. `tp2`, `pp4 m=4`, `tp2xpp2 m=2`.
    pub label: String,
    /// Strategy family: single, tp, pp, hybrid.
    pub family: String,
    /// Devices used.
    pub devices: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Micro-batches (pipelines) or 1.
    pub micro_batches: usize,
    /// Prompt processing, tokens/s.
    pub pp_tps: Stat,
    /// Token generation, tokens/s.
    pub tg_tps: Stat,
    /// Time to first token (prefill), ms.
    pub ttft_ms: Stat,
    /// Per-token latency (one decode step), ms.
    pub per_token_ms: Stat,
    /// Communication share of device-time, prefill (measured timeline).
    pub prefill_comm_share: f64,
    /// Communication share of device-time, decode.
    pub comm_share: f64,
    /// Bubble share of device-time, decode.
    pub bubble_share: f64,
    /// Bytes one device moves per generated token (decode).
    pub bytes_per_token: f64,
    /// Largest relative error of its prefill logits against the single device.
    pub max_rel_err: f64,
    /// Projections onto each profile.
    pub projected: Vec<Projected>,
    /// Timelines of the last repetition (prefill, decode), for pictures and `wgpar project`.
    #[serde(skip)]
    pub timelines: (Timeline, Timeline),
}

/// Everything `wgpar compare` found.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    /// Model name and shape.
    pub model: ModelConfig,
    /// Devices, as described.
    pub devices: Vec<String>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Tokens generated.
    pub gen: usize,
    /// Repetitions.
    pub reps: usize,
    /// Every configuration.
    pub measurements: Vec<Measurement>,
    /// Every strategy under one stream of requests.
    pub serving: Option<ServingSection>,
    /// Per profile: best latency and throughput, with reasons.
    pub verdicts: Vec<Verdict>,
    /// Llama-3-8B and Llama-3-70B modeled on real machines, when asked for.
    pub scale: Option<ScaleSection>,
    /// When it ran (UTC, seconds since the epoch).
    pub unix_time: u64,
}

impl Projected {
    /// The name of this projection in reports: profile, engine and whether it is modeled,
    /// e.g. `dgx-h100, CUDA+NCCL (modeled)`.
    pub fn key(&self) -> String {
        format!("{}, {} ({})", self.profile, self.engine, self.kind)
    }
}

impl CompareReport {
    /// Names of the (profile, engine) projections, in first-seen order (see
    /// [`Projected::key`]).
    pub fn profile_names(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for m in &self.measurements {
            for p in &m.projected {
                let k = p.key();
                if !v.contains(&k) {
                    v.push(k);
                }
            }
        }
        v
    }
}

/// A configuration to run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Label.
    pub label: String,
    /// Family.
    pub family: &'static str,
    /// Strategy.
    pub strategy: Strategy,
    /// Devices it uses (a prefix of the device list).
    pub devices: usize,
    /// Batch.
    pub batch: usize,
    /// Micro-batches.
    pub micro_batches: usize,
}

/// The configurations worth comparing on `n` devices: single; the largest valid TP degree
/// (and 2 when that differs); PP over 2 and n devices for each micro-batch count; and, with 4
/// or more devices, TP=2 groups in n/2 pipeline stages.
pub fn plans(config: &ModelConfig, n: usize, opts: &CompareOptions) -> Vec<Plan> {
    let mut out = Vec::new();
    let valid = valid_tp_degrees(config);
    for &batch in &opts.batches {
        out.push(Plan {
            label: "single".into(),
            family: "single",
            strategy: Strategy::Single,
            devices: 1,
            batch,
            micro_batches: 1,
        });
        let mut tps: Vec<usize> = [2, n]
            .into_iter()
            .filter(|d| *d >= 2 && *d <= n && valid.contains(d))
            .collect();
        tps.dedup();
        for t in tps {
            out.push(Plan {
                label: format!("tp{t}"),
                family: "tp",
                strategy: Strategy::Tensor { split: None },
                devices: t,
                batch,
                micro_batches: 1,
            });
        }
        let mut pps: Vec<usize> = [2, n]
            .into_iter()
            .filter(|p| *p >= 2 && *p <= n && *p <= config.layers)
            .collect();
        pps.dedup();
        let mut ms: Vec<usize> = opts
            .micro_batches
            .iter()
            .map(|&m| m.min(batch).max(1))
            .collect();
        ms.sort();
        ms.dedup();
        for p in pps {
            for &m in &ms {
                out.push(Plan {
                    label: format!("pp{p} m={m}"),
                    family: "pp",
                    strategy: Strategy::Pipeline {
                        partition: PartitionSpec::Even,
                        micro_batches: m,
                        schedule: opts.schedule,
                    },
                    devices: p,
                    batch,
                    micro_batches: m,
                });
            }
        }
        if n >= 4 && n.is_multiple_of(2) && valid.contains(&2) && n / 2 <= config.layers {
            for &m in &ms {
                out.push(Plan {
                    label: format!("tp2xpp{} m={m}", n / 2),
                    family: "hybrid",
                    strategy: Strategy::Hybrid {
                        tp: 2,
                        partition: PartitionSpec::Even,
                        micro_batches: m,
                        schedule: opts.schedule,
                    },
                    devices: n,
                    batch,
                    micro_batches: m,
                });
            }
        }
    }
    out
}

fn prompts(batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..len)
                .map(|i| ((b * 7919 + i * 104_729 + 13) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// Single-device reference output for a batch: prefill logits and greedy tokens.
struct Reference {
    logits: Vec<f32>,
    tokens: Vec<Vec<u32>>,
}

fn project_pair(
    timelines: &(Timeline, Timeline),
    profile: &HostProfile,
    engine: &crate::sim::Engine,
    decode_steps: usize,
    tokens: (usize, usize),
) -> Result<Projected> {
    // Each engine runs the collectives it would choose on that machine: wgpar its host-staged
    // path everywhere, CUDA + NCCL an NVLink ring or NVLS on a DGX.
    let opts = ProjectOptions::default();
    let err = |source: crate::sim::ProjectError| WgparError::Projection {
        what: format!("the measured run as {}", engine.label()),
        profile: profile.name.clone(),
        source,
    };
    let pre = project_engine(&timelines.0, profile, engine, &opts).map_err(err)?;
    let dec = project_engine(&timelines.1, profile, engine, &opts).map_err(err)?;
    let ttft_ms = pre.report.projected.makespan_us / 1e3;
    let decode_ms = dec.report.projected.makespan_us / 1e3;
    let per_token_ms = decode_ms / decode_steps.max(1) as f64;
    let mut via = pre.report.collectives_via.clone();
    for v in &dec.report.collectives_via {
        if !via.contains(v) {
            via.push(v.clone());
        }
    }
    Ok(Projected {
        profile: profile.name.clone(),
        engine: engine.label().to_owned(),
        kind: if engine.name == "wgpar" {
            "projected"
        } else {
            "modeled"
        },
        collectives_via: via,
        fits: true,
        memory: (0, 0),
        ttft_ms,
        per_token_ms,
        pp_tps: tokens.0 as f64 / (ttft_ms / 1e3),
        tg_tps: tokens.1 as f64 / (decode_ms / 1e3),
        comm_share: dec.report.projected.comm_share,
        bubble_share: dec.report.projected.bubble_share,
        prefill_comm_share: pre.report.projected.comm_share,
    })
}

/// The figures of one timed repetition.
struct Rep {
    prefill_s: f64,
    decode_s: f64,
    bytes_sent: f64,
    rel_err: f64,
    timelines: (Timeline, Timeline),
}

/// Runs one timed repetition of `prompts`: a prefill whose logits are checked against the
/// reference, then `steps - 1` greedy decode steps whose tokens must match it.
fn rep(
    plan: &Plan,
    engine: &mut dyn Engine,
    (prompts, steps): (&[Vec<u32>], usize),
    reference: &Reference,
) -> Result<Rep> {
    let pre_rec = Recorder::new();
    engine.set_recorder(pre_rec.clone());
    let start = Instant::now();
    // The prefill's logits are checked against the single device; decode steps read
    // back token ids only, as generation does.
    let first = engine.prefill_step(prompts, true)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let first_logits = first.logits.ok_or_else(|| WgparError::Worker {
        worker: plan.label.clone(),
        message: "the prefill returned no logits".into(),
    })?;
    let rel_err = first_logits.relative_error(&reference.logits);
    let dec_rec = Recorder::new();
    engine.set_recorder(dec_rec.clone());
    let next = first.tokens;
    // Pipelines keep their micro-batches in flight here (unless GPipe is asked for).
    let start = Instant::now();
    let decoded = engine.decode_greedy(&next, steps - 1, false)?;
    let decode_s = start.elapsed().as_secs_f64();
    let tokens: Vec<Vec<u32>> = next
        .iter()
        .zip(&decoded.tokens)
        .map(|(&t, rest)| std::iter::once(t).chain(rest.iter().copied()).collect())
        .collect();
    engine.set_recorder(Recorder::disabled());
    if tokens != reference.tokens {
        return Err(WgparError::Disagreement {
            strategy: format!("{} (batch {})", plan.label, plan.batch),
            reference: "the single device".into(),
            detail: format!(
                "generated tokens {:?} vs {:?}",
                tokens[0], reference.tokens[0]
            ),
        });
    }
    Ok(Rep {
        prefill_s,
        decode_s,
        bytes_sent: decoded.stats.bytes_sent as f64,
        rel_err,
        timelines: (pre_rec.timeline(), dec_rec.timeline()),
    })
}

/// The repetitions of one plan so far.
struct Reps {
    pp: Vec<f64>,
    tg: Vec<f64>,
    ttft: Vec<f64>,
    lat: Vec<f64>,
    max_rel_err: f64,
    /// Of the last repetition.
    bytes_per_token: f64,
    /// Of the last repetition.
    timelines: (Timeline, Timeline),
}

impl Reps {
    fn new() -> Self {
        Self {
            pp: Vec::new(),
            tg: Vec::new(),
            ttft: Vec::new(),
            lat: Vec::new(),
            max_rel_err: 0.0,
            bytes_per_token: 0.0,
            timelines: (Timeline::new(), Timeline::new()),
        }
    }

    /// Adds a repetition of `batch` sequences of `prompt_len` tokens and `decode_steps`
    /// decode steps.
    fn add(&mut self, rep: Rep, (batch, prompt_len): (usize, usize), decode_steps: usize) {
        let decode_steps = decode_steps as f64;
        self.max_rel_err = self.max_rel_err.max(rep.rel_err);
        self.pp.push((batch * prompt_len) as f64 / rep.prefill_s);
        self.tg.push(batch as f64 * decode_steps / rep.decode_s);
        self.ttft.push(rep.prefill_s * 1e3);
        self.lat.push(rep.decode_s * 1e3 / decode_steps);
        self.bytes_per_token = rep.bytes_sent / (batch as f64 * decode_steps);
        self.timelines = rep.timelines;
    }
}

/// Measures one plan (warm-up, then `reps` timed repetitions), checks it against the
/// reference and projects its timelines.
fn measure(
    plan: &Plan,
    engine: &mut dyn Engine,
    opts: &CompareOptions,
    reference: &Reference,
) -> Result<Measurement> {
    let prompts = prompts(plan.batch, opts.prompt_len, opts.config.vocab);
    let steps = opts.gen.max(2);
    generate(engine, &prompts, 2)?;
    let mut reps = Reps::new();
    for _ in 0..opts.reps.max(1) {
        let r = rep(plan, engine, (&prompts, steps), reference)?;
        reps.add(r, (plan.batch, opts.prompt_len), steps - 1);
    }
    let max_rel_err = reps.max_rel_err;
    if max_rel_err > 1e-3 {
        return Err(WgparError::Disagreement {
            strategy: format!("{} (batch {})", plan.label, plan.batch),
            reference: "the single device".into(),
            detail: format!("prefill logits differ by {max_rel_err:.2e} (relative)"),
        });
    }
    let projected = project_plan(plan, opts, &reps.timelines, steps)?;
    let pre_summary = reps.timelines.0.summary();
    let dec_summary = reps.timelines.1.summary();
    Ok(Measurement {
        label: plan.label.clone(),
        family: plan.family.into(),
        devices: plan.devices,
        batch: plan.batch,
        micro_batches: plan.micro_batches,
        pp_tps: Stat::of(&reps.pp),
        tg_tps: Stat::of(&reps.tg),
        ttft_ms: Stat::of(&reps.ttft),
        per_token_ms: Stat::of(&reps.lat),
        prefill_comm_share: pre_summary.comm_share,
        comm_share: dec_summary.comm_share,
        bubble_share: dec_summary.bubble_share,
        bytes_per_token: reps.bytes_per_token,
        max_rel_err,
        projected,
        timelines: reps.timelines,
    })
}

/// A measured plan's timelines projected onto every profile with enough devices, once per
/// engine, with whether its memory fits there.
fn project_plan(
    plan: &Plan,
    opts: &CompareOptions,
    timelines: &(Timeline, Timeline),
    steps: usize,
) -> Result<Vec<Projected>> {
    let weights = match opts.dtype {
        DType::F16 => crate::sim::NumFormat::F16,
        _ => crate::sim::NumFormat::F32,
    };
    let work = Workload {
        batch: plan.batch,
        prompt: opts.prompt_len,
        context: opts.prompt_len + steps,
    };
    let mut projected = Vec::new();
    for p in opts
        .profiles
        .iter()
        .filter(|p| p.device_count() >= plan.devices)
    {
        for e in &opts.engines {
            let mut proj = project_pair(
                timelines,
                p,
                e,
                steps - 1,
                (plan.batch * opts.prompt_len, plan.batch * (steps - 1)),
            )?;
            let memory = memory_per_device(
                &opts.config,
                &plan.strategy,
                plan.devices,
                memory::WeightsSpec::uniform(weights),
                e,
                p,
                work,
            )?;
            proj.fits = memory.iter().all(DeviceMemory::fits);
            proj.memory = memory
                .iter()
                .max_by_key(|m| m.total)
                .map_or((0, 0), |m| (m.total, m.capacity));
            projected.push(proj);
        }
    }
    Ok(projected)
}

/// What every run of a comparison shares: the devices, the weights and the options.
struct Bench<'a> {
    gpus: &'a [Arc<Gpu>],
    weights: ModelWeights,
    opts: &'a CompareOptions,
    comm: CommConfig,
}

/// Runs every plan on `gpus`; `progress(done, total, label)` is called before each.
pub fn run_compare(
    gpus: &[Arc<Gpu>],
    opts: &CompareOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<CompareReport> {
    check_options(opts)?;
    let bench = Bench {
        gpus,
        weights: ModelWeights::synthetic(&opts.config, opts.seed),
        opts,
        comm: CommConfig::default(),
    };
    let plans = plans(&opts.config, gpus.len(), opts);
    let serve_plans = if opts.serving.is_some() {
        serving_plans(opts, gpus.len())
    } else {
        Vec::new()
    };
    let total = plans.len() + serve_plans.len();
    let mut references = HashMap::new();
    let mut measurements = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        progress(i, total, &format!("{} batch {}", plan.label, plan.batch));
        measurements.push(bench.measure(plan, &mut references)?);
    }
    let served = match &opts.serving {
        Some(options) => bench.serve(&serve_plans, options, progress, (plans.len(), total))?,
        None => Vec::new(),
    };
    progress(total, total, "done");
    let serving = opts.serving.clone().map(|options| ServingSection {
        options,
        measurements: served,
    });
    let verdicts = verdicts(&measurements, serving.as_ref(), &opts.profiles);
    let scale = if opts.at_scale {
        Some(modeled_at_scale(&opts.engines)?)
    } else {
        None
    };
    Ok(CompareReport {
        model: opts.config.clone(),
        devices: gpus.iter().map(|g| g.describe()).collect(),
        prompt_len: opts.prompt_len,
        gen: opts.gen,
        reps: opts.reps,
        measurements,
        serving,
        verdicts,
        scale,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    })
}

/// Refuses options no run can satisfy, before any device work.
fn check_options(opts: &CompareOptions) -> Result<()> {
    if opts.batches.is_empty() || opts.batches.contains(&0) || opts.prompt_len == 0 {
        return Err(WgparError::option(
            "--batches",
            "batches and prompt length must be positive".into(),
        ));
    }
    if opts.prompt_len + opts.gen.max(2) > opts.config.max_seq {
        return Err(WgparError::limit(
            "context (tokens)",
            (
                (opts.prompt_len + opts.gen.max(2)) as u64,
                opts.config.max_seq as u64,
            ),
            format!(
                "prompt {} + {} generated tokens exceed max_seq {}",
                opts.prompt_len, opts.gen, opts.config.max_seq
            ),
        ));
    }
    if let Some(s) = &opts.serving {
        serving::validate(opts, s)?;
    }
    Ok(())
}

/// Greedy, so every strategy must serve every request the same tokens as the first one.
fn same_tokens(m: &ServingMeasurement, first: &ServingMeasurement) -> Result<()> {
    match (0..m.tokens.len()).find(|&i| m.tokens[i] != first.tokens[i]) {
        Some(i) => Err(WgparError::Disagreement {
            strategy: m.label.clone(),
            reference: first.label.clone(),
            detail: format!(
                "request {i} was served tokens {:?} vs {:?}",
                m.tokens[i], first.tokens[i]
            ),
        }),
        None => Ok(()),
    }
}

impl Bench<'_> {
    /// Measures `plan` against the single device's output for its batch (run once per batch
    /// size, kept in `references`).
    fn measure(
        &self,
        plan: &Plan,
        references: &mut HashMap<usize, Reference>,
    ) -> Result<Measurement> {
        let opts = self.opts;
        if let Entry::Vacant(slot) = references.entry(plan.batch) {
            slot.insert(self.reference(plan.batch)?);
        }
        let mut engine = build_engine(
            &plan.strategy,
            &self.gpus[..plan.devices],
            &self.weights,
            opts.dtype,
            &self.comm,
            (plan.batch, opts.prompt_len),
        )?;
        measure(plan, engine.as_mut(), opts, &references[&plan.batch])
    }

    /// Serves the stream with every serving plan, checking each serves the first one's
    /// tokens; `progress` counts on from `done` of `total`.
    fn serve(
        &self,
        plans: &[Plan],
        options: &ServingOptions,
        progress: &mut dyn FnMut(usize, usize, &str),
        (done, total): (usize, usize),
    ) -> Result<Vec<ServingMeasurement>> {
        let mut served: Vec<ServingMeasurement> = Vec::new();
        for (i, plan) in plans.iter().enumerate() {
            progress(
                done + i,
                total,
                &format!("{} serving {} requests", plan.label, options.requests),
            );
            let m = serving::measure_serving(plan, self.gpus, &self.weights, self.opts, options)?;
            if let Some(first) = served.first() {
                same_tokens(&m, first)?;
            }
            served.push(m);
        }
        Ok(served)
    }

    /// The single device's prefill logits and greedy tokens for `batch` prompts.
    fn reference(&self, batch: usize) -> Result<Reference> {
        let opts = self.opts;
        let mut single = build_engine(
            &Strategy::Single,
            self.gpus,
            &self.weights,
            opts.dtype,
            &self.comm,
            (1, 1),
        )?;
        let p = prompts(batch, opts.prompt_len, opts.config.vocab);
        let g = generate_keeping(single.as_mut(), &p, opts.gen.max(2), KeepLogits::Prefill)?;
        let first = g
            .logits
            .into_iter()
            .next()
            .ok_or_else(|| WgparError::Worker {
                worker: "compare".into(),
                message: "the reference run kept no prefill logits".into(),
            })?;
        Ok(Reference {
            logits: first.data,
            tokens: g.tokens,
        })
    }
}
