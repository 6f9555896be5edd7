//! `wgpar plan`: modeled projections of a model on host profiles, per engine (no GPU and no
//! weights needed).

use clap::Args;
use std::path::Path;
use wgpar::compare::{
    default_strategies, plan, plan_markdown, plan_model, PlanOptions, PlanStrategy,
};
use wgpar::device::DType;
use wgpar::model::memory::{FileBlocks, Vectors, WeightFormat};
use wgpar::model::quant::QuantType;
use wgpar::model::ModelConfig;
use wgpar::parallel::Strategy;
use wgpar::sim::{Engine, HostProfile, NumFormat};
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

/// Longest context `plan --max-seq` models (16M tokens: beyond any published model's).
const MAX_PLAN_CONTEXT: usize = 1 << 24;
/// Largest batch `plan --batches` models.
const MAX_PLAN_BATCH: usize = 1 << 20;

/// Refuses a pipeline strategy given with more micro-batches than the largest batch: no row
/// would run that many (each micro-batch needs a sequence).
fn check_micro_batches(strategies: &[PlanStrategy], batches: &[usize]) -> Result<()> {
    let largest = batches.iter().copied().max().unwrap_or(0);
    for s in strategies {
        let m = match s.strategy {
            Strategy::Pipeline { micro_batches, .. } | Strategy::Hybrid { micro_batches, .. } => {
                micro_batches
            }
            _ => continue,
        };
        if m > largest {
            return Err(WgparError::unsupported(format!(
                "--strategies {}: {m} micro-batches, but the largest of --batches is {largest}: \
                 each micro-batch needs a sequence, so at most {largest} would run; give -m{largest} \
                 or less, or larger --batches",
                s.label
            )));
        }
    }
    Ok(())
}

/// Everything `plan` needs, checked before anything is modeled.
fn options(args: &PlanArgs) -> Result<PlanOptions> {
    let mut config = plan_model(&args.model)?;
    if let Some(m) = args.max_seq {
        if m == 0 || m > MAX_PLAN_CONTEXT {
            return Err(WgparError::option(
                "--max-seq",
                format!("--max-seq {m}: model a context of 1 to {MAX_PLAN_CONTEXT} tokens"),
            ));
        }
        config.max_seq = m;
        // The tables sized by the context stay within the model's size bounds.
        config.validate()?;
    }
    if let Some(&b) = args.batches.iter().find(|&&b| b > MAX_PLAN_BATCH) {
        return Err(WgparError::option(
            "--batches",
            format!("--batches {b}: model batches of at most {MAX_PLAN_BATCH} sequences"),
        ));
    }
    let weights: NumFormat = args
        .weights
        .parse()
        .map_err(|e| WgparError::option("--weights", format!("--weights: {e}")))?;
    if args.devices == 0 {
        return Err(WgparError::option(
            "--devices",
            "--devices 0: a configuration needs at least one device".into(),
        ));
    }
    let strategies = if args.strategies.is_empty() {
        default_strategies(&config, args.devices)
    } else {
        let given = args
            .strategies
            .iter()
            .map(|s| PlanStrategy::parse(s))
            .collect::<Result<Vec<_>>>()?;
        check_micro_batches(&given, &args.batches)?;
        given
    };
    let profiles = args
        .hosts
        .iter()
        .map(|h| HostProfile::resolve(h).map_err(WgparError::from))
        .collect::<Result<Vec<_>>>()?;
    let engines = args
        .engines
        .iter()
        .map(|e| Engine::resolve(e).map_err(WgparError::from))
        .collect::<Result<Vec<_>>>()?;
    // The wgpar engine is projected only with weights its runtime can hold (`--dtype`,
    // `--weights`); other engines take any format.
    let loadable = matches!(
        weights,
        NumFormat::F32 | NumFormat::F16 | NumFormat::Q8_0 | NumFormat::Q4_0 | NumFormat::Q4K
    );
    if !loadable && engines.iter().any(|e| e.name == "wgpar") {
        return Err(WgparError::unsupported(format!(
            "--weights {}: the wgpar runtime holds f32, f16, q8_0, q4_0, q4_k and q6_k weights, \
             so the wgpar engine is not projected with this format; pick one of those, or \
             --engines without wgpar (e.g. cuda-nccl)",
            args.weights
        )));
    }
    let file_format = gguf_format(&args.model, &config, weights)?;
    Ok(PlanOptions {
        config,
        weights,
        file_format,
        strategies,
        batches: args.batches.clone(),
        seqs: args.seqs.clone(),
        profiles,
        engines,
        decode_steps: args.decode_steps,
    })
}

/// A GGUF model's storage in the wgpar runtime: its layers in the file's own block types (or
/// re-packed when `--weights` names a block type, as `run --weights` does), its tables dense
/// (f32 under `--weights f32`, else f16). `None` for other models.
fn gguf_format(
    model: &str,
    config: &ModelConfig,
    weights: NumFormat,
) -> Result<Option<WeightFormat>> {
    let path = Path::new(model);
    if !wgpar::model::gguf::is_gguf(path) {
        return Ok(None);
    }
    let gguf = wgpar::model::gguf::Gguf::open(path)?;
    let (dense, packed) = match weights {
        NumFormat::F32 => (DType::F32, None),
        NumFormat::Q8_0 => (DType::F16, Some(QuantType::Q8_0)),
        NumFormat::Q4_0 => (DType::F16, Some(QuantType::Q4_0)),
        NumFormat::Q4K => (DType::F16, Some(QuantType::Q4K)),
        _ => (DType::F16, None),
    };
    Ok(Some(WeightFormat {
        dense,
        packed,
        blocks: FileBlocks::of_gguf(gguf.file(), config),
        vectors: Vectors::of_gguf(gguf.file()),
    }))
}

/// Models and prints.
pub fn run(args: &PlanArgs) -> Result<()> {
    let opts = options(args)?;
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
