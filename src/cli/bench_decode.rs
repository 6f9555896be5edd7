//! `wgpar bench decode`: what one decode step costs the host (staging its inputs, recording
//! its commands, submitting them), decode tokens/s, and the buffers and bind groups a
//! steady-state step creates, for the single-device, tensor-parallel and pipeline engines
//! (the pipeline's stage threads do not report an encode time: tokens/s and allocations
//! only).

use std::time::Instant;

use clap::Args;
use serde::Serialize;
use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, Created, DeviceSelection, Gpu};
use wgpar::model::memory::Workload;
use wgpar::parallel::{build_engine, PartitionSpec, Schedule, Strategy};
use wgpar::stats::median;
use wgpar::{Result, WgparError};

/// Options of `wgpar bench decode`.
#[derive(Args, Debug)]
pub struct DecodeBenchArgs {
    #[command(flatten)]
    model: super::ModelArgs,
    #[command(flatten)]
    binding: super::ModelDeviceArgs,
    #[command(flatten)]
    memory: super::memory::MemoryArgs,
    /// Strategies: single, tp (over --tp virtual devices on the preferred adapter), pp (over
    /// --stages virtual devices, one micro-batch).
    #[arg(long, value_delimiter = ',', default_value = "single,tp,pp")]
    strategies: Vec<String>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prompt length per sequence.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Untimed decode steps first.
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// One strategy's figures.
#[derive(Debug, Serialize)]
struct Row {
    strategy: String,
    devices: usize,
    batch: usize,
    steps: usize,
    /// Median host time to stage, record and submit one decode step (mean over devices);
    /// absent for a pipeline (its stage threads do not report it).
    encode_us: Option<f64>,
    /// The same in CPU time of the recording thread (the host work without waits for a
    /// core); absent where the platform has no thread CPU clock.
    encode_cpu_us: Option<f64>,
    /// Median wall time of a decode step.
    step_ms: f64,
    /// Generated tokens per second over the timed steps.
    tokens_per_s: f64,
    /// Buffers created per timed step (most over devices).
    buffers_per_step: f64,
    /// Bind groups created per timed step (most over devices).
    bind_groups_per_step: f64,
}

fn strategy(name: &str) -> Result<Strategy> {
    match name {
        "single" => Ok(Strategy::Single),
        "tp" => Ok(Strategy::Tensor { split: None }),
        "pp" => Ok(Strategy::Pipeline {
            partition: PartitionSpec::Even,
            micro_batches: 1,
            schedule: Schedule::InFlight,
        }),
        other => Err(WgparError::option(
            "--strategies",
            format!("bench decode measures 'single', 'tp' and 'pp', not '{other}'"),
        )),
    }
}

fn created(gpus: &[std::sync::Arc<Gpu>]) -> Vec<Created> {
    gpus.iter().map(|g| g.created()).collect()
}

/// Runs the benchmark and prints a table (or JSON).
pub fn run(args: &DecodeBenchArgs) -> Result<()> {
    let config = args.model.config()?;
    let strategies = (args.strategies.iter())
        .map(|s| strategy(s).map(|st| (s.clone(), st)))
        .collect::<Result<Vec<_>>>()?;
    if args.steps == 0 || args.batch == 0 || args.prompt_len == 0 {
        return Err(WgparError::option(
            "--steps",
            "--steps, --batch and --prompt-len must be at least 1".into(),
        ));
    }
    let devices_of = |s: &Strategy| match s {
        Strategy::Single => 1,
        Strategy::Pipeline { .. } => args.stages,
        _ => args.tp,
    };
    let needs_tp = (strategies.iter()).any(|(_, s)| matches!(s, Strategy::Tensor { .. }));
    if needs_tp && args.tp < 2 {
        return Err(WgparError::option("--tp", "--tp must be at least 2".into()));
    }
    let needs_pp = (strategies.iter()).any(|(_, s)| matches!(s, Strategy::Pipeline { .. }));
    if needs_pp && !(2..=config.layers).contains(&args.stages) {
        return Err(WgparError::option(
            "--stages",
            format!(
                "--stages must be in 2..={} (the layers of model '{}')",
                config.layers, config.name
            ),
        ));
    }
    let context = args.prompt_len + args.warmup + args.steps + 1;
    if context > config.max_seq {
        return Err(WgparError::limit(
            "context (tokens)",
            (context as u64, config.max_seq as u64),
            format!(
                "--prompt-len {} + --warmup {} + --steps {} need {context} positions, model '{}' \
             has {}",
                args.prompt_len, args.warmup, args.steps, config.name, config.max_seq
            ),
        ));
    }
    if needs_tp {
        wgpar::model::valid_tp_degrees(&config)
            .contains(&args.tp)
            .then_some(())
            .ok_or_else(|| {
                WgparError::unsupported(format!(
                    "model '{}' does not split over {} devices (valid: {:?})",
                    config.name,
                    args.tp,
                    wgpar::model::valid_tp_degrees(&config)
                ))
            })?;
    }
    let adapters = Adapters::discover()?;
    let count = (strategies.iter())
        .map(|(_, s)| devices_of(s))
        .max()
        .unwrap_or(1);
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count,
    };
    let selected = args.binding.described(&selection, &adapters)?;
    let dtype = args.model.dtype_for(&selected, false)?;
    let runs: Vec<super::PlannedRun> = (strategies.iter())
        .map(|(_, s)| super::PlannedRun {
            strategy: s,
            adapters: &selected[..devices_of(s)],
            step_tokens: args.batch * args.prompt_len,
            batch: args.batch,
            work: Workload {
                batch: args.batch,
                prompt: args.prompt_len,
            },
        })
        .collect();
    super::check_runs_fit(&config, dtype, &runs)?;
    (args.memory).check_runs(
        &args.model,
        (&config, dtype),
        &args.binding.kv_dtypes(&selected, false),
        &runs,
    )?;
    let gpus = open_devices(&adapters, &selection, &args.binding.gpu_options())?;
    let weights = args.model.weights(&config)?;
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|b| {
            (0..args.prompt_len)
                .map(|i| ((b * 7919 + i * 131) % config.vocab) as u32)
                .collect()
        })
        .collect();
    let mut rows = Vec::new();
    for (name, strat) in &strategies {
        let used = devices_of(strat);
        let devices = &gpus[..used];
        let mut engine = build_engine(
            strat,
            devices,
            &weights,
            dtype,
            &CommConfig::default(),
            (1, 1),
        )?;
        let mut next = engine.prefill_step(&prompts, false)?.tokens;
        for _ in 0..args.warmup {
            next = engine.decode_step(&next, false)?.tokens;
        }
        let before = created(devices);
        let (mut encode, mut encode_cpu, mut walls) = (Vec::new(), Vec::new(), Vec::new());
        let start = Instant::now();
        for _ in 0..args.steps {
            let t = Instant::now();
            next = engine.decode_step(&next, false)?.tokens;
            walls.push(t.elapsed().as_secs_f64());
            let stats = engine.last_step();
            encode.extend(stats.as_ref().and_then(|s| s.encode_s));
            encode_cpu.extend(stats.and_then(|s| s.encode_cpu_s));
        }
        let total = start.elapsed().as_secs_f64();
        let after = created(devices);
        let per_step = |f: fn(&Created) -> u64| {
            (after.iter().zip(&before))
                .map(|(a, b)| f(a).saturating_sub(f(b)))
                .max()
                .unwrap_or(0) as f64
                / args.steps as f64
        };
        let none = || WgparError::Internal("no timed steps".into());
        rows.push(Row {
            strategy: name.clone(),
            devices: used,
            batch: args.batch,
            steps: args.steps,
            encode_us: median(encode).map(|s| s * 1e6),
            encode_cpu_us: median(encode_cpu).map(|s| s * 1e6),
            step_ms: median(walls).ok_or_else(none)? * 1e3,
            tokens_per_s: (args.batch * args.steps) as f64 / total,
            buffers_per_step: per_step(|c| c.buffers),
            bind_groups_per_step: per_step(|c| c.bind_groups),
        });
    }
    if args.json {
        let text = serde_json::to_string_pretty(&rows).map_err(|source| WgparError::Json {
            what: "the decode benchmark".into(),
            source,
        })?;
        outln!("{text}")?;
        return Ok(());
    }
    let g = &gpus[0];
    outln!(
        "# model {} ({} layers), batch {}, prompt {}, {} timed decode steps after {}, {} ({} {})",
        config.name,
        config.layers,
        args.batch,
        args.prompt_len,
        args.steps,
        args.warmup,
        g.describe(),
        g.info().driver,
        g.info().driver_info
    )?;
    outln!(
        "{:>10} {:>7} {:>14} {:>13} {:>10} {:>10} {:>13} {:>17}",
        "strategy",
        "devices",
        "encode us/step",
        "(thread CPU)",
        "ms/step",
        "tokens/s",
        "buffers/step",
        "bind groups/step"
    )?;
    for r in &rows {
        let us = |v: Option<f64>| v.map_or("-".into(), |c| format!("{c:.1}"));
        outln!(
            "{:>10} {:>7} {:>14} {:>13} {:>10.2} {:>10.1} {:>13.1} {:>17.1}",
            r.strategy,
            r.devices,
            us(r.encode_us),
            us(r.encode_cpu_us),
            r.step_ms,
            r.tokens_per_s,
            r.buffers_per_step,
            r.bind_groups_per_step
        )?;
    }
    Ok(())
}
