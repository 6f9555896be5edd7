//! `wgpar bench ...`.

use clap::Subcommand;
use wgpar::device::Adapters;
use wgpar::kernels::bench::{bench_kernels, KernelBenchOptions};
use wgpar::{Result, WgparError};

use super::DeviceArgs;

/// What to benchmark.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
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

/// Runs a benchmark command.
pub fn run(cmd: &BenchCommand) -> Result<()> {
    match cmd {
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
                let text = serde_json::to_string_pretty(&all)
                    .map_err(|e| WgparError::Config(e.to_string()))?;
                println!("{text}");
            }
            Ok(())
        }
    }
}
