//! `wgpar bench ...`.

use clap::Subcommand;
use wgpar::device::Adapters;
use wgpar::kernels::bench::{bench_kernels, KernelBenchOptions};
use wgpar::{Result, WgparError};

use super::DeviceArgs;

/// What to benchmark.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Pipeline throughput and bubble: p stages x m micro-batches (GPipe prefill), measured
    /// bubble beside (p-1)/(m+p-1), throughput beside the ideal from measured stage times.
    Pipeline {
        #[command(flatten)]
        model: super::ModelArgs,
        /// Stage counts (virtual devices on the preferred adapter).
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        stages: Vec<usize>,
        /// Micro-batch counts; "p" and "4p" scale with the stage count.
        #[arg(long, value_delimiter = ',', default_value = "1,p,4p")]
        micro_batches: Vec<String>,
        /// Prompt length per sequence.
        #[arg(long, default_value_t = 32)]
        prompt_len: usize,
        /// Sequences per micro-batch.
        #[arg(long, default_value_t = 1)]
        per_microbatch: usize,
        /// Timed repetitions (best kept, after a warm-up).
        #[arg(long, default_value_t = 3)]
        reps: usize,
    },
    /// Projection accuracy on this machine: rounds of calibrate + traced runs (single, TP,
    /// PP), every run projected onto every calibration; median makespan error per
    /// configuration.
    Projection(super::bench_projection::ProjectionBenchArgs),
    /// Host time to stage, record and submit one decode step, decode tokens/s, and the
    /// buffers and bind groups a steady-state step creates (single device and tensor
    /// parallel).
    Decode(super::bench_decode::DecodeBenchArgs),
    /// Matmul GFLOP/s (against a naive baseline) and the other kernels' GB/s, per device.
    Kernels {
        #[command(flatten)]
        devices: DeviceArgs,
        /// Square matmul sizes.
        #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
        sizes: Vec<usize>,
        /// Timed samples per kernel (median reported).
        #[arg(long, default_value_t = 5)]
        iters: usize,
        /// Untimed warm-up samples.
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn micro_batch_count(text: &str, p: usize) -> Result<usize> {
    match text {
        "p" => Ok(p),
        t if t.ends_with('p') => t[..t.len() - 1]
            .parse::<usize>()
            .map(|k| k * p)
            .map_err(|_| WgparError::Config(format!("bad micro-batch count '{t}'"))),
        t => t
            .parse()
            .map_err(|_| WgparError::Config(format!("bad micro-batch count '{t}'"))),
    }
}

fn bench_pipeline(
    model: &super::ModelArgs,
    stages: &[usize],
    micro_batches: &[String],
    prompt_len: usize,
    per_microbatch: usize,
    reps: usize,
) -> Result<()> {
    use wgpar::comm::CommConfig;
    use wgpar::device::{open_devices, DeviceSelection, GpuOptions};
    use wgpar::parallel::{Engine, Partition, PipelineEngine};
    let config = model.config()?;
    let adapters = Adapters::discover()?;
    let max = stages.iter().copied().max().unwrap_or(1);
    let gpus = open_devices(
        &adapters,
        &DeviceSelection::Virtual {
            adapter: adapters.preferred(),
            count: max,
        },
        &GpuOptions::default(),
    )?;
    let dtype = model.dtype(&gpus)?;
    let weights = model.weights(&config)?;
    println!(
        "# model {} ({} layers), prompt {prompt_len}, {per_microbatch} sequence(s) per micro-batch, {} ({} {})",
        config.name,
        config.layers,
        gpus[0].describe(),
        gpus[0].info().driver,
        gpus[0].info().driver_info
    );
    println!(
        "{:>3} {:>4} {:>10} {:>12} {:>12} {:>9} {:>9} {:>11} {:>12}",
        "p",
        "m",
        "tokens",
        "tokens/s",
        "ideal tok/s",
        "of ideal",
        "bubble",
        "(p-1)/(m+p-1)",
        "hand-off/mb"
    );
    for &p in stages {
        for text in micro_batches {
            let m = micro_batch_count(text, p)?;
            let mut pp = PipelineEngine::new(
                &gpus[..p],
                &weights,
                dtype,
                &Partition::Even,
                m,
                CommConfig::default(),
            )?;
            let prompts: Vec<Vec<u32>> = (0..m * per_microbatch)
                .map(|b| {
                    (0..prompt_len)
                        .map(|i| ((b * 7919 + i * 131) % config.vocab) as u32)
                        .collect()
                })
                .collect();
            pp.prefill(&prompts)?;
            let mut best: Option<wgpar::parallel::PipelineStats> = None;
            for _ in 0..reps.max(1) {
                pp.prefill(&prompts)?;
                let s = pp
                    .last_run()
                    .cloned()
                    .ok_or_else(|| WgparError::Internal("the pipeline reported no run".into()))?;
                if best.as_ref().is_none_or(|b| s.makespan_s < b.makespan_s) {
                    best = Some(s);
                }
            }
            let s =
                best.ok_or_else(|| WgparError::Internal("the pipeline reported no run".into()))?;
            let (handoff_s, handoff_b) = s.handoff_per_microbatch();
            println!(
                "{:>3} {:>4} {:>10} {:>12.1} {:>12.1} {:>8.0}% {:>8.1}% {:>13.1}% {:>7.2} ms {} B",
                p,
                m,
                s.tokens,
                s.tokens_per_s(),
                s.ideal_tokens_per_s(),
                s.tokens_per_s() / s.ideal_tokens_per_s() * 100.0,
                s.measured_bubble * 100.0,
                s.theoretical_bubble * 100.0,
                handoff_s * 1e3,
                handoff_b
            );
            drop(pp);
        }
    }
    Ok(())
}

/// Runs a benchmark command.
pub fn run(cmd: &BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Pipeline {
            model,
            stages,
            micro_batches,
            prompt_len,
            per_microbatch,
            reps,
        } => bench_pipeline(
            model,
            stages,
            micro_batches,
            *prompt_len,
            *per_microbatch,
            *reps,
        ),
        BenchCommand::Projection(args) => super::bench_projection::run(args),
        BenchCommand::Decode(args) => super::bench_decode::run(args),
        BenchCommand::Kernels {
            devices,
            sizes,
            iters,
            warmup,
            json,
        } => {
            if *iters == 0 {
                return Err(WgparError::Config("--iters must be at least 1".into()));
            }
            let adapters = Adapters::discover()?;
            let gpus = devices.open(&adapters)?;
            let opts = KernelBenchOptions {
                sizes: sizes.clone(),
                iters: *iters,
                warmup: *warmup,
                ..Default::default()
            };
            let mut all = Vec::new();
            for gpu in &gpus {
                let rows = bench_kernels(gpu, &opts)?;
                if !json {
                    println!(
                        "# {} driver: {} {}",
                        gpu.describe(),
                        gpu.info().driver,
                        gpu.info().driver_info
                    );
                    println!(
                        "{:<18} {:<22} {:<5} {:>10} {:>9} {:>8} {:>8}",
                        "kernel", "shape", "dtype", "median ms", "GFLOP/s", "GB/s", "x naive"
                    );
                    let opt = |v: Option<f64>, p: usize| {
                        v.map_or("-".to_string(), |v| format!("{v:.p$}"))
                    };
                    for r in &rows {
                        println!(
                            "{:<18} {:<22} {:<5} {:>10.3} {:>9} {:>8} {:>8}",
                            r.kernel,
                            r.shape,
                            r.dtype,
                            r.median_ms,
                            opt(r.gflops, 1),
                            opt(r.gbps, 2),
                            opt(r.speedup_vs_naive, 2)
                        );
                    }
                }
                all.push(serde_json::json!({ "device": gpu.describe(), "adapter": gpu.info(), "rows": rows }));
            }
            if *json {
                let text =
                    serde_json::to_string_pretty(&all).map_err(|source| WgparError::Json {
                        what: "the kernel benchmark".into(),
                        source,
                    })?;
                println!("{text}");
            }
            Ok(())
        }
    }
}
