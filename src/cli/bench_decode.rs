//! `wgpar bench decode`: what one decode step costs the host (staging its inputs, recording
//! its commands, submitting them), decode tokens/s, and the buffers and bind groups a
//! steady-state step creates, for the single-device and tensor-parallel engines.

use std::time::Instant;

use clap::Args;
use serde::Serialize;
use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, Created, DeviceSelection, Gpu, GpuOptions};
use wgpar::parallel::{build_engine, Strategy};
use wgpar::stats::median;
use wgpar::{Result, WgparError};

/// Options of `wgpar bench decode`.
#[derive(Args, Debug)]
pub struct DecodeBenchArgs {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Strategies: single, tp (over --tp virtual devices on the preferred adapter).
    #[arg(long, value_delimiter = ',', default_value = "single,tp")]
    strategies: Vec<String>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 2)]
    tp: usize,
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
    /// Median host time to stage, record and submit one decode step (mean over devices).
    encode_us: f64,
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
        other => Err(WgparError::Config(format!(
            "bench decode measures 'single' and 'tp', not '{other}'"
        ))),
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
        return Err(WgparError::Config(
            "--steps, --batch and --prompt-len must be at least 1".into(),
        ));
    }
    let needs_tp = strategies.iter().any(|(_, s)| *s != Strategy::Single);
    if needs_tp && args.tp < 2 {
        return Err(WgparError::Config("--tp must be at least 2".into()));
    }
    let context = args.prompt_len + args.warmup + args.steps + 1;
    if context > config.max_seq {
        return Err(WgparError::Config(format!(
            "--prompt-len {} + --warmup {} + --steps {} need {context} positions, model '{}' \
             has {}",
            args.prompt_len, args.warmup, args.steps, config.name, config.max_seq
        )));
    }
    if needs_tp {
        wgpar::model::valid_tp_degrees(&config)
            .contains(&args.tp)
            .then_some(())
            .ok_or_else(|| {
                WgparError::Config(format!(
                    "model '{}' does not split over {} devices (valid: {:?})",
                    config.name,
                    args.tp,
                    wgpar::model::valid_tp_degrees(&config)
                ))
            })?;
    }
    let adapters = Adapters::discover()?;
    let count = if needs_tp { args.tp } else { 1 };
    let gpus = open_devices(
        &adapters,
        &DeviceSelection::Virtual {
            adapter: adapters.preferred(),
            count,
        },
        &GpuOptions::default(),
    )?;
    let dtype = args.model.dtype(&gpus)?;
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
        let used = if *strat == Strategy::Single {
            1
        } else {
            args.tp
        };
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
            let encode_s = stats.as_ref().and_then(|s| s.encode_s);
            encode.push(encode_s.ok_or_else(|| {
                WgparError::Internal(format!("{} did not measure its encode time", engine.name()))
            })?);
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
            encode_us: median(encode).ok_or_else(none)? * 1e6,
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
        println!("{text}");
        return Ok(());
    }
    let g = &gpus[0];
    println!(
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
    );
    println!(
        "{:>10} {:>7} {:>14} {:>13} {:>10} {:>10} {:>13} {:>17}",
        "strategy",
        "devices",
        "encode us/step",
        "(thread CPU)",
        "ms/step",
        "tokens/s",
        "buffers/step",
        "bind groups/step"
    );
    for r in &rows {
        let cpu = r.encode_cpu_us.map_or("-".into(), |c| format!("{c:.1}"));
        println!(
            "{:>10} {:>7} {:>14.1} {:>13} {:>10.2} {:>10.1} {:>13.1} {:>17.1}",
            r.strategy,
            r.devices,
            r.encode_us,
            cpu,
            r.step_ms,
            r.tokens_per_s,
            r.buffers_per_step,
            r.bind_groups_per_step
        );
    }
    Ok(())
}
