//! `wgpar plan`: modeled projections of a model on host profiles, per engine (no GPU and no
//! weights needed).

use clap::Args;
use wgpar::compare::plan_request::PlanRequest;
use wgpar::compare::{plan, plan_markdown};
use wgpar::{Result, WgparError};

/// Options of `wgpar plan`.
#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    /// Model: a preset (llama-8b, llama2-70b, qwen2-72b, ...), a Hugging Face model folder or
    /// its config.json (GPT-2, Llama, Mistral, Qwen2 families; no weights needed).
    #[arg(
        long,
        default_value = "llama-8b",
        value_name = "PRESET|DIR|config.json"
    )]
    model: String,
    /// How the weights are stored: f32, f16, bf16, fp8, int8, int4, q8_0, q4_0, q4_k, or bytes
    /// per parameter (e.g. 0.6).
    #[arg(long, default_value = "f16", value_name = "FORMAT", alias = "dtype")]
    weights: String,
    /// Devices per configuration (used when --strategies is not given).
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Strategies to model: single, tpN, ppN, ppN-mM, tpNxppP, tpNxppP-mM (M micro-batches, or
    /// `best`: the count with the shortest decode step per batch).
    /// Default: single, tpN, ppN with 1 and 4N micro-batches for N = --devices.
    #[arg(long, value_delimiter = ',')]
    strategies: Vec<String>,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1536")]
    seqs: Vec<usize>,
    /// Model a longer context than the model's own (`max_seq`), e.g. for a long prompt.
    #[arg(long, value_name = "TOKENS")]
    max_seq: Option<usize>,
    /// Host profiles (shipped names or TOML paths).
    #[arg(
        long = "host",
        value_delimiter = ',',
        default_value = "pcie4-4gpu,dgx-h100"
    )]
    hosts: Vec<String>,
    /// Engines (shipped names or TOML paths), each projected onto every profile.
    #[arg(long, value_delimiter = ',', default_value = "wgpar,cuda-nccl")]
    engines: Vec<String>,
    /// Decode steps modeled (the request latency is prefill plus these steps).
    #[arg(long, default_value_t = 8)]
    decode_steps: usize,
    /// Print JSON rows instead of Markdown.
    #[arg(long)]
    json: bool,
}

impl PlanArgs {
    /// The request the options make.
    fn request(&self) -> PlanRequest<'_> {
        PlanRequest {
            model: &self.model,
            weights: &self.weights,
            devices: self.devices,
            strategies: &self.strategies,
            batches: &self.batches,
            seqs: &self.seqs,
            max_seq: self.max_seq,
            hosts: &self.hosts,
            engines: &self.engines,
            decode_steps: self.decode_steps,
        }
    }
}

/// Models and prints.
pub fn run(args: &PlanArgs) -> Result<()> {
    let opts = args.request().options()?;
    let rows = plan(&opts)?;
    if args.json {
        let text = serde_json::to_string_pretty(&rows).map_err(|source| WgparError::Json {
            what: "the plan".into(),
            source,
        })?;
        outln!("{text}")?;
    } else {
        out!("{}", plan_markdown(&opts, &rows))?;
    }
    Ok(())
}
