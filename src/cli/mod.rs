//! Command-line interface: parses arguments and hands them to the engines and benchmarks.
//! Nothing here touches wgpu directly.

mod allreduce;
mod bench;
mod bench_decode;
mod bench_projection;
mod calibrate;
mod compare;
mod devices;
mod embed;
mod plan;
mod project;
mod run;
mod text;

use clap::{Args, Parser, Subcommand};
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::hf::Checkpoint;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::{Result, WgparError};

use std::path::Path;
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
    /// Prefill a batch of prompts and greedily decode, reporting tokens/s; with --prompt and a
    /// model folder, generate text.
    Run(run::RunArgs),
    /// Single vs tensor vs pipeline vs hybrid parallelism: measured here, projected onto host
    /// profiles, with verdicts, a Markdown report and SVG charts.
    Compare(compare::CompareArgs),
    /// Sentence embeddings of texts with an encoder checkpoint (BERT, e.g. all-MiniLM-L6-v2),
    /// and their pairwise cosine similarities.
    Embed(embed::EmbedArgs),
    /// Modeled projections of a model on host profiles, for models and machines not at hand
    /// (TP all-reduce share vs batch and sequence, PP vs TP throughput, bubble cost).
    Plan(plan::PlanArgs),
    /// Collectives between devices through host memory, nccl-tests style (-b 8 -e 64M -f 2).
    Allreduce(allreduce::AllreduceArgs),
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
    /// Model: a preset (default, tiny-llama, tiny-gpt2, tiny-bert, gpt2-small, llama-1b,
    /// llama-8b; synthetic weights) or a Hugging Face model folder (config.json,
    /// *.safetensors, tokenizer.json).
    #[arg(long, default_value = "default", value_name = "PRESET|DIR")]
    model: String,
    /// Weight storage: f32, or f16 (needs SHADER_F16 on every device).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
    dtype: String,
    /// Seed of the synthetic weights (presets), or of sampling (--prompt with --temperature).
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// Context a checkpoint gets where the command does not know its lengths (the KV cache and
/// position tables are sized for it).
const DEFAULT_CONTEXT: usize = 2048;

impl ModelArgs {
    /// The model folder, when `--model` names one rather than a preset.
    fn checkpoint_dir(&self) -> Option<&Path> {
        let p = Path::new(&self.model);
        p.is_dir().then_some(p)
    }

    /// The checkpoint, its context limited to `context` (or its own, if shorter).
    fn checkpoint(&self, dir: &Path, context: usize) -> Result<Checkpoint> {
        let mut ckpt = Checkpoint::open(dir)?;
        let limit = ckpt.max_context().min(context);
        ckpt.limit_context(limit)?;
        Ok(ckpt)
    }

    /// The decoder to run: a preset, or a checkpoint's config (context up to 2048 tokens).
    fn config(&self) -> Result<ModelConfig> {
        let config = match self.checkpoint_dir() {
            Some(dir) => self.checkpoint(dir, DEFAULT_CONTEXT)?.config().clone(),
            None => ModelConfig::preset(&self.model).map_err(|e| {
                WgparError::Config(format!(
                    "{e}; or pass a model folder (no folder '{}')",
                    self.model
                ))
            })?,
        };
        if config.is_encoder() {
            return Err(WgparError::Config(format!(
                "model '{}' is an encoder (BERT): use `wgpar embed`",
                config.name
            )));
        }
        Ok(config)
    }

    /// Weights for `config` (from [`Self::config`]): synthetic for a preset, loaded (with a
    /// progress bar) for a checkpoint.
    fn weights(&self, config: &ModelConfig) -> Result<ModelWeights> {
        match self.checkpoint_dir() {
            Some(dir) => self.checkpoint(dir, config.max_seq)?.weights(true),
            None => Ok(ModelWeights::synthetic(config, self.seed)),
        }
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
        Some(Command::Embed(args)) => embed::run(&args),
        Some(Command::Bench { what }) => bench::run(&what),
        Some(Command::Compare(args)) => compare::run(&args),
        Some(Command::Plan(args)) => plan::run(&args),
        Some(Command::Allreduce(args)) => allreduce::run(&args),
        Some(Command::Calibrate(args)) => calibrate::run(&args),
        Some(Command::Project(args)) => project::run(&args),
        None => {
            // No arguments: show the machine, then the main job: compare the strategies on
            // the embedded default model.
            let adapters = Adapters::discover()?;
            devices::print(&adapters, false)?;
            println!();
            compare::run(&compare::CompareArgs::default_job())
        }
    }
}
