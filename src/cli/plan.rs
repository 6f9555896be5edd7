//! `wgpar plan`: modeled projections of a model on host profiles (no GPU needed).

use clap::Args;
use wgpar::compare::{plan, plan_markdown, PlanOptions};
use wgpar::device::DType;
use wgpar::model::ModelConfig;
use wgpar::sim::HostProfile;
use wgpar::{Result, WgparError};

/// Options of `wgpar plan`.
#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    /// Model preset.
    #[arg(long, default_value = "llama-8b")]
    model: String,
    /// Weight storage of the modeled run.
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16"])]
    dtype: String,
    /// Devices per configuration.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1536")]
    seqs: Vec<usize>,
    /// Host profiles (shipped names or TOML paths).
    #[arg(
        long = "host",
        value_delimiter = ',',
        default_value = "pcie4-4gpu,dgx-h100"
    )]
    hosts: Vec<String>,
    /// Decode steps modeled.
    #[arg(long, default_value_t = 8)]
    decode_steps: usize,
    /// Print JSON rows instead of Markdown.
    #[arg(long)]
    json: bool,
}

/// Models and prints.
pub fn run(args: &PlanArgs) -> Result<()> {
    let opts = PlanOptions {
        config: ModelConfig::preset(&args.model)?,
        dtype: if args.dtype == "f16" {
            DType::F16
        } else {
            DType::F32
        },
        devices: args.devices,
        batches: args.batches.clone(),
        seqs: args.seqs.clone(),
        profiles: args
            .hosts
            .iter()
            .map(|h| HostProfile::resolve(h).map_err(WgparError::from))
            .collect::<Result<Vec<_>>>()?,
        decode_steps: args.decode_steps,
    };
    let rows = plan(&opts)?;
    if args.json {
        let text = serde_json::to_string_pretty(&rows).map_err(|source| WgparError::Json {
            what: "the plan".into(),
            source,
        })?;
        println!("{text}");
    } else {
        print!("{}", plan_markdown(&opts, &rows));
    }
    Ok(())
}
