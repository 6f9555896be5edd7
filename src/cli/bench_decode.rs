//! `wgpar bench decode`: what one decode step costs the host (staging its inputs, recording
//! its commands, submitting them), decode tokens/s, and the buffers and bind groups a
//! steady-state step creates, for the single-device, tensor-parallel and pipeline engines
//! (the pipeline's stage threads do not report an encode time: tokens/s and allocations
//! only).

use clap::Args;
use serde::Serialize;
use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, DeviceSelection, Gpu};
use wgpar::model::memory::Workload;
use wgpar::parallel::{
    build_engine, measure_decode, DecodeMeasure, PartitionSpec, Schedule, Strategy,
};
use wgpar::{Result, WgparError};

/// Options of `wgpar bench decode`.
#[derive(Args, Debug)]
pub struct DecodeBenchArgs {
    #[command(flatten)]
    model: super::options::ModelArgs,
    #[command(flatten)]
    binding: super::options::ModelDeviceArgs,
    #[command(flatten)]
    memory: super::options::MemoryArgs,
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
    #[serde(flatten)]
    measured: DecodeMeasure,
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

/// Runs the benchmark and prints a table (or JSON).
pub fn run(args: &DecodeBenchArgs) -> Result<()> {
    let config = args.model.choice().config()?;
    let strategies = (args.strategies.iter())
        .map(|s| strategy(s).map(|st| (s.clone(), st)))
        .collect::<Result<Vec<_>>>()?;
    check_args(args, &config, &strategies)?;
    let devices_of = |s: &Strategy| match s {
        Strategy::Single => 1,
        Strategy::Pipeline { .. } => args.stages,
        _ => args.tp,
    };
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
    let dtype = args.model.choice().dtype_for(&selected, false)?;
    let runs: Vec<super::memory::PlannedRun> = (strategies.iter())
        .map(|(_, s)| super::memory::PlannedRun {
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
    super::memory::check_runs_fit(&config, dtype, &runs)?;
    (args.memory).check_runs(
        &args.model,
        (&config, dtype),
        &args.binding.kv_dtypes(&selected, false),
        &runs,
    )?;
    let gpus = open_devices(&adapters, &selection, &args.binding.gpu_options())?;
    let weights = args.model.choice().weights(&config)?;
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|b| {
            (0..args.prompt_len)
                .map(|i| ((b * 7919 + i * 131) % config.vocab) as u32)
                .collect()
        })
        .collect();
    let mut rows = Vec::new();
    for (name, strat) in &strategies {
        let devices = &gpus[..devices_of(strat)];
        let comm = CommConfig::default();
        let mut engine = build_engine(strat, devices, &weights, dtype, &comm, (1, 1))?;
        let steps = (args.warmup, args.steps);
        rows.push(Row {
            strategy: name.clone(),
            devices: devices.len(),
            batch: args.batch,
            steps: args.steps,
            measured: measure_decode(engine.as_mut(), devices, &prompts, steps)?,
        });
    }
    print_rows(args, &config, &gpus[0], &rows)
}

/// The counts and the strategies' devices, checked against the model before anything opens.
fn check_args(
    args: &DecodeBenchArgs,
    config: &wgpar::model::ModelConfig,
    strategies: &[(String, Strategy)],
) -> Result<()> {
    if args.steps == 0 || args.batch == 0 || args.prompt_len == 0 {
        return Err(WgparError::option(
            "--steps",
            "--steps, --batch and --prompt-len must be at least 1".into(),
        ));
    }
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
        wgpar::model::valid_tp_degrees(config)
            .contains(&args.tp)
            .then_some(())
            .ok_or_else(|| {
                WgparError::unsupported(format!(
                    "model '{}' does not split over {} devices (valid: {:?})",
                    config.name,
                    args.tp,
                    wgpar::model::valid_tp_degrees(config)
                ))
            })?;
    }
    Ok(())
}

/// The table (or JSON) of `rows`, with a title naming the model, the work and the device.
fn print_rows(
    args: &DecodeBenchArgs,
    config: &wgpar::model::ModelConfig,
    g: &Gpu,
    rows: &[Row],
) -> Result<()> {
    if args.json {
        let text = serde_json::to_string_pretty(rows).map_err(|source| WgparError::Json {
            what: "the decode benchmark".into(),
            source,
        })?;
        outln!("{text}")?;
        return Ok(());
    }
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
    for r in rows {
        let m = &r.measured;
        let us = |v: Option<f64>| v.map_or("-".into(), |c| format!("{c:.1}"));
        outln!(
            "{:>10} {:>7} {:>14} {:>13} {:>10.2} {:>10.1} {:>13.1} {:>17.1}",
            r.strategy,
            r.devices,
            us(m.encode_us),
            us(m.encode_cpu_us),
            m.step_ms,
            m.tokens_per_s,
            m.buffers_per_step,
            m.bind_groups_per_step
        )?;
    }
    Ok(())
}
