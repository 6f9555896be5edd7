//! Command-line interface: parses arguments and hands them to the engines and benchmarks.
//! Nothing here touches wgpu directly.

mod bench;
mod calibrate;
mod devices;
mod project;
mod run;

use clap::{Args, Parser, Subcommand};
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::{ModelConfig, PRESETS};
use wgpar::{Result, WgparError};

use std::sync::Arc;

/// wgpar: run transformer inference across several GPUs of any vendor and backend, and see
/// where the time goes (tensor vs pipeline parallelism, PCIe vs NVLink).
#[derive(Parser)]
#[command(name = "wgpar", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend, with the limits and features that matter.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Prefill a batch of prompts and greedily decode, reporting tokens/s.
    Run(run::RunArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCommand,
    },
    /// Measure this machine (links, host reduce, kernel rates) and write a host profile.
    Calibrate(calibrate::CalibrateArgs),
    /// Replay a recorded run (`run --trace`) on a host profile.
    Project(project::ProjectArgs),
}

/// Device selection options shared by every command that runs on GPUs.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Adapter indices from `wgpar devices`, comma-separated (an index may repeat).
    #[arg(long)]
    devices: Option<String>,
    /// Open N independent devices on one adapter (the first of --devices, or the preferred one).
    #[arg(long = "virtual", value_name = "N")]
    virtual_count: Option<usize>,
    /// Keep weights in f32 even where the adapter has SHADER_F16.
    #[arg(long)]
    force_f32: bool,
}

impl DeviceArgs {
    fn open(&self, adapters: &Adapters) -> Result<Vec<Arc<Gpu>>> {
        let selection =
            DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)?;
        open_devices(
            adapters,
            &selection,
            &GpuOptions {
                force_f32: self.force_f32,
            },
        )
    }
}

/// Model options shared by commands that run a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model preset.
    #[arg(long, default_value = "default", value_parser = clap::builder::PossibleValuesParser::new(PRESETS))]
    model: String,
    /// Weight storage: f32, or f16 (needs SHADER_F16 on every device).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
    dtype: String,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

impl ModelArgs {
    fn config(&self) -> Result<ModelConfig> {
        ModelConfig::preset(&self.model)
    }

    fn dtype(&self, gpus: &[Arc<Gpu>]) -> Result<DType> {
        match self.dtype.as_str() {
            "f16" => match gpus.iter().find(|g| !g.supports_f16_weights()) {
                Some(g) => Err(WgparError::Config(format!(
                    "--dtype f16 needs SHADER_F16, which {} lacks (or --force-f32 is set)",
                    g.describe()
                ))),
                None => Ok(DType::F16),
            },
            _ => Ok(DType::F32),
        }
    }
}

/// Entry point: parse, dispatch, report errors as values.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Devices { json }) => devices::print(&Adapters::discover()?, json),
        Some(Command::Run(args)) => run::run(&args),
        Some(Command::Bench { what }) => bench::run(&what),
        Some(Command::Calibrate(args)) => calibrate::run(&args),
        Some(Command::Project(args)) => project::run(&args),
        None => {
            // No arguments: show the machine, then run the embedded default model.
            let adapters = Adapters::discover()?;
            devices::print(&adapters, false)?;
            println!();
            run::run(&run::RunArgs::default_job())
        }
    }
}
